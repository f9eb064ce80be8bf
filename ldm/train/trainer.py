"""The PaddleNLP `Trainer` path (`train_txt2img_laion400m_trainer.py`).

PaddleNLP runs the loop, mixed precision, sharding and gradient accumulation. The subclass overrides
only what it must: the loss (the objective's), the dataloader (the streaming batches), and checkpoints,
which the same `Checkpointer` as the hand-written loop writes and reads (weights once, in the pipeline
layout; optimizer, schedule, scaler, random state and data position as JSON and safetensors, never
PaddleNLP's pickles), plus PaddleNLP's own `trainer_state.json`, which it reads back itself. Resuming
restores the data position (`ignore_data_skip` is forced on: no batch is replayed).
"""

from __future__ import annotations

import logging
import os

import paddle
import paddle.distributed as pdist
from paddlenlp.trainer import Trainer, TrainerCallback
from paddlenlp.trainer.trainer import TRAINER_STATE_NAME
from paddlenlp.utils.log import logger as paddlenlp_logger

from ldm.checkpoint.format import read_training_state
from ldm.checkpoint.run_folder import RunFolder, checkpoint_step
from ldm.config.args import RunArguments, ValidationArguments
from ldm.config.record import describe_run, hyperparameters, resolve_seed
from ldm.models.flops import throughput_metrics
from ldm.runtime.compat import check_trainer_hooks, loss_scale, save_trainer_checkpoint
from ldm.runtime.device import check_sharding, resolve_precision
from ldm.runtime.distributed import Distributed
from ldm.runtime.tracking import MetricsFile, NullWriter, Tracker, keep_wandb_run, tracker_name
from ldm.train import setup
from ldm.train.checkpointer import Checkpointer, optimizer_part, scaler_part, shard_ema, stateful
from ldm.train.elastic import SampleClock
from ldm.train.gradients import global_grad_norm
from ldm.train.health import NonFiniteGuard, batch_positions
from ldm.train.memory import log_largest, memory_by_rank
from ldm.train.metrics import EvalClock, MetricsWindow, evaluate
from ldm.train.objective import TextToImage, rank_seed, start_batches
from ldm.train.preflight import check_before_writing
from ldm.train.progress import Progress, resolve_mode
from ldm.train.signals import GracefulStop

logger = logging.getLogger("ldm.train")


class LDMCallback(TrainerCallback):
    """EMA updates, per-rank noise seeds or restored random state, gradient norms, the non-finite guard and
    sample images, at the Trainer's hooks."""

    def __init__(self, trainer: LDMTrainer):
        self.trainer = trainer
        self.grad_norm, self.skipped = None, False

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if t.resume_checkpoint:
            t.checkpointer.load(t.resume_checkpoint, ["random"], weights=False)
        else:
            paddle.seed(rank_seed(args.seed, t.dist.rank))
        if t.record is not None:
            t.writer.add_config(t.record, hyperparameters(t.record))

    def on_step_begin(self, args, state, control, **kwargs):
        t = self.trainer
        t.guard.stop_if_exhausted(t.checkpointer)  # when the Trainer did not log the update that exhausted it

    def on_optimizer_begin(self, args, state, control, scaler=None, **kwargs):
        # gradients are synchronised here and, under fp16, still multiplied by the loss scale
        t = self.trainer
        norm = global_grad_norm(t.trained)  # PaddleNLP clips (with --max_grad_norm) in its step
        self.grad_norm = norm / loss_scale(scaler) if scaler is not None else norm
        # the update's one host read: the non-finite verdict and the stop vote, agreed by every rank
        t.guard.hand_to(t.optimizer, t.guard.check(t.update_loss, self.grad_norm, t.stop, saves=t.checkpointer), scaler)

    def on_optimizer_end(self, args, state, control, scaler=None, **kwargs):
        t = self.trainer
        self.skipped = t.guard.was_skipped(t.optimizer)
        if self.skipped and scaler is None:
            # PaddleNLP steps the schedule unless its scaler saw an overflow: take that step back
            t.lr_scheduler.last_epoch -= 1
            t.lr_scheduler.last_lr = t.lr_scheduler.get_lr()
        t.window.add_update(self.grad_norm, self.skipped)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        t.guard.record(state.global_step, self.skipped, loss=t.update_loss, grad_norm=self.grad_norm,
                       where=batch_positions(t.data_stream.tracker.state_dict()) if self.skipped else "")
        t.update_loss = paddle.zeros([])
        if t.guard.exhausted:
            control.should_log = True  # the window that ends the run is logged first (`LDMTrainer.log` stops it)
        if self.skipped:
            t.clock.skip()
        else:
            t.clock.advance()
        if t.objective.ema is not None and not self.skipped:
            t.objective.ema.update()
        for values in t.checkpointer.take_metrics():  # rank 0's: sealed saves
            t.log_aside(control, values)
        if t.progress is not None:
            t.progress.update(state.global_step, logging_step=state.global_step % args.logging_steps == 0,
                              saving=t.checkpointer.in_flight)
        if t.objective.validation_due(state.global_step, state.global_step == state.max_steps) and not t.stop.agreed:
            t.log_aside(control, evaluate(t.objective, t.dist, state.global_step, t.eval_clock, t.data_stream))
        steps = t.objective.sampling.image_logging_steps
        if steps and state.global_step % steps == 0:
            t.objective.log_images(t.writer, state.global_step, None)
        if t.stop is not None and t.stop.agreed:  # SIGTERM/SIGINT (voted with the guard): save this update, stop
            control.should_save = control.should_training_stop = True


class LDMTrainer(Trainer):
    def __init__(self, *, objective: TextToImage, args, dist: Distributed, run_dir: RunFolder, data_stream,
                 clock: SampleClock, resume_checkpoint: str | None = None, record: dict | None = None,
                 run_args: RunArguments | None = None, flops: int | None = None):
        check_trainer_hooks()  # the overrides below must still be hooks of PaddleNLP's Trainer
        run_args = run_args or RunArguments()
        super().__init__(model=objective.model, args=args)
        self.objective, self.dist, self.run_dir, self.data_stream = objective, dist, run_dir, data_stream
        self.writer, self.resume_checkpoint, self.record = NullWriter(), resume_checkpoint, record
        self.stop: GracefulStop | None = None
        self.window, self.clock = MetricsWindow(), clock
        self.guard = NonFiniteGuard(dist, run_args.max_nonfinite_updates)
        self.flops, self.peak_tflops = flops, run_args.peak_tflops
        self.update_loss = paddle.zeros([])  # the update's loss so far (micro-steps summed), for the guard
        self.progress: Progress | None = None
        self.eval_clock = EvalClock()
        self.metrics: MetricsFile | None = None
        self.trained = [p for p in objective.model.parameters() if not p.stop_gradient]
        # the optimizer, schedule and scaler exist once `train()` made them: the parts ask for them then
        self.checkpointer = Checkpointer(
            run_dir, dist, objective, save_steps=args.save_steps, seed=args.seed, trained=self.trained,
            data_position=data_stream.tracker.state_dict, record=record, async_save=run_args.async_save,
            parts={"optimizer": optimizer_part(lambda: self.optimizer),
                   "lr_scheduler": stateful(Deferred(lambda: self.lr_scheduler)),
                   "samples": clock.part()})
        if self.do_grad_scaling:
            self.checkpointer.parts["scaler"] = scaler_part(Deferred(lambda: self.scaler))
        self.add_callback(LDMCallback(self))

    def get_train_dataloader(self):
        return self.data_stream

    def compute_loss(self, model, inputs, return_outputs=False):
        loss, extra = self.objective.loss(model, inputs)
        self.update_loss = self.update_loss + loss.detach()
        self.window.add_micro_step(loss, extra, 1 / self.args.gradient_accumulation_steps)
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict, **kwargs) -> None:
        if "loss" in logs:
            logs.update(self.window.read(self.dist, self.data_stream, with_loss=False))
            logs.update(self.guard.read())
            logs.update(throughput_metrics(self.flops and self.flops.mean(logs), logs["global_samples_per_second"],
                                           self.dist.world_size, self.peak_tflops))
        super().log(logs, **kwargs)
        if self.metrics is not None:  # every scalar the trackers got, under the names they show
            scalars = {tracker_name(k): v for k, v in logs.items()
                       if isinstance(v, int | float) and not isinstance(v, bool)}
            self.metrics.write(self.state.global_step, scalars)
        if "loss" in logs:  # the update's own log, on every rank (a save's metrics are rank 0's alone)
            self.guard.stop_if_exhausted(self.checkpointer)

    def log_aside(self, control, values: dict) -> None:
        """Log `values` between the update's hooks, leaving the update's own log due: PaddleNLP's `on_log` clears
        `should_log`, and the update's log holds collectives every rank must reach."""
        should_log = control.should_log
        self.log(values)
        control.should_log = self.control.should_log = should_log

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if resume_from_checkpoint:
            self.objective.load(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # the Trainer has made (and under sharding wrapped) its optimizer: the EMA follows its partition
        shard_ema(self.objective.ema, self.objective.model, self.optimizer)
        if checkpoint:
            self.checkpointer.load(checkpoint, ["optimizer", "lr_scheduler", "scaler", "ema"], weights=False)

    def _load_rng_state(self, checkpoint):
        """Restored at `on_train_begin` with the rest (PaddleNLP calls this only when it replays data)."""

    def _rotate_checkpoints(self, *args, **kwargs):
        """The run folder rotates, counting complete checkpoints only."""

    def _save_checkpoint(self, model, metrics=None):
        if self.checkpointer.has(self.state.global_step):
            return  # already saved at this update (a stop at the last update, or a resume of the last checkpoint)
        self.checkpointer.save(self.state.global_step,
                               also=lambda f: self.state.save_to_json(os.path.join(f, TRAINER_STATE_NAME)))


class Deferred:
    """An object's `state_dict` and setters, looked up when called: the Trainer makes its optimizer late."""

    def __init__(self, get):
        self._get = get

    def __getattr__(self, name):
        return lambda *args: getattr(self._get(), name)(*args)


def train(training_args, model_args, data, sampling, run_args: RunArguments | None = None,
          validation: ValidationArguments | None = None) -> dict:
    """The LDM through PaddleNLP's Trainer; ends with `<output_dir>/pipeline`. Inputs are checked before
    anything is written (see `ldm.train.loop.run`)."""
    run_args, validation = run_args or RunArguments(), validation or ValidationArguments()

    dist = Distributed(pdist.get_rank(), pdist.get_world_size())
    setup.setup_logging(dist)
    check_sharding({str(getattr(option, "value", option)) for option in training_args.sharding},
                   "split_param" in (training_args.sharding_parallel_config or "").split())
    degree, stage = setup.sharding_layout(training_args.sharding, training_args.sharding_parallel_degree, dist)
    resume = training_args.resume_from_checkpoint
    if resume in ("True", "true", True):
        resume = "latest"
    run_dir = RunFolder(training_args.output_dir, dist, training_args.save_total_limit)
    checkpoint = run_dir.check(resume, training_args.overwrite_output_dir)
    training_args.seed = resolve_seed(training_args.seed, checkpoint)
    precision = resolve_precision("fp16" if training_args.fp16 else "bf16" if training_args.bf16 else "no")
    if precision == "no":
        training_args.fp16 = training_args.bf16 = False
    training_args.ignore_data_skip = True  # the data position is restored, not replayed
    training_args.remove_unused_columns = False

    progress = resolve_mode(run_args.progress) if dist.is_main else "none"
    training_args.disable_tqdm = progress != "bar"  # PaddleNLP's bar, or its plain log lines and ours

    objective = TextToImage(model_args, data, sampling, recompute=training_args.recompute, seed=training_args.seed,
                            resume=checkpoint,
                            validation=validation)
    record = describe_run((model_args, data, sampling, training_args, run_args, validation), dist=dist,
                          num_workers=training_args.dataloader_num_workers, model=objective.identity(),
                          precision=precision)
    record["memory"] = memory_by_rank(objective.model, world_size=dist.world_size, sharding_degree=degree,
                                      stage=stage, ema=objective.ema is not None)
    log_largest(record["memory"])
    data_stream = start_batches(objective, checkpoint, data, batch_size=training_args.per_device_train_batch_size,
                                seed=training_args.seed, dist=dist, num_workers=training_args.dataloader_num_workers)
    writer, trainer = NullWriter(), None  # from here on, every exit stops the loader (`finally`)
    try:
        clock = SampleClock(training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
                            * dist.world_size, dist.world_size, training_args.max_steps)
        if checkpoint:
            clock.restore(read_training_state(checkpoint))
            if clock.message:  # PaddleNLP steps its schedule once per update: it is stretched over the new max_steps
                logger.warning("%s (the Trainer path stretches its schedule over the new max_steps)", clock.message)
            training_args.max_steps = clock.max_steps
        flops = check_before_writing(objective, data_stream, record, checkpoint,
                                     allow_config_change=run_args.allow_config_change, dist=dist)
        run_dir.create(checkpoint, record)  # the first write
        objective.start(run_dir)
        if dist.is_main:
            keep_wandb_run(training_args.report_to, run_dir.path())
            # wandb writes below the Trainer's logging_dir only if it exists (else in the system's temp folder)
            os.makedirs(training_args.logging_dir, exist_ok=True)
        trainer = LDMTrainer(objective=objective, args=training_args, dist=dist, run_dir=run_dir,
                             data_stream=data_stream, clock=clock, resume_checkpoint=checkpoint, record=record,
                             run_args=run_args, flops=flops)
        if dist.is_main:
            # scalars go through the Trainer's own trackers (--report_to) and the metrics file; images through
            # the trackers here
            writer = trainer.writer = Tracker.of_trainer(trainer, run_dir.path())
            trainer.metrics = MetricsFile(run_dir.path(), checkpoint_step(checkpoint) if checkpoint else None)
            paddlenlp_logger.set_level("INFO")  # the Trainer reports loss, learning rate and speed through it
            if progress == "lines":
                step = (checkpoint_step(checkpoint) or 0) if checkpoint else 0
                trainer.progress = Progress("lines", total=training_args.max_steps, initial=step, label="train",
                                            enabled=True, seconds=run_args.progress_seconds)
        if checkpoint and clock.updates >= training_args.max_steps:
            # resumed at the end (a finished job requeued): PaddleNLP would take one more step before it checks
            logger.info("%s is at update %d of %d: nothing left to train", checkpoint, clock.updates,
                        training_args.max_steps)
            step, last, stopped = clock.updates, checkpoint, False
        else:
            with GracefulStop(dist) as stop:  # a repeated signal during the last save is the same request
                trainer.stop = stop
                trainer.train(resume_from_checkpoint=checkpoint)
                step = trainer.state.global_step
                last = run_dir.path(f"checkpoint-{step}")
                stopped = stop.agreed and step < trainer.state.max_steps  # a signal after the last update: no stop
                if not stopped:
                    save_trainer_checkpoint(trainer)  # returns at once if saved already
                trainer.checkpointer.wait()  # every rank's files written and sealed before anything reads them
            for values in trainer.checkpointer.take_metrics():  # after the last update: nothing else to log
                trainer.log(values)
        if stopped:
            stop.announce(step, last, trainer.checkpointer.sealed)
        else:
            objective.finish(last, data_stream, dist, run_dir)
    except Exception as e:
        run_dir.record_failure(e)
        raise
    finally:
        if trainer is not None:
            trainer.checkpointer.close()  # never leave with a save in flight
        data_stream.close()
        writer.close()
        if trainer is not None and trainer.metrics is not None:
            trainer.metrics.close()
        run_dir.release()
    dist.barrier()
    return {"step": step, "checkpoint": last, "exit_code": stop.exit_code if stopped else 0}
