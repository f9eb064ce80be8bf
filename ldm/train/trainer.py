"""The PaddleNLP `Trainer` path (`train_txt2img_laion400m_trainer.py`).

PaddleNLP runs the loop, mixed precision, sharding, gradient accumulation and its own checkpoint
files (model, optimizer, scheduler, RNG). The subclass overrides only the loss, the dataloader
over the streaming dataset, and checkpoint saving (to add the data position, EMA and the
pipeline-layout parts `ldm.export` reads). Resuming restores the data position from the
checkpoint (`ignore_data_skip` is forced on: no batch is replayed).
"""

from __future__ import annotations

import logging
import os

import paddle
from paddlenlp.trainer import Trainer, TrainerCallback

from ldm.checkpoint import read_training_state, save_model, write_training_state
from ldm.distributed import Distributed, weights_checksum
from ldm.train import common

logger = logging.getLogger("ldm.train")


class LDMCallback(TrainerCallback):
    """EMA updates, per-rank noise seeds or restored RNG, and sample images, at the Trainer's hooks."""

    def __init__(self, trainer: LDMTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if t.resume_checkpoint:
            t._load_rng_state(t.resume_checkpoint)  # the Trainer skips this when ignore_data_skip is on
            if t.ema is not None:
                t.ema.load_state_dict(paddle.load(os.path.join(t.resume_checkpoint, "ema.pdparams")))
        else:
            paddle.seed(args.seed + 1000 * t.dist.rank)  # same weights everywhere, different noise per rank

    def on_optimizer_begin(self, args, state, control, scaler=None, **kwargs):
        # gradients are synchronised here and, under fp16, still multiplied by the loss scale
        t = self.trainer
        grads = [p.grad for p in t.ldm.parameters() if p.grad is not None]
        if grads:  # kept on the device until logged
            norm = paddle.sqrt(sum((g.astype("float32") ** 2).sum() for g in grads))
            t.grad_norms.append(norm / scaler._scale if scaler is not None else norm)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t.ema is not None:
            t.ema.update()
        steps = t.sampling.image_logging_steps
        if steps and state.global_step % steps == 0:
            common.log_samples(t.writer, state.global_step, t.ldm, t.ldm_tokenizer, t.data.model_max_length,
                               t.sampling.num_inference_steps)


class LDMTrainer(Trainer):
    def __init__(self, *, model, args, tokenizer, data, sampling, dist: Distributed, vae_folder: str, ema=None,
                 writer=None, resume_checkpoint: str | None = None):
        super().__init__(model=model, args=args)
        self.ldm, self.ldm_tokenizer, self.data, self.sampling = model, tokenizer, data, sampling
        self.dist, self.vae_folder, self.ema, self.writer = dist, vae_folder, ema, writer
        self.resume_checkpoint = resume_checkpoint
        self.grad_norms: list[paddle.Tensor] = []
        saved = read_training_state(resume_checkpoint)["stream"] if resume_checkpoint else None
        self.data_stream = common.build_batches(data, tokenizer, batch_size=args.per_device_train_batch_size,
                                                seed=args.seed, dist=dist, num_workers=args.dataloader_num_workers,
                                                saved_streams=saved)
        self.add_callback(LDMCallback(self))

    def get_train_dataloader(self):
        return self.data_stream

    def compute_loss(self, model, inputs, return_outputs=False):
        loss = model(inputs["pixel_values"], inputs["input_ids"])
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

    def _save_checkpoint(self, model, metrics=None):
        super()._save_checkpoint(model, metrics)
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        state = {
            "step": self.state.global_step,
            "world_size": self.dist.world_size,
            "stream": self.dist.gather(self.data_stream.tracker.state_dict()),
            "weights_checksum": self.dist.gather(weights_checksum(p for p in self.ldm.parameters()
                                                                  if not p.stop_gradient)),
        }
        if self.dist.is_main and os.path.isdir(folder):
            save_model(folder, unet=self.ldm.unet, text_encoder=self.ldm.text_encoder,
                       tokenizer=self.ldm_tokenizer, noise_scheduler=self.ldm.noise_scheduler,
                       vae_folder=self.vae_folder, ema_state=self.ema.state_dict() if self.ema else None)
            write_training_state(folder, state)
        self.dist.barrier()


def train(training_args, model_args, data, sampling) -> dict:
    import paddle.distributed as pdist

    from ldm.checkpoint import checkpoint_dirs, prepare_output_dir
    from ldm.models.ema import EMA
    from ldm.tracking import make_writer

    dist = Distributed(pdist.get_rank(), pdist.get_world_size())
    common.setup_logging(dist)
    resume = training_args.resume_from_checkpoint
    if resume in ("True", "true", True):
        resume = "latest"
    checkpoint = prepare_output_dir(training_args.output_dir, resume, training_args.overwrite_output_dir)
    dist.barrier()
    requested = "fp16" if training_args.fp16 else "bf16" if training_args.bf16 else "no"
    if common.resolve_precision(requested) == "no":
        training_args.fp16 = training_args.bf16 = False
    training_args.ignore_data_skip = True  # the data position is restored, not replayed
    training_args.remove_unused_columns = False

    tokenizer = common.build_tokenizer(data)
    model, components = common.build_model(model_args, data, tokenizer, recompute=training_args.recompute,
                                           seed=training_args.seed)
    ema = EMA(model, model_args.ema_decay) if model_args.use_ema else None
    vae_folder = common.save_vae(training_args.output_dir, components.vae, dist)
    # scalars go through the Trainer's own VisualDL callback (--report_to visualdl); sample images here
    writer = make_writer(os.path.join(training_args.output_dir, "visualdl_samples"),
                         dist.is_main and sampling.image_logging_steps > 0)
    trainer = LDMTrainer(model=model, args=training_args, tokenizer=tokenizer, data=data, sampling=sampling,
                         dist=dist, vae_folder=vae_folder, ema=ema, writer=writer, resume_checkpoint=checkpoint)
    if dist.is_main:  # the Trainer reports loss, learning rate and speed through PaddleNLP's logger
        from paddlenlp.utils.log import logger as paddlenlp_logger

        paddlenlp_logger.set_level("INFO")
    trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.state.global_step % training_args.save_steps != 0:
        trainer._save_checkpoint(trainer.model_wrapped, metrics=None)
    last = checkpoint_dirs(training_args.output_dir)[-1] if dist.is_main else None
    if dist.is_main:
        from ldm.export import export_checkpoint

        pipeline, used_ema = export_checkpoint(last, os.path.join(training_args.output_dir, "pipeline"))
        logger.info("exported %s (%s weights) to %s", last, "EMA" if used_ema else "raw", pipeline)
    dist.barrier()
    writer.close()
    return {"step": trainer.state.global_step, "checkpoint": last}
