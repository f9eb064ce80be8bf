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

from ldm.checkpoint import read_training_state
from ldm.compat import check_trainer_hooks, loss_scale, save_trainer_checkpoint
from ldm.distributed import Distributed
from ldm.run_folder import RunFolder, checkpoint_problem
from ldm.runtime import resolve_precision
from ldm.tracking import NullWriter, Tracker
from ldm.train import setup
from ldm.train.checkpointer import Checkpointer, stateful
from ldm.train.elastic import SampleClock
from ldm.train.objective import MetricsWindow, TextToImage, clip_grad_norm, rank_seed, start_batches
from ldm.train.signals import GracefulStop

logger = logging.getLogger("ldm.train")


class LDMCallback(TrainerCallback):
    """EMA updates, per-rank noise seeds or restored random state, gradient norms and sample images, at the
    Trainer's hooks."""

    def __init__(self, trainer: LDMTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if t.resume_checkpoint:
            t.checkpointer.load(t.resume_checkpoint, ["random"], weights=False)
        else:
            paddle.seed(rank_seed(args.seed, t.dist.rank))

    def on_optimizer_begin(self, args, state, control, scaler=None, **kwargs):
        # gradients are synchronised here and, under fp16, still multiplied by the loss scale
        norm = clip_grad_norm(self.trainer.trained)
        self.trainer.window.add_update(norm / loss_scale(scaler) if scaler is not None else norm)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        t.clock.advance()
        if t.objective.ema is not None:
            t.objective.ema.update()
        steps = t.objective.sampling.image_logging_steps
        if steps and state.global_step % steps == 0:
            t.objective.log_images(t.writer, state.global_step, None)
        if t.stop is not None and t.stop.requested():  # SIGTERM/SIGINT: save this update, then stop
            control.should_save = control.should_training_stop = True


class LDMTrainer(Trainer):
    def __init__(self, *, objective: TextToImage, args, dist: Distributed, run_dir: RunFolder, data_stream,
                 clock: SampleClock, resume_checkpoint: str | None = None):
        check_trainer_hooks()  # the overrides below must still be hooks of PaddleNLP's Trainer
        super().__init__(model=objective.model, args=args)
        self.objective, self.dist, self.run_dir, self.data_stream = objective, dist, run_dir, data_stream
        self.writer, self.resume_checkpoint = NullWriter(), resume_checkpoint
        self.stop: GracefulStop | None = None
        self.window, self.clock = MetricsWindow(), clock
        self.trained = [p for p in objective.model.parameters() if not p.stop_gradient]
        # the optimizer, schedule and scaler exist once `train()` made them: the parts ask for them then
        self.checkpointer = Checkpointer(
            run_dir, dist, objective, save_steps=args.save_steps, seed=args.seed, trained=self.trained,
            data_position=data_stream.tracker.state_dict,
            parts={"optimizer": stateful(Deferred(lambda: self.optimizer), tensors=True),
                   "lr_scheduler": stateful(Deferred(lambda: self.lr_scheduler)),
                   "samples": clock.part()})
        if self.do_grad_scaling:
            self.checkpointer.parts["scaler"] = stateful(Deferred(lambda: self.scaler), "load_state_dict")
        self.add_callback(LDMCallback(self))

    def get_train_dataloader(self):
        return self.data_stream

    def compute_loss(self, model, inputs, return_outputs=False):
        loss, _ = self.objective.loss(model, inputs)
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict, **kwargs) -> None:
        if "loss" in logs:
            logs.update(self.window.read(self.dist, self.data_stream, with_loss=False))
        super().log(logs, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if resume_from_checkpoint:
            self.objective.load(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint:
            self.checkpointer.load(checkpoint, ["optimizer", "lr_scheduler", "scaler", "ema"], weights=False)

    def _load_rng_state(self, checkpoint):
        """Restored at `on_train_begin` with the rest (PaddleNLP calls this only when it replays data)."""

    def _rotate_checkpoints(self, *args, **kwargs):
        """The run folder rotates, counting complete checkpoints only."""

    def _save_checkpoint(self, model, metrics=None):
        folder = self.run_dir.path(f"checkpoint-{self.state.global_step}")
        if self.dist.from_main(lambda: checkpoint_problem(folder, checksums=False) is None):
            return  # already saved at this update (a stop at the last update, or a resume of the last checkpoint)
        self.checkpointer.save(self.state.global_step,
                               also=lambda f: self.state.save_to_json(os.path.join(f, TRAINER_STATE_NAME)))


class Deferred:
    """An object's `state_dict` and setters, looked up when called: the Trainer makes its optimizer late."""

    def __init__(self, get):
        self._get = get

    def __getattr__(self, name):
        return lambda *args: getattr(self._get(), name)(*args)


def train(training_args, model_args, data, sampling) -> dict:
    """The LDM through PaddleNLP's Trainer; ends with `<output_dir>/pipeline`. Inputs are checked before
    anything is written (see `ldm.train.loop.run`)."""

    dist = Distributed(pdist.get_rank(), pdist.get_world_size())
    setup.setup_logging(dist)
    resume = training_args.resume_from_checkpoint
    if resume in ("True", "true", True):
        resume = "latest"
    run_dir = RunFolder(training_args.output_dir, dist, training_args.save_total_limit)
    checkpoint = run_dir.check(resume, training_args.overwrite_output_dir)
    requested = "fp16" if training_args.fp16 else "bf16" if training_args.bf16 else "no"
    if resolve_precision(requested) == "no":
        training_args.fp16 = training_args.bf16 = False
    training_args.ignore_data_skip = True  # the data position is restored, not replayed
    training_args.remove_unused_columns = False

    objective = TextToImage(model_args, data, sampling, recompute=training_args.recompute, seed=training_args.seed)
    data_stream = start_batches(objective, checkpoint, data, batch_size=training_args.per_device_train_batch_size,
                                seed=training_args.seed, dist=dist, num_workers=training_args.dataloader_num_workers)
    clock = SampleClock(training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
                        * dist.world_size, dist.world_size, training_args.max_steps)
    if checkpoint:
        saved = read_training_state(checkpoint)
        if "samples" in saved:
            clock.load_state_dict(saved["samples"])
        else:
            clock.assume(saved["step"])
        if clock.message:  # PaddleNLP steps its schedule once per update: it is stretched over the new max_steps
            logger.warning("%s (the Trainer path stretches its schedule over the new max_steps)", clock.message)
        training_args.max_steps = clock.max_steps
    writer = NullWriter()
    try:
        run_dir.create(checkpoint)  # the first write
        objective.start(run_dir)
        trainer = LDMTrainer(objective=objective, args=training_args, dist=dist, run_dir=run_dir,
                             data_stream=data_stream, clock=clock, resume_checkpoint=checkpoint)
        if dist.is_main:
            # scalars go through the Trainer's own trackers (--report_to); images through them here
            writer = trainer.writer = Tracker.of_trainer(trainer, run_dir.path())
            paddlenlp_logger.set_level("INFO")  # the Trainer reports loss, learning rate and speed through it
        with GracefulStop(dist) as stop:
            trainer.stop = stop
            trainer.train(resume_from_checkpoint=checkpoint)
        step = trainer.state.global_step
        last = run_dir.path(f"checkpoint-{step}")
        stopped = stop.agreed and step < trainer.state.max_steps  # a signal after the last update changed nothing
        if stopped:
            stop.announce(step, last)
        else:
            save_trainer_checkpoint(trainer)  # returns at once if saved already
            objective.finish(last, data_stream, dist, run_dir)
    finally:
        data_stream.close()
        writer.close()
    dist.barrier()
    return {"step": step, "checkpoint": last, "exit_code": stop.exit_code if stopped else 0}
