"""The non-finite guard: an update whose loss or gradient norm is NaN or inf is skipped on every rank.

The verdict is computed on the device (`isfinite` of the update's loss and of the global gradient
norm) and cast as ballots in the update's one vote (`ldm.runtime.vote`), beside the graceful stop's
and the checkpoint manager's: the one host read that vote makes at every update answers all of them, so
every rank skips the same updates. The skip is Paddle's own, the `found_inf` flag its GradScaler uses: AdamW leaves
the weights, both moments and its bias-correction counters as they were; the schedule and the EMA are
not stepped. Under fp16 the verdict is merged into the scaler's (which lowers the loss scale).

Paddle's AdamW cannot skip on the device alone: its dygraph step tests the flag on the host
(`Optimizer._apply_optimize`) and its GPU kernel copies `SkipUpdate` to the host
(`phi/kernels/gpu/adamw_kernel.cu`). A single process therefore reads a two-element flag once per
update, where it read nothing before (on a GPU, a host synchronisation after the backward pass); with
several ranks it is the read the stop vote made anyway. The same read brings the clip factor to the
host, so that the rescaling pass over every gradient runs only when the norm exceeds
`--max_grad_norm`, without a device read of its own.

Each skip is logged with the update and where the rank's batches came from, and counted
(`train/nonfinite_skips`, per logging window). `max_nonfinite_updates` skips in a row stop the run
with one line naming the last good checkpoint (`NonFiniteStop`): every rank reaches it at the same
update. The checkpoint manager refuses to write weights that are not finite
(`ldm.checkpoint.manager.check_weights`).
"""

from __future__ import annotations

import logging

import paddle

from ldm.runtime.compat import skip_step_if, step_was_skipped
from ldm.runtime.errors import NonFiniteStop

logger = logging.getLogger("ldm.train")


class NonFiniteGuard:
    def __init__(self, dist, max_in_row: int):
        self.dist, self.max_in_row = dist, max_in_row
        self.clip_factor = 1.0  # the last `check`'s: what clipping multiplies the gradients by
        self.in_row = 0  # skipped updates in a row, up to the last one
        self.window_skips = 0  # since the last `read`
        self.total_skips = 0
        self.last_step = 0

    @paddle.no_grad()
    def ballots(self, loss: paddle.Tensor, grad_norm: paddle.Tensor, clip_factor=None) -> dict:
        """The guard's ballots in the update's vote (`ldm.runtime.vote`), on the device: whether `loss` (this rank's
        loss of the update, its micro-steps summed) or `grad_norm` (the norm of the synchronised gradients) is not
        finite, and the negated `clip_factor` (`ldm.train.gradients.clip_factor`; negated, so that the vote's MAX
        gives every rank the smallest factor)."""
        bad = paddle.logical_not(paddle.isfinite(loss.astype("float32").reshape([1]))
                                 & paddle.isfinite(grad_norm.astype("float32").reshape([1]))).astype("float32")
        negated = -clip_factor.astype("float32").reshape([1]) if clip_factor is not None else \
            paddle.full([1], -1.0, dtype="float32")
        return {"nonfinite": bad, "negated_clip_factor": negated}

    def settle(self, votes: dict[str, float]) -> bool:
        """Whether to skip this update, the same on every rank (the vote's outcome); the clip factor is kept as
        `self.clip_factor` (1.0 without one): the loop rescales the gradients only when it is below 1, by a number
        already on the host."""
        self.clip_factor = -votes["negated_clip_factor"]
        return bool(votes["nonfinite"])

    def hand_to(self, optimizer, skipped: bool, scaler=None) -> None:
        """Make the coming `optimizer.step()` (or `scaler.step`) skip the update when the verdict says so: as a
        Python bool, which Paddle's step tests without reading the device; merged into an enabled scaler's own
        verdict (a tensor the scaler reads anyway), which then also lowers the loss scale."""
        skip_step_if(skipped, optimizer, scaler)

    @staticmethod
    def was_skipped(optimizer) -> bool:
        """After the step: whether the optimizer skipped it (ours, or an fp16 overflow the scaler found)."""
        return step_was_skipped(optimizer)

    def record(self, step: int, skipped: bool, *, loss: paddle.Tensor | None = None,
               grad_norm: paddle.Tensor | None = None, where: str = "") -> None:
        """Count update `step`; a skip is logged with its figures and `where` its batches came from. After
        `max_in_row` in a row the guard is `exhausted` (the same update on every rank: the verdict is shared)."""
        self.last_step = step
        if not skipped:
            self.in_row = 0
            return
        self.in_row += 1
        self.window_skips += 1
        self.total_skips += 1
        figures = ", ".join(f"{name} {float(value):.4g}" for name, value in (("loss", loss), ("grad norm", grad_norm))
                            if value is not None)
        logger.warning("update %d skipped (%d in a row): non-finite %s%s", step, self.in_row, figures or "values",
                       f"; batches of rank {self.dist.rank}: {where}" if where else "")

    @property
    def exhausted(self) -> bool:
        return self.in_row >= self.max_in_row

    def stop_if_exhausted(self, checkpoints) -> None:
        """Raise `NonFiniteStop` once `max_in_row` updates in a row were skipped (call after logging them), naming
        the newest checkpoint of `checkpoints` (the manager), saved or resumed (a save in flight is finished first:
        every rank stops at this update)."""
        if self.exhausted:
            checkpoints.wait()
            raise NonFiniteStop(
                f"{self.in_row} updates in a row (the last at update {self.last_step}) had a non-finite loss or "
                f"gradient norm and were skipped: the run stops. The last good checkpoint is "
                f"{checkpoints.last or 'none'}; lower the learning rate or look at the data of those updates "
                "before resuming")

    def read(self) -> dict[str, float]:
        """The window's count for the logged metrics (`train/nonfinite_skips`); then a new window."""
        count, self.window_skips = self.window_skips, 0
        return {"nonfinite_skips": count}


def batch_positions(stream_state: dict) -> str:
    """Where a rank's batches of this update came from: each loader slot's pass, shard unit and last line read
    (records are shuffled within `shuffle_buffer`, so a batch holds lines up to there)."""
    slots = stream_state.get("slots", {})
    return "; ".join(f"slot {slot} pass {s.get('pass')} unit {s.get('unit')} up to line {s.get('line')}"
                     for slot, s in sorted(slots.items(), key=lambda item: int(item[0]))) or "unknown"
