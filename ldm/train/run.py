"""One training run's life, the same whichever driver runs its updates: the hand-written loop (`ldm.train.loop`) or
PaddleNLP's Trainer (`ldm.train.trainer`).

A driver says what its flags mean for the run (`RunPlan`: `loop_plan`, `trainer_plan`) and then hands the run
what only it makes; `TrainingRun` does everything else, once:

1. `TrainingRun(plan)`: logging, the sharding layout, the run folder's policy and the checkpoint to resume
   (read once: `ldm.checkpoint.resume.Resume`), the seed and the precision. Nothing is written.
2. `build(...)`: the objective (`ldm.train.objective`) and the run's record; `keep(...)`: the parts of the run
   state only the driver makes (its optimizer, schedule, scaler: functions that return them, so the Trainer's may
   come late); `adopt(optimizer)`: the driver's optimizer once it exists (the EMA is sharded like it, and the
   update built for its form: `ldm.train.update`). docs/architecture.md tells the order and the resume.
3. `with run.started():` the memory record, the batches, the checkpoint manager (`ldm.checkpoint.manager`), the
   non-finite guard, the checks before the first write, the first write, the restored state (the loop's; the
   Trainer restores in its hooks, `restore`), the trackers and progress; at every exit the save in flight, the
   loader, the trackers and the lock are closed, and a failure is recorded in the run folder.
4. `with run.stoppable():` around the updates: SIGTERM/SIGINT become a stop the ranks agree on. At each update the
   driver calls `agree` (the update's one vote: `ldm.runtime.vote`), `updated` (the counters, the EMA), the
   logging (`log_update`, or the Trainer's own log with `window_metrics`) and `between_updates` (progress,
   evaluation, sample images, saves); then `end` (the last save sealed) and `finish` (the stop's last line, or
   the export).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import paddle

from ldm.checkpoint.manager import CheckpointManager, Part, optimizer_part, scaler_part, stateful
from ldm.checkpoint.resume import Resume
from ldm.checkpoint.run_folder import SNAPSHOTS, RunFolder
from ldm.config.args import RunArguments
from ldm.config.record import describe_run, hyperparameters, resolve_seed
from ldm.data.stream import TRUNCATED_CAPTIONS
from ldm.models.flops import throughput_metrics
from ldm.runtime import heartbeat
from ldm.runtime.compat import sharding_owners
from ldm.runtime.device import check_sharding, resolve_precision
from ldm.runtime.distributed import Distributed, rank_seed
from ldm.runtime.tracking import NullWriter, make_writer
from ldm.runtime.vote import UpdateVote
from ldm.train.elastic import NO_PRACTICAL_END, SampleClock
from ldm.train.health import NonFiniteGuard, batch_positions
from ldm.train.memory import check_host_memory, log_largest, memory_by_rank, readable
from ldm.train.metrics import EvalClock, MetricsWindow, evaluate
from ldm.train.native import agreed_flat_update
from ldm.train.objective import start_batches
from ldm.train.phases import PhaseClock, ProfileWindow
from ldm.train.preflight import check_before_writing
from ldm.train.progress import Progress, resolve_mode
from ldm.train.setup import setup_logging, sharding_layout
from ldm.train.signals import GracefulStop
from ldm.train.update import PER_TENSOR, build_update

logger = logging.getLogger("ldm.train")

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
    report_to: list[str]  # trackers the run starts (the loop's); the Trainer starts its own
    # PaddleNLP's Trainer drives: its process group exists already, it starts its trackers, logs and saves on its own
    # schedule, restores the run state in its hooks; our progress counts to its max_steps
    trainer_drives: bool = False
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
        report_to=args.report_to, trainer_drives=True, driver_bar=progress == "bar",
        resize_note=" (the Trainer path stretches its schedule over the new max_steps)")


class Deferred:
    """An object's `state_dict` and setters, looked up when called: the Trainer makes its optimizer late."""

    def __init__(self, get):
        self._get = get

    def __getattr__(self, name):
        return lambda *args: getattr(self._get(), name)(*args)


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
    def __init__(self, plan: RunPlan, run_args: RunArguments | None = None):
        """Everything read and decided before the objective is built; nothing is written (see the module's doc)."""
        self.plan, self.run_args = plan, run_args or RunArguments()
        if plan.trainer_drives:
            import paddle.distributed as pdist

            self.dist = Distributed(pdist.get_rank(), pdist.get_world_size())
        else:
            self.dist = Distributed.init()
        setup_logging(self.dist)
        check_sharding(set(plan.sharding) - {""}, plan.split_param)
        self.flat_update = agreed_flat_update(self.run_args.flat_update, self.dist)  # the driver's `FlatAdamW`
        self.shards, self.stage = sharding_layout(plan.sharding, plan.sharding_degree, self.dist)
        self.run_dir = RunFolder(plan.output_dir, self.dist, plan.checkpoints_kept)
        found = self.run_dir.check(plan.resume, plan.overwrite)
        self.resume = Resume(found) if found else None
        self.seed = resolve_seed(plan.seed, self.resume)
        self.precision = resolve_precision(plan.mixed_precision)
        self.objective = self.record = self.data = self.trained = self.update = None  # `build`, `adopt`
        self.optimizer, self.parts = None, {}  # `adopt`, `keep`
        # `started`:
        self.batches = self.clock = self.manager = self.guard = self.vote = self.window = self.flops = None
        self.writer, self.progress = NullWriter(), None
        self.stop = self.eval_clock = None  # `stoppable`
        self.phases = PhaseClock(False)  # `stoppable`: where the updates' time goes (`--phase_timing`)
        self.step, self.stopped = 0, False  # where the run ended, and whether on a stop (`end`)
        self.data_counts = {}  # the data path's counts over ranks at the last log (`window_metrics`), for `end`
        self.log_through = None  # the driver's logger of scalars, when it has one (the Trainer's)
        self.closing = []  # what the driver opened that an exit closes (the Trainer's metrics file)

    def build(self, objective, data, groups):
        """The objective (`objective()`, built on every rank alike) and the run's record of the argument `groups`
        (a collective); `data`: the data arguments its batches are started with."""
        self.objective = objective()
        self.data = self.objective.data or data
        groups = tuple(self.data if group is data else group for group in groups)  # recorded as resolved
        self.record = describe_run(groups, dist=self.dist, num_workers=self.plan.num_workers,
                                   model=self.objective.identity(), precision=self.precision,
                                   update=self.flat_update or PER_TENSOR)  # as asked, until `adopt`
        self.trained = [p for p in self.objective.model.parameters() if not p.stop_gradient]

    def adopt(self, optimizer) -> None:
        """The driver's optimizer (sharded already when the run shards): the EMA keeps the same partition, and the
        update is built for the form asked (`ldm.train.update`); the run's record says the form built."""
        self.optimizer = optimizer
        averages = self.averages
        for ema in averages:
            shard_ema(ema, self.objective.model, optimizer)
        self.update = build_update(self.flat_update, optimizer, self.trained, averages)
        self.record["world"]["update"] = self.update.form
        if self.run_dir.created:  # the Trainer's optimizer comes after the first write
            self.run_dir.amend({"world": self.record["world"]})

    @property
    def averages(self) -> list:
        """The EMA and the post-hoc EMA's profiles: every average of the weights the update steps."""
        profiles = self.objective.ema_profiles
        return [ema for ema in (self.objective.ema, *(profiles.profiles if profiles else ())) if ema is not None]

    def keep(self, *, optimizer=None, schedule=None, scaler=None) -> None:
        """Parts of the run state the driver makes, each given as a function that returns it (looked up at each
        save and load: the Trainer makes them late). Their order is the checkpoint's (`training_state.json`):
        the parts kept before `started` come first, in the order optimizer, schedule, scaler, then the ones every run
        has; a part kept later comes after those (the Trainer's scaler, known once its Trainer exists)."""
        given = {"optimizer": optimizer and optimizer_part(optimizer),
                 "lr_scheduler": schedule and stateful(Deferred(schedule)),
                 "scaler": scaler and scaler_part(Deferred(scaler))}
        parts = self.manager.parts if self.manager is not None else self.parts
        parts.update({name: part for name, part in given.items() if part is not None})

    @property
    def max_steps(self) -> int:
        """The run's last update: the plan's, unless a resume changed the global batch (`ldm.train.elastic`)."""
        return self.clock.max_steps

    # -- set-up and teardown ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def started(self):
        """The run from its first write to its end (see the module's doc); a failed check before the first write
        leaves nothing behind."""
        plan, dist, objective = self.plan, self.dist, self.objective
        owners = sharding_owners(self.optimizer) if self.optimizer is not None else None
        profiles = objective.ema_profiles
        self.record["memory"] = memory_by_rank(objective.model, world_size=dist.world_size, sharding_degree=self.shards,
                                               stage=self.stage, ema=objective.ema is not None,
                                               owners=owners[0] if owners else None,
                                               ema_profiles=len(profiles.profiles) if profiles else 0)
        log_largest(self.record["memory"])
        if profiles is not None:
            self.record["ema_profiles"] = describe_profiles(profiles, self.run_dir)
        # before any work: a host that cannot hold the state and the snapshot's reservation ends here in one line
        check_host_memory(self.record["memory"], dist, async_save=self.run_args.async_save,
                          on_host=all(p.place.is_cpu_place() for p in self.trained[:1]))
        self.batches = start_batches(objective, self.resume, self.data, batch_size=plan.batch_size, seed=self.seed,
                                     dist=dist, num_workers=plan.num_workers)
        try:  # from here on, every exit stops the loader (`finally`)
            self.clock = SampleClock(plan.batch_size * plan.accumulation * dist.world_size, dist.world_size,
                                     plan.max_steps)
            if self.resume:
                self.clock.restore(self.resume.training_state)
                if self.clock.message and plan.trainer_drives:  # the loop says it once restored (`restore`)
                    logger.warning("%s%s", self.clock.message, plan.resize_note)
            self.guard = NonFiniteGuard(dist, self.run_args.max_nonfinite_updates)
            self.vote, self.window = UpdateVote(dist.world_size), MetricsWindow()
            self.flops = check_before_writing(objective, self.batches, self.record, self.resume,
                                              allow_config_change=self.run_args.allow_config_change, dist=dist)
            self.run_dir.create(self.resume.path if self.resume else None, self.record)  # the first write
            objective.start(self.run_dir)
            self.manager = CheckpointManager(
                self.run_dir, dist, objective, save_steps=plan.save_steps, seed=self.seed, trained=self.trained,
                data_position=self.batches.tracker.state_dict, record=self.record, async_save=self.run_args.async_save,
                parts={**self.parts, "samples": Part(self.clock.state_dict)})  # restored above, from the view
            self.manager.last = self.resume.path if self.resume else None
            if plan.trainer_drives:  # the Trainer restores in its hooks
                self.step = self.resume.step if self.resume else 0
            else:
                self.step = self.restore()
            if not plan.trainer_drives:
                self.writer = make_writer(plan.report_to, self.run_dir.path(), hyperparameters(self.record),
                                          dist.is_main, resume_step=self.step if self.resume else None)
            heartbeat.started(self.step)  # a failure from here on is one at update step + 1
            target, label = (self.max_steps, "train") if plan.trainer_drives else \
                progress_target(self.step, self.max_steps, plan.save_steps)
            self.progress = Progress(plan.progress, total=target, initial=self.step, label=label,
                                     enabled=dist.is_main, seconds=self.run_args.progress_seconds)
            yield self
        except Exception as e:
            self.run_dir.record_failure(e)
            raise
        finally:
            if self.progress is not None:
                self.progress.close()  # an error's message then starts on a line of its own
            if self.manager is not None:
                self.manager.close()  # never leave with a save in flight
            self.batches.close()  # loader workers and reader thread stop here, not during interpreter exit
            self.writer.close()
            for thing in self.closing:
                thing.close()
            self.run_dir.release()
        dist.barrier()

    @contextlib.contextmanager
    def stoppable(self):
        """The updates (and the loop's export): the first SIGTERM or SIGINT is a stop every rank agrees on at the next
        update (`ldm.train.signals`); a repeated one during the last save is the same request."""
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

    def log(self, values: dict, step: int) -> None:
        """Scalars for the trackers, or through the driver's logger (the Trainer's: `log_through`)."""
        if self.log_through is not None:
            self.log_through(values)
        else:
            self.writer.scalars(values, step)

    def restore(self, names=None, *, weights: bool = True) -> int:
        """Resuming: the objective's weights (`weights`) and the parts `names` (all when None) from the checkpoint;
        a fresh run seeds each rank's noise. Returns the step the run continues from. The loop's run restores all at
        its start; the Trainer's in its hooks, in three calls."""
        if self.resume is None:
            if names is None or "random" in names:
                paddle.seed(rank_seed(self.seed, self.dist.rank))
            return 0
        step = self.manager.load(self.resume, names, weights=weights)
        if names is None:
            logger.info("resumed from %s at update %d (read in %.2f s)", self.resume.path, step,
                        self.manager.load_seconds)
            if self.clock.message:
                logger.warning("%s%s", self.clock.message, self.plan.resize_note)
        return step

    def end(self, step: int, stopped: bool) -> None:
        """After the last update (`stopped`: on a signal, before the end): the last save, written by every rank, sealed
        before anything reads it."""
        self.step, self.stopped = step, stopped
        self.manager.wait()
        self.log_saves(step)
        self.progress.close()
        if (cut := int(self.data_counts.get(f"data_{TRUNCATED_CAPTIONS}", 0))) and self.dist.is_main:
            logger.warning("%d of the %d captions read were longer than the %d tokens they are trained at: their ends "
                           "were cut (data_%s in metrics.jsonl)", cut, int(self.data_counts.get("data_ok", 0)),
                           self.data.model_max_length, TRUNCATED_CAPTIONS)

    def finish(self, batches=None) -> None:
        """The stop's last line, or the objective's export (`batches`: the iterator the driver drew from, which the
        export may go on drawing from; default the batches)."""
        if self.stopped:
            self.stop.announce(self.step, self.manager.last, self.manager.sealed)
        else:
            if self.update is not None:  # None: a resumed finished run, on the Trainer path, built no optimizer
                self.update.release()
            self.objective.finish(self.manager.last, self.batches if batches is None else batches, self.dist,
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
        """After update `step` and (on the loop) its log: progress, the stop of an exhausted guard (the Trainer logs
        later, and stops then), held-out evaluation and sample images when due, the checkpoint when due (the Trainer
        saves on its own schedule: `save`), the sealed saves' metrics."""
        drives = self.plan.trainer_drives
        if drives:
            self.log_saves(step)
        self.progress.update(step, logging_step=logging_step, saving=self.manager.in_flight)
        if not drives:
            self.stop_if_exhausted()
        if self.objective.validation_due(step, last) and not self.stop.agreed:
            self.log(evaluate(self.objective, self.dist, step, self.eval_clock, self.batches), step)
        if self.plan.image_logging_steps and step % self.plan.image_logging_steps == 0:
            self.objective.log_images(self.writer, step, batch)  # every rank: a sharded EMA is gathered first
        profiles = self.objective.ema_profiles
        if profiles is not None and profiles.snapshot_due(step, last=last, stopping=self.stop.agreed):
            self.phases.lap("other")
            self.manager.save_ema_snapshot(step)
            self.phases.lap("checkpoint")
        if not drives and self.manager.due(step, last=last, stopping=self.stop.agreed):
            self.save(step)
        if not drives:
            self.log_saves(step)
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
        if not self.plan.trainer_drives and step >= self.progress.total and not self.stop.agreed:
            self.progress.retarget(*progress_target(step, self.max_steps, self.plan.save_steps))
