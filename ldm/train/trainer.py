"""The PaddleNLP `Trainer` path (`train_txt2img_laion400m_trainer.py`).

PaddleNLP runs the loop, mixed precision, sharding, gradient accumulation and its own checkpoint
files (optimizer, scheduler, RNG, trainer state). The subclass overrides the loss, the dataloader
over the streaming dataset, and the model part of checkpoints: the trained weights are written
once, in the pipeline layout `ldm.export` reads (not also as the whole wrapper's
`model_state.pdparams`, which would repeat them and add the frozen autoencoder), with the data
position and EMA; `ldm.run_folder` seals each checkpoint with its manifest and rotates.
Resuming restores the data position from the checkpoint (`ignore_data_skip` is forced on: no
batch is replayed).
"""

from __future__ import annotations

import logging
import os

import paddle
import paddle.distributed as pdist
from paddlenlp.trainer import Trainer, TrainerCallback
from paddlenlp.utils.log import logger as paddlenlp_logger

from ldm.checkpoint import training_state, write_training_state
from ldm.compat import check_trainer_hooks, load_trainer_rng_state, loss_scale, save_trainer_checkpoint
from ldm.distributed import Distributed
from ldm.run_folder import RunFolder, checkpoint_problem, remove
from ldm.tracking import NullWriter, Tracker
from ldm.train import setup
from ldm.train.loop import TextToImage, start_batches
from ldm.train.signals import GracefulStop

logger = logging.getLogger("ldm.train")


class LDMCallback(TrainerCallback):
    """EMA updates, per-rank noise seeds or restored RNG, and sample images, at the Trainer's hooks."""

    def __init__(self, trainer: LDMTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if t.resume_checkpoint:
            load_trainer_rng_state(t, t.resume_checkpoint)  # the Trainer skips this when ignore_data_skip is on
        else:
            paddle.seed(args.seed + 1000 * t.dist.rank)  # same weights everywhere, different noise per rank

    def on_optimizer_begin(self, args, state, control, scaler=None, **kwargs):
        # gradients are synchronised here and, under fp16, still multiplied by the loss scale
        t = self.trainer
        grads = [p.grad for p in t.objective.model.parameters() if p.grad is not None]
        if grads:  # kept on the device until logged
            norm = paddle.sqrt(sum((g.astype("float32") ** 2).sum() for g in grads))
            t.grad_norms.append(norm / loss_scale(scaler) if scaler is not None else norm)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t.objective.ema is not None:
            t.objective.ema.update()
        steps = t.objective.sampling.image_logging_steps
        if steps and state.global_step % steps == 0:
            t.objective.log_images(t.writer, state.global_step, None)
        if t.stop is not None and t.stop.requested():  # SIGTERM/SIGINT: save this update, then stop
            control.should_save = control.should_training_stop = True


class LDMTrainer(Trainer):
    def __init__(self, *, objective: TextToImage, args, dist: Distributed, run_dir: RunFolder, data_stream,
                 resume_checkpoint: str | None = None):
        check_trainer_hooks()  # the overrides below must still be hooks of PaddleNLP's Trainer
        super().__init__(model=objective.model, args=args)
        self.objective, self.dist, self.run_dir, self.data_stream = objective, dist, run_dir, data_stream
        self.writer, self.resume_checkpoint = NullWriter(), resume_checkpoint
        self.stop: GracefulStop | None = None
        self.grad_norms: list[paddle.Tensor] = []
        self.add_callback(LDMCallback(self))

    def get_train_dataloader(self):
        return self.data_stream

    def compute_loss(self, model, inputs, return_outputs=False):
        loss = model(inputs.get("pixel_values"), inputs["input_ids"], inputs.get("latent_moments"))
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict, **kwargs) -> None:
        if "loss" in logs:
            samples_per_second, wait_fraction, counts = self.data_stream.window(self.dist)
            logs["data_wait_fraction"] = wait_fraction
            logs["grad_norm"] = float(paddle.stack(self.grad_norms).mean()) if self.grad_norms else 0.0
            self.grad_norms = []
            logs["global_samples_per_second"] = samples_per_second
            logs.update({f"data_{reason}": count for reason, count in sorted(counts.items())})
        super().log(logs, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None, merge_tensor_parallel=False):
        """The model part of a checkpoint: UNet, LDMBert (and EMA) once, no frozen autoencoder."""
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            paddle.save(self.args, os.path.join(output_dir, "training_args.bin"))
            self.objective.save(output_dir, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if resume_from_checkpoint:
            self.objective.load(resume_from_checkpoint)

    def _rotate_checkpoints(self, *args, **kwargs):
        """`RunFolder.complete` rotates, counting complete checkpoints only."""

    def _save_checkpoint(self, model, metrics=None):
        folder = self.run_dir.path(f"checkpoint-{self.state.global_step}")
        if self.dist.from_main(lambda: checkpoint_problem(folder, checksums=False) is None):
            return  # already saved at this update (a stop at the last update, or a resume of the last checkpoint)
        self.dist.from_main(lambda: remove(folder))  # an incomplete one of an earlier try: PaddleNLP writes in place
        with self.run_dir.no_space_ends_the_run(folder, written_in_place=True):
            super()._save_checkpoint(model, metrics)
        state = training_state(self.state.global_step, self.dist, self.data_stream,
                               [p for p in self.objective.model.parameters() if not p.stop_gradient])

        def seal() -> None:
            write_training_state(folder, state)
            self.run_dir.complete(folder)

        self.dist.from_main(seal)
        logger.info("saved %s", folder)


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
    if setup.resolve_precision(requested) == "no":
        training_args.fp16 = training_args.bf16 = False
    training_args.ignore_data_skip = True  # the data position is restored, not replayed
    training_args.remove_unused_columns = False

    objective = TextToImage(model_args, data, sampling, recompute=training_args.recompute, seed=training_args.seed)
    _, data_stream = start_batches(objective, checkpoint, data, batch_size=training_args.per_device_train_batch_size,
                                   seed=training_args.seed, dist=dist, num_workers=training_args.dataloader_num_workers)
    writer = NullWriter()
    try:
        run_dir.create(checkpoint)  # the first write
        objective.start(run_dir)
        trainer = LDMTrainer(objective=objective, args=training_args, dist=dist, run_dir=run_dir,
                             data_stream=data_stream, resume_checkpoint=checkpoint)
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
