"""What the rest of a run does when it resumes with another global batch (another number of ranks, per-rank
batch or accumulation): one pure function, `describe_resize`, for the training loops to log and apply.

Policy: **keep the schedule in samples seen.** A run is asked for `max_steps` updates of the global batch it
started with, i.e. `max_steps x saved_global_batch` samples; that is what the user planned (an epoch count,
a compute budget), and the data layer resumes the interrupted pass exactly (`ldm.data.resume`), so the
samples are the measure that survives a resize.

- The update counter is kept: update `step` stays `step` (checkpoint names, logs and trackers continue, never
  jump back), and the remaining samples `(max_steps - step) x saved_global_batch` are divided into updates of
  the new global batch, rounded up so that no sample planned is dropped:
  `new_max_steps = step + ceil((max_steps - step) x saved_global_batch / new_global_batch)`.
- The learning-rate schedule (defined in updates) follows samples, not updates: for an update u after
  the resize, the original schedule is evaluated at `step + (u - step) x new_global_batch / saved_global_batch`
  (warm-up and decay end where they would have in samples): `SampleClock.position`, which the hand-written
  loop steps its schedule to. PaddleNLP's Trainer steps its own schedule once per update, so on that path
  the schedule is stretched over the new `max_steps`, the nearest it allows.
- The peak learning rate is not rescaled (no linear-scaling rule applied behind the user's back): the message
  says the batch changed, so a user who wants the rule can pass a new `--learning_rate`.
- A run with no practical end (the original recipe's 10**9 updates) keeps its `max_steps`; a run at or past its
  end has nothing to redistribute.
"""

from __future__ import annotations

import math

NO_PRACTICAL_END = 10**8  # updates: a max_steps this large is a "run until stopped"


def describe_resize(saved_world_size: int, saved_global_batch: int, new_world_size: int, new_global_batch: int,
                    step: int, max_steps: int, *, reference_batch: int | None = None,
                    samples: int | None = None) -> tuple[str, int]:
    """(one log line saying what happens to the step count, the schedule and max_steps; the new max_steps).

    `max_steps` counts updates of the run's first global batch (`reference_batch`, default the saved one), and
    `samples` is what the run has seen (default `step` updates of the saved batch).
    """
    reference_batch = saved_global_batch if reference_batch is None else reference_batch
    samples = step * saved_global_batch if samples is None else samples
    if min(saved_world_size, saved_global_batch, new_world_size, new_global_batch, reference_batch) < 1 or \
            step < 0 or max_steps < 0 or samples < 0:
        raise ValueError("world sizes and global batches must be positive, step, samples and max_steps not negative")
    ranks = f"{saved_world_size} -> {new_world_size} ranks"
    if saved_global_batch == new_global_batch == reference_batch and samples == step * reference_batch:
        return (f"resumed at update {step} on {ranks} with the same global batch ({new_global_batch}): updates, "
                f"learning-rate schedule and max_steps ({max_steps}) continue unchanged"), max_steps
    batches = f"global batch {saved_global_batch} -> {new_global_batch}"
    planned = max_steps * reference_batch
    if max_steps >= NO_PRACTICAL_END or samples >= planned:
        why = "no practical end" if max_steps >= NO_PRACTICAL_END else "nothing left to train"
        return (f"resumed at update {step} on {ranks}, {batches}: max_steps {max_steps} kept ({why}); the "
                "learning-rate schedule continues in samples seen"), max_steps
    remaining = math.ceil((planned - samples) / new_global_batch)
    new_max = step + remaining
    return (f"resumed at update {step} on {ranks}, {batches}: the schedule is kept in samples seen: the "
            f"remaining {planned - samples} of {planned} samples are {remaining} updates, max_steps "
            f"{max_steps} -> {new_max}; the learning-rate schedule advances {new_global_batch / reference_batch:g} "
            f"update(s) of the first batch per update; the peak learning rate is not rescaled"), new_max


class SampleClock:
    """Where a run is in samples: a checkpoint part, from which the learning-rate schedule's position and the
    run's last update follow (the policy above).

    `samples` counts what the updates consumed, skipped ones included (the plan of `--max_train_steps` is in
    samples consumed, as an uninterrupted run's is); `position`, the schedule's, counts only the updates
    that were applied, in updates of the run's first global batch (its reference). A run that never changes
    its global batch therefore steps its schedule exactly as before, one whole update at a time. Once a run
    has been resized, every later resume plans from the samples, even back on the first batch.
    """

    def __init__(self, global_batch: int, world_size: int, max_steps: int):
        self.global_batch, self.world_size, self.requested_max_steps = global_batch, world_size, max_steps
        self.reference_batch, self.max_steps = global_batch, max_steps
        self.samples = self.skipped_samples = self.updates = 0
        self.resized = False
        self.message = ""  # what a resume with another global batch changed, for the log

    def advance(self) -> None:
        self.samples += self.global_batch
        self.updates += 1

    def skip(self) -> None:
        """An update skipped (a non-finite loss or gradient): its samples were consumed, nothing was learned."""
        self.advance()
        self.skipped_samples += self.global_batch

    @property
    def position(self) -> int | float:
        position = (self.samples - self.skipped_samples) / self.reference_batch
        return int(position) if position.is_integer() else position

    def state_dict(self) -> dict:
        return {"reference_batch": self.reference_batch, "samples": self.samples, "updates": self.updates,
                "skipped_samples": self.skipped_samples, "resized": self.resized, "global_batch": self.global_batch,
                "world_size": self.world_size, "max_steps": self.max_steps}

    def assume(self, step: int, world_size: int | None = None) -> None:
        """A checkpoint that did not record its samples (no part `samples` in its training state): `step` updates
        of this run's per-rank batch on its `world_size` ranks."""
        world_size = world_size or self.world_size
        batch = self.global_batch // self.world_size * world_size
        self.load_state_dict({"reference_batch": batch, "samples": step * batch, "updates": step,
                              "global_batch": batch, "world_size": world_size, "max_steps": self.requested_max_steps})

    def load_state_dict(self, saved: dict) -> None:
        self.reference_batch, self.samples, self.updates = saved["reference_batch"], saved["samples"], saved["updates"]
        self.skipped_samples = saved.get("skipped_samples", 0)
        changed = (saved["world_size"], saved["global_batch"]) != (self.world_size, self.global_batch)
        self.resized = saved.get("resized", False) or changed or self.global_batch != self.reference_batch
        message, max_steps = describe_resize(saved["world_size"], saved["global_batch"], self.world_size,
                                             self.global_batch, self.updates, self.requested_max_steps,
                                             reference_batch=self.reference_batch, samples=self.samples)
        self.message = message if changed else ""
        self.max_steps = max(max_steps, self.updates) if self.resized else self.requested_max_steps
