"""The PaddleNLP `Trainer` path (`train_txt2img_laion400m_trainer.py`).

PaddleNLP runs the loop, mixed precision, sharding and gradient accumulation. The run's life around it (set-up,
the update's vote, evaluation, checkpoints, stops, teardown) is `ldm.train.run.TrainingRun`'s, shared with the
hand-written loop; this module only wires it into the Trainer's hooks and callbacks. The subclass overrides what it
must: the loss (the objective's), the dataloader (the streaming batches), and checkpoints, which the same
checkpoint manager as the hand-written loop writes and reads (weights once, in the pipeline layout; optimizer,
schedule, scaler, random state and data position as JSON and safetensors, never PaddleNLP's pickles), plus
PaddleNLP's own `trainer_state.json`, which it reads back itself. Resuming restores the data position
(`ignore_data_skip` is forced on: no batch is replayed).
"""

from __future__ import annotations

import logging
import os

import paddle
from paddlenlp.trainer import Trainer, TrainerCallback
from paddlenlp.trainer.trainer import TRAINER_STATE_NAME
from paddlenlp.utils.log import logger as paddlenlp_logger

from ldm.config import args
from ldm.config.record import hyperparameters
from ldm.runtime.compat import check_trainer_hooks, innermost_optimizer, loss_scale, private, save_trainer_checkpoint
from ldm.runtime.tracking import MetricsFile, Tracker, keep_wandb_run, tracker_name
from ldm.train.flat import FlatAdamW
from ldm.train.objective import TextToImage
from ldm.train.run import TrainingRun, trainer_plan
from ldm.train.update import PER_TENSOR

logger = logging.getLogger("ldm.train")


class LDMCallback(TrainerCallback):
    """The run's per-update steps at the Trainer's hooks: the restored random state, the gradient norm, the update's
    vote, the counters and the EMA, and what happens between updates."""

    def __init__(self, trainer: LDMTrainer):
        self.trainer, self.run = trainer, trainer.run
        self.grad_norm, self.skipped = None, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.run.restore(["random"], weights=False)
        self.run.writer.add_config(self.run.record, hyperparameters(self.run.record))
        self.run.phases.restart()  # the Trainer's set-up and the restore are no phase of an update

    def on_step_begin(self, args, state, control, **kwargs):
        self.run.stop_if_exhausted()  # when the Trainer did not log the update that exhausted the guard

    def on_optimizer_begin(self, args, state, control, scaler=None, **kwargs):
        # gradients are synchronised here and, under fp16, still multiplied by the loss scale
        t, lap = self.trainer, self.run.phases.lap
        lap("sync")  # from the last micro-step's backward: the gradients' all-reduce
        norm = self.run.update.norm()  # PaddleNLP clips (with --max_grad_norm) in its step
        self.grad_norm = norm / loss_scale(scaler) if scaler is not None else norm
        lap("clip")
        # the update's one host read: the non-finite verdict and the stop and save votes, agreed by every rank
        self.run.guard.hand_to(t.optimizer, self.run.agree(t.update_loss, self.grad_norm), scaler)
        lap("vote")

    def on_optimizer_end(self, args, state, control, scaler=None, **kwargs):
        t = self.trainer
        self.run.phases.lap("optimizer")  # PaddleNLP's step, its clipping included
        self.skipped = self.run.guard.was_skipped(t.optimizer)
        if self.skipped and scaler is None:
            # PaddleNLP steps the schedule unless its scaler saw an overflow: take that step back
            t.lr_scheduler.last_epoch -= 1
            t.lr_scheduler.last_lr = t.lr_scheduler.get_lr()

    def on_step_end(self, args, state, control, **kwargs):
        run, step = self.run, state.global_step
        run.updated(step, self.skipped, loss=self.trainer.update_loss, grad_norm=self.grad_norm)
        self.trainer.update_loss = paddle.zeros([])
        if run.guard.exhausted:
            control.should_log = True  # the window that ends the run is logged first (`LDMTrainer.log` stops it)
        run.between_updates(step, last=step == state.max_steps, logging_step=step % args.logging_steps == 0)
        if run.stop.agreed:  # SIGTERM/SIGINT (voted with the guard): save this update, stop
            control.should_save = control.should_training_stop = True


class LDMTrainer(Trainer):
    def __init__(self, run: TrainingRun, args):
        check_trainer_hooks()  # the overrides below must still be hooks of PaddleNLP's Trainer
        super().__init__(model=run.objective.model, args=args)
        self.run, self.objective = run, run.objective
        self.update_loss = paddle.zeros([])  # the update's loss so far (micro-steps summed), for the guard
        self.metrics: MetricsFile | None = None
        if self.do_grad_scaling:
            run.keep(scaler=lambda: self.scaler)
        self.add_callback(LDMCallback(self))

    def create_optimizer(self, lr_scheduler=None):
        optimizer = super().create_optimizer(lr_scheduler)
        if self.run.flat_update and type(optimizer) is paddle.optimizer.AdamW:
            self.optimizer = optimizer = FlatAdamW.like(optimizer)  # laid out flat by `run.adopt`
        return optimizer

    def get_train_dataloader(self):
        return self.run.batches

    def training_step(self, model, inputs):
        loss = super().training_step(model, inputs)
        self.run.phases.lap("backward")
        return loss

    def compute_loss(self, model, inputs, return_outputs=False):
        self.run.phases.lap("data")  # since the last lap: PaddleNLP took the batch
        loss, extra = self.objective.loss(model, inputs)
        self.run.phases.lap("forward")
        self.update_loss = self.update_loss + loss.detach()
        self.run.window.add_micro_step(loss, extra, 1 / self.args.gradient_accumulation_steps)
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict, **kwargs) -> None:
        if "loss" in logs:
            self.run.window_metrics(logs, with_loss=False)
        super().log(logs, **kwargs)
        if self.metrics is not None:  # every scalar the trackers got, under the names they show
            scalars = {tracker_name(k): v for k, v in logs.items()
                       if isinstance(v, int | float) and not isinstance(v, bool)}
            self.metrics.write(self.state.global_step, scalars)
        if "loss" in logs:  # the update's own log, on every rank (a save's metrics are rank 0's alone)
            self.run.stop_if_exhausted()
        self.run.phases.lap("other")  # the trackers' writes

    def log_aside(self, values: dict) -> None:
        """Log `values` between the update's hooks, leaving the update's own log due: PaddleNLP's `on_log` clears
        `should_log`, and the update's log holds collectives every rank must reach."""
        should_log = self.control.should_log
        self.log(values)
        self.control.should_log = should_log

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        # PaddleNLP passes back the checkpoint `train` was given: the run's, read once (`run.resume`)
        if resume_from_checkpoint:
            self.run.restore((), weights=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        self.run.adopt(self.optimizer)  # made (and under sharding wrapped) by the Trainer now
        if self.run.update.form != PER_TENSOR:
            clear_through(self.optimizer, self.run.update)
        if checkpoint:
            self.run.restore(["optimizer", "lr_scheduler", "scaler", *self.run.manager.averaging_parts], weights=False)

    def _load_rng_state(self, checkpoint):
        """Restored at `on_train_begin` with the rest (PaddleNLP calls this only when it replays data)."""

    def _rotate_checkpoints(self, *args, **kwargs):
        """The run folder rotates, counting complete checkpoints only."""

    def _save_checkpoint(self, model, metrics=None):
        if self.run.manager.has(self.state.global_step):
            return  # already saved at this update (a stop at the last update, or a resume of the last checkpoint)
        self.run.save(self.state.global_step,
                      also=lambda f: self.state.save_to_json(os.path.join(f, TRAINER_STATE_NAME)))


def clear_through(optimizer, update) -> None:
    """PaddleNLP clears the gradients through fleet's wrappers of its optimizer (`HybridParallelOptimizer`, the
    sharding optimizer), which clear each parameter's gradient itself: that detaches it from the flat buffers
    (`ldm.train.flat`), and fleet picks those classes, so no subclass can stand in. Each wrapper's `clear_grad` is
    the update's `clear` (the hand-written loop calls `update.clear` and needs none of this)."""
    inner = innermost_optimizer(optimizer)
    while optimizer is not inner:
        optimizer.clear_grad = lambda set_to_zero=True: update.clear()
        optimizer = private(optimizer, "_inner_opt", "the flat update under fleet's wrappers")


def train(training_args, model_args: args.ModelArguments, data: args.DataArguments, sampling: args.SamplingArguments,
          run_args: args.RunArguments | None = None, validation: args.ValidationArguments | None = None) -> dict:
    """The LDM through PaddleNLP's Trainer; ends with `<output_dir>/pipeline`. Inputs are checked before
    anything is written (see `ldm.train.run`)."""
    run_args, validation = run_args or args.RunArguments(), validation or args.ValidationArguments()
    import paddle.distributed as pdist

    run = TrainingRun(trainer_plan(training_args, run_args, sampling.image_logging_steps, pdist.get_rank() == 0),
                      run_args)
    training_args.seed = run.seed
    if run.precision == "no":
        training_args.fp16 = training_args.bf16 = False
    training_args.ignore_data_skip = True  # the data position is restored, not replayed
    training_args.remove_unused_columns = False
    training_args.disable_tqdm = not run.plan.driver_bar  # PaddleNLP's bar, or our lines
    run.build(lambda: TextToImage(model_args, data, sampling, recompute=training_args.recompute, seed=run.seed,
                                  resume=run.resume, validation=validation),
              data, (model_args, data, sampling, training_args, run_args, validation))
    trainer = None
    run.keep(optimizer=lambda: trainer.optimizer, schedule=lambda: trainer.lr_scheduler)
    with run.started():
        training_args.max_steps = run.max_steps
        if run.dist.is_main:
            keep_wandb_run(training_args.report_to, run.run_dir.path())
            if "wandb" in (training_args.report_to or []):
                # wandb writes below the Trainer's logging_dir only if it exists (else in the system's temp folder);
                # no other tracker needs it made (an empty runs/<date>_<host>/ at each start otherwise)
                os.makedirs(training_args.logging_dir, exist_ok=True)
        trainer = LDMTrainer(run, training_args)
        run.log_through = trainer.log_aside  # scalars between the update's hooks go through the Trainer's log
        if run.dist.is_main:
            # scalars go through the Trainer's own trackers (--report_to) and the metrics file; images through
            # the trackers here
            run.writer = Tracker.of_trainer(trainer, run.run_dir.path())
            trainer.metrics = MetricsFile(run.run_dir.path(), run.resume.step if run.resume else None)
            run.closing.append(trainer.metrics)
            paddlenlp_logger.set_level("INFO")  # the Trainer reports loss, learning rate and speed through it
        if run.resume and run.clock.updates >= run.max_steps:
            # resumed at the end (a finished job requeued): PaddleNLP would take one more step before it checks
            logger.info("%s is at update %d of %d: nothing left to train", run.resume.path, run.clock.updates,
                        run.max_steps)
            run.end(run.clock.updates, stopped=False)
        else:
            with run.stoppable():
                trainer.train(resume_from_checkpoint=run.resume.path if run.resume else None)
                step = trainer.state.global_step
                stopped = run.stop.agreed and step < trainer.state.max_steps  # a signal after the last update: no stop
                if not stopped:
                    save_trainer_checkpoint(trainer)  # returns at once if saved already
                run.end(step, stopped)
        run.finish()
    return run.result
