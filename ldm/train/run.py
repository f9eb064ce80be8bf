"""One training run's life, the same whichever driver runs its updates: the hand-written loop (`ldm.train.loop`) or
PaddleNLP's Trainer (`ldm.train.trainer`).

A driver says what its flags mean for the run (`RunPlan`: `loop_plan`, `trainer_plan`), hands the run what only it
makes (its process group, its optimizer, schedule and scaler, its trackers) and walks the run's steps (`Step`), in
their order, once each; `TrainingRun` does everything else. The steps and what happens at each are `Step`'s;
docs/architecture.md tells where each driver calls them. At each update between `BEGIN` and `END` a driver calls
`agree` (the update's one vote: `ldm.runtime.vote`), `updated` (the counters, the EMA), its log (`log_update`, or
the Trainer's own with `window_metrics`) and `between_updates` (progress, evaluation, sample images, the EMA
snapshot); it saves a checkpoint when `save_due` says (the loop) or on its own schedule (the Trainer), through
`save`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging

import paddle

from ldm.checkpoint.manager import CheckpointManager, Late, Part, optimizer_part, scaler_part, stateful
from ldm.checkpoint.resume import Resume
from ldm.checkpoint.run_folder import SNAPSHOTS, RunFolder
from ldm.config.args import RunArguments
from ldm.config.record import describe_run, hyperparameters, resolve_seed
from ldm.data.stream import TRUNCATED_CAPTIONS
from ldm.models.flops import throughput_metrics
from ldm.runtime import heartbeat
from ldm.runtime.compat import sharding_owners
from ldm.runtime.device import check_sharding, resolve_precision
from ldm.runtime.distributed import Distributed
from ldm.runtime.tracking import NullWriter, make_writer
from ldm.runtime.vote import UpdateVote
from ldm.train.batches import DataPosition
from ldm.train.elastic import NO_PRACTICAL_END, SampleClock
from ldm.train.health import NonFiniteGuard, batch_positions
from ldm.train.memory import check_host_memory, log_largest, memory_by_rank, readable
from ldm.train.metrics import EvalClock, MetricsWindow, evaluate
from ldm.train.native import agreed_flat_update
from ldm.train.objective import make_batches
from ldm.train.phases import PhaseClock, ProfileWindow
from ldm.train.preflight import check_before_writing
from ldm.train.progress import Progress, resolve_mode
from ldm.train.setup import setup_logging, sharding_layout
from ldm.train.signals import GracefulStop
from ldm.train.update import PER_TENSOR, build_update

logger = logging.getLogger("ldm.train")


class Step(enum.IntEnum):
    """The steps of a run's life, in their order; both drivers pass through them, each once (`TrainingRun.reach`
    refuses a step out of order). A list the run checks rather than callbacks an engine calls in turn (composer's
    `Event`): the Trainer path does not own its loop, PaddleNLP does, and reaches `HAND` and `BEGIN` from inside
    `trainer.train` through its hooks, so the run cannot call the steps itself; it can only see that they come in
    order. A run resumed at its end goes from `SIGNALS` to `END` (no update is left)."""

    PLAN = 1  # `TrainingRun(plan, dist)`: logging, the sharding layout, the folder's policy, the checkpoint to resume
    # (read once: `ldm.checkpoint.resume.Resume`), the seed, the precision; nothing is written
    BUILD = 2  # `build`: the objective (`ldm.train.objective`) and the run's record
    OPEN = 3  # `opened()`: the memory record and its check, the clock of samples, the checkpoint manager
    RESTORE = 4  # the one restore (`CheckpointManager.restore`): the weights, the clock of samples, the data
    # position; the parts whose objects come later hold their state (`ldm.checkpoint.manager.Late`)
    CHECK = 5  # the batches start from the position restored; the checks before the first write
    WRITE = 6  # the first write: the run folder, the objective's frozen parts, progress
    SIGNALS = 7  # `stoppable()`: SIGTERM/SIGINT become a stop the ranks agree on
    HAND = 8  # `hand`: the driver's optimizer, schedule and scaler; the update made for its form
    # (`ldm.train.update`); the held parts (these, the EMA) load
    BEGIN = 9  # `begin`: the random state restored (or seeded); the updates follow
    END = 10  # `end`: the last save sealed
    EXPORT = 11  # `export`: the stop's last line, or the objective's export
    CLOSE = 12  # at any exit of `opened()`: the save in flight, the loader, the trackers, the lock

def next_step(at: Step, step: Step) -> Step:
    """`step`, reached from `at`: a step after it (some may be passed over: a run resumed at its end has no updates),
    or `CLOSE` from anywhere; RuntimeError for a step again or before it."""
    if step <= at and step is not Step.CLOSE:
        raise RuntimeError(f"the run's step {step.name} comes after {at.name}, not again or before it")
    return step


def progress_target(step: int, max_steps: int, save_steps: int) -> tuple[int, str]:
    """(update the progress bar counts toward, its label). A run with no practical end (the original recipe sets
    max_train_steps 1e9) counts toward the next checkpoint instead, so the ETA means something."""
    if max_steps < NO_PRACTICAL_END:
        return max_steps, "train"
    target = min(max_steps, (step // save_steps + 1) * save_steps)
    return target, f"to checkpoint-{target}"


@dataclasses.dataclass
class RunPlan:
    """What a driver's flags say about the run's life, in one vocabulary (the loop's flags or PaddleNLP's)."""

    output_dir: str
    resume: str | None  # --resume_from_checkpoint: latest, auto, a folder, or None
    overwrite: bool
    save_steps: int
    checkpoints_kept: int | None  # --checkpoints_total_limit, --save_total_limit
    seed: int | None  # as given: None takes a resumed checkpoint's, else the recipe's
    mixed_precision: str  # no, fp16 or bf16, as asked
    sharding: list[str]  # --sharding's options (the loop's one, or PaddleNLP's)
    sharding_degree: int
    split_param: bool
    batch_size: int  # per rank and micro-step
    accumulation: int
    max_steps: int
    num_workers: int
    logging_steps: int
    image_logging_steps: int
    progress: str  # our progress output (the Trainer's own bar, when it draws one, leaves ours "none")
    report_to: list[str]  # trackers the run starts (the loop's: `track`); the Trainer starts its own
    driver_bar: bool = False  # the driver draws its own progress bar (the Trainer's, on a terminal)
    resize_note: str = ""  # what the driver adds to the message of a resume with another global batch


def loop_plan(loop, run_args: RunArguments, image_logging_steps: int) -> RunPlan:
    """The hand-written loop's flags (`ldm.config.args.LoopArguments`)."""
    return RunPlan(
        output_dir=loop.output_dir, resume=loop.resume_from_checkpoint, overwrite=loop.overwrite_output_dir,
        save_steps=loop.save_steps, checkpoints_kept=loop.checkpoints_total_limit, seed=loop.seed,
        mixed_precision=loop.mixed_precision, sharding=[loop.sharding] if loop.sharding else [],
        sharding_degree=loop.sharding_parallel_degree, split_param=False, batch_size=loop.train_batch_size,
        accumulation=loop.gradient_accumulation_steps, max_steps=loop.max_train_steps, num_workers=loop.num_workers,
        logging_steps=loop.logging_steps, image_logging_steps=image_logging_steps, progress=run_args.progress,
        report_to=loop.report_to or [])


def trainer_plan(args, run_args: RunArguments, image_logging_steps: int, is_main: bool) -> RunPlan:
    """PaddleNLP's TrainingArguments; `progress`: the Trainer draws its own bar on a terminal, ours prints lines
    in a log file (rank 0)."""
    resume = args.resume_from_checkpoint
    progress = resolve_mode(run_args.progress) if is_main else "none"
    return RunPlan(
        output_dir=args.output_dir, resume="latest" if resume in ("True", "true", True) else resume,
        overwrite=args.overwrite_output_dir, save_steps=args.save_steps, checkpoints_kept=args.save_total_limit,
        seed=args.seed,
        mixed_precision="fp16" if args.fp16 else "bf16" if args.bf16 else "no",
        sharding=[str(getattr(option, "value", option)) for option in args.sharding],
        sharding_degree=args.sharding_parallel_degree,
        split_param="split_param" in (args.sharding_parallel_config or "").split(),
        batch_size=args.per_device_train_batch_size, accumulation=args.gradient_accumulation_steps,
        max_steps=args.max_steps, num_workers=args.dataloader_num_workers, logging_steps=args.logging_steps,
        image_logging_steps=image_logging_steps, progress="lines" if progress == "lines" else "none",
        report_to=args.report_to, driver_bar=progress == "bar",
        resize_note=" (the Trainer path stretches its schedule over the new max_steps)")


def describe_profiles(profiles, run_dir: RunFolder) -> dict:
    """The post-hoc EMA's profiles and their snapshots' disk cost (the run's record), said once in the log."""
    described = profiles.describe()
    widths = ", ".join(f"{s:g} (gamma {g:.2f})" for s, g in zip(described["sigma_rels"], described["gammas"],
                                                                  strict=True))
    if profiles.snapshot_steps:
        logger.info("post-hoc EMA: profiles of sigma_rel %s; a snapshot every %d updates in %s, %s each (%s), %s per "
                    "1,000 updates", widths, profiles.snapshot_steps, run_dir.path(SNAPSHOTS),
                    readable(described["snapshot_bytes"]), profiles.dtype,
                    readable(described["bytes_per_1000_updates"]))
    else:
        logger.warning("post-hoc EMA: profiles of sigma_rel %s, in the checkpoints only: without "
                       "--ema_snapshot_steps no other width can be reconstructed", widths)
    return described


def shard_ema(ema, model, optimizer) -> None:
    """Under sharding, the EMA follows the optimizer's partition: each rank keeps the averages of the weights whose
    optimizer state it keeps (`ldm.models.ema.EMA.shard`). Nothing to do unsharded or without EMA."""
    shards = sharding_owners(optimizer)
    if ema is None or shards is None or ema.owner is not None:
        return
    owners, rank, group = shards
    owner = {name: owners[p.name] for name, p in model.named_parameters() if name in ema.parameters}
    ema.shard(owner, rank, lambda tensor, src: paddle.distributed.broadcast(tensor, src=group.ranks[src], group=group))
    logger.info("EMA sharded like the optimizer state: this rank keeps %d of %d averages", len(ema.shadow),
                len(ema.parameters))


class TrainingRun:
    def __init__(self, plan: RunPlan, dist: Distributed, run_args: RunArguments | None = None):
        """`Step.PLAN`: everything read and decided before the objective is built; nothing is written. `dist`: the
        driver's process group (the loop starts it, PaddleNLP's arguments have)."""
        self.plan, self.run_args, self.dist = plan, run_args or RunArguments(), dist
        self.at = Step.PLAN
        setup_logging(self.dist)
        check_sharding(set(plan.sharding) - {""}, plan.split_param)
        self.flat_update = agreed_flat_update(self.run_args.flat_update, self.dist)  # the driver's `FlatAdamW`
        self.shards, self.stage = sharding_layout(plan.sharding, plan.sharding_degree, self.dist)
        self.run_dir = RunFolder(plan.output_dir, self.dist, plan.checkpoints_kept)
        found = self.run_dir.check(plan.resume, plan.overwrite)
        self.resume = Resume(found) if found else None
        self.seed = resolve_seed(plan.seed, self.resume)
        self.precision = resolve_precision(plan.mixed_precision)
        self.clock = SampleClock(plan.batch_size * plan.accumulation * dist.world_size, dist.world_size,
                                 plan.max_steps)
        self.position = DataPosition()
        self.objective = self.record = self.data = self.trained = None  # `BUILD`
        self.batches = self.manager = self.guard = self.vote = self.window = self.flops = None  # `OPEN` to `WRITE`
        self.writer, self.progress = NullWriter(), None
        self.stop = self.eval_clock = None  # `SIGNALS`
        self.phases = PhaseClock(False)  # `SIGNALS`: where the updates' time goes (`--phase_timing`)
        self.optimizer = self.update = None  # `HAND`
        self.step, self.stopped = 0, False  # where the run continues from (`RESTORE`), ended, and whether on a stop
        self.data_counts = {}  # the data path's counts over ranks at the last log (`window_metrics`), for `end`
        self.log_through = None  # the driver's logger of scalars, when it has one (the Trainer's)
        self.closing = []  # what the driver opened that an exit closes (the Trainer's metrics file)

    def reach(self, step: Step) -> None:
        """The run is at `step`: after the one before it (a driver that calls them out of order is a bug)."""
        self.at = next_step(self.at, step)

    def build(self, objective, data, groups):
        """`Step.BUILD`: the objective (`objective()`, built on every rank alike) and the run's record of the argument
        `groups` (a collective); `data`: the data arguments its batches are started with."""
        self.reach(Step.BUILD)
        self.objective = objective()
        self.data = self.objective.data or data
        groups = tuple(self.data if group is data else group for group in groups)  # recorded as resolved
        self.record = describe_run(groups, dist=self.dist, num_workers=self.plan.num_workers,
                                   model=self.objective.identity(), precision=self.precision,
                                   update=self.flat_update or PER_TENSOR)  # as asked, until `hand`
        self.trained = [p for p in self.objective.model.parameters() if not p.stop_gradient]

    def hand(self, optimizer, schedule, scaler=None) -> None:
        """`Step.HAND`: the driver's optimizer (sharded already when the run shards), schedule and loss scaler (None:
        none), once they exist; the EMA keeps the optimizer's partition, the update is built for the form asked
        (`ldm.train.update`) and the run's record says the form built; each part loads what the restore held."""
        self.reach(Step.HAND)
        self.optimizer = optimizer
        averages = self.averages
        for ema in averages:
            shard_ema(ema, self.objective.model, optimizer)
        self.update = build_update(self.flat_update, optimizer, self.trained, averages)
        if self.record["world"]["update"] != self.update.form:
            self.record["world"]["update"] = self.update.form
            self.run_dir.amend({"world": self.record["world"]})
        self.manager.hand("optimizer", optimizer)
        self.manager.hand("lr_scheduler", schedule)
        if scaler is not None:
            self.manager.hand("scaler", scaler)
        self.manager.hand_averages()

    @property
    def averages(self) -> list:
        """The EMA and the post-hoc EMA's profiles: every average of the weights the update steps."""
        profiles = self.objective.ema_profiles
        return [ema for ema in (self.objective.ema, *(profiles.profiles if profiles else ())) if ema is not None]

    @property
    def max_steps(self) -> int:
        """The run's last update: the plan's, unless a resume changed the global batch (`ldm.train.elastic`)."""
        return self.clock.max_steps

    # -- set-up and teardown ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def opened(self, partition=None):
        """`Step.OPEN` to `Step.WRITE`, and `Step.CLOSE` at every exit; a failed check before the first write leaves
        nothing behind. `partition`: the driver's sharded optimizer's (`sharding_owners`) when it exists already (the
        loop's), which the memory record counts by."""
        self.reach(Step.OPEN)
        plan, dist, objective = self.plan, self.dist, self.objective
        profiles = objective.ema_profiles
        self.record["memory"] = memory_by_rank(objective.model, world_size=dist.world_size, sharding_degree=self.shards,
                                               stage=self.stage, ema=objective.ema is not None,
                                               owners=partition[0] if partition else None,
                                               ema_profiles=len(profiles.profiles) if profiles else 0)
        log_largest(self.record["memory"])
        if profiles is not None:
            self.record["ema_profiles"] = describe_profiles(profiles, self.run_dir)
        # before any work: a host that cannot hold the state and the snapshot's reservation ends here in one line
        check_host_memory(self.record["memory"], dist, async_save=self.run_args.async_save,
                          on_host=all(p.place.is_cpu_place() for p in self.trained[:1]))
        try:  # from here on, every exit closes what was opened (`finally`)
            if self.resume:  # a checkpoint of another autoencoder or text encoder is refused before it is read
                objective.check_resume(self.resume)
            self.manager = CheckpointManager(
                self.run_dir, dist, objective, save_steps=plan.save_steps, seed=self.seed, trained=self.trained,
                data_position=Part(self.position.state_dict, self.position.load_state_dict), record=self.record,
                async_save=self.run_args.async_save, parts={
                    # the driver's, handed over at `HAND` (in this order in the training state)
                    "optimizer": Late(lambda optimizer: optimizer_part(lambda: optimizer), own_file=True),
                    "lr_scheduler": Late(stateful), "scaler": Late(scaler_part, missing=lambda state: None),
                    "samples": Part(self.clock.state_dict, self.clock.load_state_dict,
                                    missing=lambda state: self.clock.assume(state["step"], state.get("world_size")))})
            self.restore()
            self.reach(Step.CHECK)
            self.batches = make_batches(objective, self.position, self.data, batch_size=plan.batch_size,
                                        seed=self.seed, dist=dist, num_workers=plan.num_workers)
            self.guard = NonFiniteGuard(dist, self.run_args.max_nonfinite_updates)
            self.vote, self.window = UpdateVote(dist.world_size), MetricsWindow()
            self.flops = check_before_writing(objective, self.batches, self.record, self.resume,
                                              allow_config_change=self.run_args.allow_config_change, dist=dist)
            self.reach(Step.WRITE)
            self.run_dir.create(self.resume.path if self.resume else None, self.record)  # the first write
            objective.write_frozen(self.run_dir)
            heartbeat.started(self.step)  # a failure from here on is one at update step + 1
            target, label = progress_target(self.step, self.max_steps, plan.save_steps)
            self.progress = Progress(plan.progress, total=target, initial=self.step, label=label,
                                     enabled=dist.is_main, seconds=self.run_args.progress_seconds)
            yield self
        except Exception as e:
            self.run_dir.record_failure(e)
            raise
        finally:
            self.reach(Step.CLOSE)
            if self.progress is not None:
                self.progress.close()  # an error's message then starts on a line of its own
            if self.manager is not None:
                self.manager.close()  # never leave with a save in flight
            if self.batches is not None:
                self.batches.close()  # loader workers and reader thread stop here, not during interpreter exit
            self.writer.close()
            for thing in self.closing:
                thing.close()
            self.run_dir.release()
        dist.barrier()

    def restore(self) -> None:
        """`Step.RESTORE`: resuming, the one restore (`CheckpointManager.restore`); the step the run continues from."""
        self.reach(Step.RESTORE)
        if self.resume is None:
            return
        self.step = self.manager.restore(self.resume)
        logger.info("resumed from %s at update %d (read in %.2f s)", self.resume.path, self.step,
                    self.manager.load_seconds)
        if self.clock.message:
            logger.warning("%s%s", self.clock.message, self.plan.resize_note)

    def track(self) -> None:
        """The run's own trackers and metrics file (the loop's; the Trainer's are its own, `ldm.train.trainer`)."""
        self.writer = make_writer(self.plan.report_to, self.run_dir.path(), hyperparameters(self.record),
                                  self.dist.is_main, resume_step=self.step if self.resume else None)

    @contextlib.contextmanager
    def stoppable(self):
        """`Step.SIGNALS`, around the updates (and the loop's export): the first SIGTERM or SIGINT is a stop every rank
        agrees on at the next update (`ldm.train.signals`); a repeated one during the last save is the same
        request."""
        self.reach(Step.SIGNALS)
        self.eval_clock = EvalClock()  # the evaluation's share of time counts from the first update
        self.phases = PhaseClock(self.run_args.phase_timing)
        window = self.run_args.profile_window
        if window is not None and not (window[0] <= self.max_steps and window[1] > self.step):
            logger.warning("--profile_steps %d-%d: this run %s, so nothing is profiled", *window,
                           f"ends at update {self.max_steps}" if window[0] > self.max_steps
                           else f"resumed after update {self.step}")
            window = None
        elif window is not None and window[1] > self.max_steps:
            logger.warning("--profile_steps %d-%d: this run ends at update %d, so the profile stops there", *window,
                           self.max_steps)
        self.profile = ProfileWindow(window, self.run_dir.path("profile"), self.dist.rank, self.phases)
        self.phases.on_restart = lambda: self.profile.begin(self.step)  # as the first update begins
        try:
            with GracefulStop(self.dist) as self.stop:
                yield self
        finally:
            self.profile.close()  # a run that ended inside the window

    def begin(self) -> None:
        """`Step.BEGIN`: the updates begin; the random state is restored (a fresh run's noise seeded per rank)."""
        self.reach(Step.BEGIN)
        self.manager.begin()

    def log(self, values: dict, step: int) -> None:
        """Scalars for the trackers, or through the driver's logger (the Trainer's: `log_through`)."""
        if self.log_through is not None:
            self.log_through(values)
        else:
            self.writer.scalars(values, step)

    def end(self, step: int, stopped: bool) -> None:
        """`Step.END`, after the last update (`stopped`: on a signal, before the end): the last save, written by every
        rank, sealed before anything reads it."""
        self.reach(Step.END)
        self.step, self.stopped = step, stopped
        self.manager.wait()
        self.log_saves(step)
        self.progress.close()
        if (cut := int(self.data_counts.get(f"data_{TRUNCATED_CAPTIONS}", 0))) and self.dist.is_main:
            logger.warning("%d of the %d captions read were longer than the %d tokens they are trained at: their ends "
                           "were cut (data_%s in metrics.jsonl)", cut, int(self.data_counts.get("data_ok", 0)),
                           self.data.model_max_length, TRUNCATED_CAPTIONS)

    def export(self, batches=None) -> None:
        """`Step.EXPORT`: the stop's last line, or the objective's export (`batches`: the iterator the driver drew
        from, which the export may go on drawing from; default the batches)."""
        self.reach(Step.EXPORT)
        if self.stopped:
            self.stop.announce(self.step, self.manager.last, self.manager.sealed)
        else:
            if self.update is not None:  # none when a run resumed at its end made none
                self.update.free()
            self.objective.export(self.manager.last, self.batches if batches is None else batches, self.dist,
                                  self.run_dir)

    @property
    def result(self) -> dict:
        """{"step", "checkpoint", "exit_code"}: 128 + the signal's number after a graceful stop."""
        return {"step": self.step, "checkpoint": self.manager.last,
                "exit_code": self.stop.exit_code if self.stopped else 0}

    # -- every update ---------------------------------------------------------------------------------------
    @paddle.no_grad()
    def agree(self, loss, grad_norm, clip_factor=None) -> bool:
        """The update's one vote, the same outcome on every rank: whether to skip it (the non-finite guard; the clip
        factor is left in `guard.clip_factor`), whether to stop (`stop.agreed`), and how the save in flight goes."""
        votes = self.vote.cast({**self.guard.ballots(loss, grad_norm, clip_factor),
                                "signalled": float(self.stop.signalled()), **self.manager.ballots()})
        skipped = self.guard.settle(votes)
        self.stop.settle(bool(votes["signalled"]))
        self.manager.settle(votes)
        return skipped

    def updated(self, step: int, skipped: bool, *, loss, grad_norm) -> None:
        """After the optimizer step of update `step`: the window, the guard's count, the clock of samples and the
        EMA (not stepped for a skipped update)."""
        self.window.add_update(grad_norm, skipped)
        heartbeat.beat(step)
        self.guard.record(step, skipped, loss=loss, grad_norm=grad_norm,
                          where=batch_positions(self.batches.tracker.state_dict()) if skipped else "")
        if skipped:
            self.clock.skip()
        else:
            self.clock.advance()
            if self.objective.ema is not None:
                self.objective.ema.update()
        if self.objective.ema_profiles is not None:
            self.objective.ema_profiles.updated(skipped)
        self.phases.lap("ema")

    def window_metrics(self, logs: dict, with_loss: bool = True) -> dict:
        """`logs` with the window's means, the data path's figures, the guard's count, the throughput and, with
        `--phase_timing`, where the window's time went (this rank's: `ldm.train.phases`); under `python -m ldm.launch`,
        how many times it restarted the job (`restarts`)."""
        logs.update(self.window.read(self.dist, self.batches, with_loss=with_loss))
        self.data_counts = {name: value for name, value in logs.items() if name.startswith("data_")}
        logs.update(self.guard.read())
        logs.update(self.phases.read())
        logs.update(heartbeat.restarts_so_far())
        logs.update(throughput_metrics(self.flops and self.flops.mean(logs), logs["global_samples_per_second"],
                                       self.dist.world_size, self.run_args.peak_tflops))
        return logs

    def log_due(self, step: int, last: bool) -> bool:
        return step % self.plan.logging_steps == 0 or last or self.stop.agreed or self.guard.exhausted

    def log_update(self, step: int, logs: dict) -> None:
        """The loop's log of the window (every rank: it holds collectives)."""
        metrics = self.window_metrics(logs)
        self.log(metrics, step)
        self.progress.show({"loss": f"{metrics['loss']:.4f}",
                            "samples_s": f"{metrics['global_samples_per_second']:.1f}",
                            "data_wait": f"{metrics['data_wait_fraction']:.0%}"})

    def stop_if_exhausted(self) -> None:
        """After the update's log: the one-line stop once the guard skipped too many updates in a row."""
        self.guard.stop_if_exhausted(self.manager)  # every rank at the same update: the verdict is shared

    def between_updates(self, step: int, *, last: bool, logging_step: bool, batch=None) -> None:
        """After update `step` and the driver's log: progress, held-out evaluation and sample images when due, the
        post-hoc EMA's snapshot when due."""
        self.progress.update(step, logging_step=logging_step, saving=self.manager.in_flight)
        if self.objective.validation_due(step, last) and not self.stop.agreed:
            self.log(evaluate(self.objective, self.dist, step, self.eval_clock, self.batches), step)
        if self.plan.image_logging_steps and step % self.plan.image_logging_steps == 0:
            self.objective.log_images(self.writer, step, batch)  # every rank: a sharded EMA is gathered first
        profiles = self.objective.ema_profiles
        if profiles is not None and profiles.snapshot_due(step, last=last, stopping=self.stop.agreed):
            self.phases.lap("other")
            self.manager.save_ema_snapshot(step)
            self.phases.lap("checkpoint")

    def save_due(self, step: int, last: bool) -> bool:
        """Whether checkpoint-<step> is due on the run's schedule (`--save_steps`, the last update, a stop)."""
        return self.manager.due(step, last=last, stopping=self.stop.agreed)

    def done(self, step: int) -> None:
        """Update `step`'s bookkeeping done: its time, the profile's window."""
        self.phases.lap("other")
        self.profile.after(step)

    def log_saves(self, step: int) -> None:
        """The metrics of the saves sealed since the last call (rank 0's)."""
        for values in self.manager.take_metrics():
            self.log(values, step)

    def save(self, step: int, also=None) -> None:
        """checkpoint-<step> (`also(folder)` adds files); an endless run's progress then counts toward the next."""
        self.phases.lap("other")
        self.manager.save(step, also=also)
        self.phases.lap("checkpoint")
        if step >= self.progress.total and not self.stop.agreed:
            self.progress.retarget(*progress_target(step, self.max_steps, self.plan.save_steps))
