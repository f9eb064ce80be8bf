"""The hand-written training loop (`train_txt2img_laion400m_no_trainer.py`, `train_autoencoder.py`).

One optimizer update = `gradient_accumulation_steps` micro-steps, all under DataParallel's
`no_sync`, then one explicit gradient all-reduce, unscale (fp16), global-norm clip, step. The step
counter, LR schedule, logging, image logging and checkpoints all count updates.

The loop is the same for every model; an `Objective` says what is trained: the model and its loss,
what goes into a checkpoint, which images to log, what to write at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random

import numpy as np
import paddle
from tqdm import tqdm

from ldm.args import DataArguments, LoopArguments, ModelArguments, SamplingArguments
from ldm.checkpoint import (
    check_autoencoder,
    load_ema,
    load_ldm_weights,
    load_optimizer,
    read_training_state,
    recorded_autoencoder,
    save_model,
    save_optimizer,
    training_state,
    write_training_state,
)
from ldm.data.latents import fingerprint
from ldm.distributed import Distributed, sync_gradients
from ldm.models.autoencoder import autoencoder_identity
from ldm.models.ema import EMA
from ldm.run_folder import RunFolder
from ldm.tracking import NullWriter, make_writer
from ldm.train import optim, samples, setup
from ldm.train.batches import build_batches
from ldm.train.signals import GracefulStop

logger = logging.getLogger("ldm.train")


# A run this far from its end has no practical end (the original recipe sets max_train_steps 1e9): its
# progress bar counts toward the next checkpoint instead, so the ETA means something.
ENDLESS_UPDATES = 10_000_000


def progress_target(step: int, max_steps: int, save_steps: int) -> tuple[int, str]:
    """(update the progress bar counts toward, its label)."""
    if max_steps - step <= ENDLESS_UPDATES:
        return max_steps, "train"
    target = min(max_steps, (step // save_steps + 1) * save_steps)
    return target, f"to checkpoint-{target}"


def autocast(precision: str):
    if precision == "no":
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(enable=True, dtype="float16" if precision == "fp16" else "bfloat16", level="O1")


class Objective:
    """What the loop trains. `model` is the training wrapper: its trainable parameters are optimised."""

    model: paddle.nn.Layer
    tokenizer = None  # batches carry `input_ids` when set
    ema = None
    latents_of: str | None = None  # trains on latent shards of this autoencoder (fingerprint); None: images only
    autoencoder_source = ""

    def loss(self, net, batch: dict) -> tuple[paddle.Tensor, dict[str, paddle.Tensor]]:
        """(loss to minimise, extra scalars to log) of one micro-batch; `net` is the (DataParallel) model."""
        raise NotImplementedError

    def check_resume(self, checkpoint: str) -> None:
        """Refuse a checkpoint this objective cannot continue (called before anything is written)."""

    def start(self, run_dir: RunFolder) -> None:
        """Write what the run needs before training (the folder exists now)."""

    def save(self, folder: str, final_folder: str) -> None:
        """Write the trained weights into a checkpoint folder (the optimizer and state are the loop's)."""
        raise NotImplementedError

    def load(self, folder: str) -> None:
        raise NotImplementedError

    def log_images(self, writer: NullWriter, step: int, batch: dict) -> None:
        """Images for the trackers every `image_logging_steps` (rank 0's writer only)."""

    def finish(self, checkpoint: str | None, batches, dist: Distributed, run_dir: RunFolder) -> None:
        """After the last update, on every rank: the final export."""


class TextToImage(Objective):
    """The latent diffusion model: UNet + LDMBert trained, the autoencoder frozen."""

    def __init__(self, model_args: ModelArguments, data: DataArguments, sampling: SamplingArguments, *,
                 recompute: bool, seed: int):
        """Also the Trainer path's model (`ldm.train.trainer`): built, checked, saved and loaded the same way."""
        self.data, self.sampling = data, sampling
        self.tokenizer = setup.build_tokenizer(data)
        self.model, self.components = setup.build_model(model_args, data, self.tokenizer, recompute=recompute,
                                                         seed=seed)
        self.ema = EMA(self.model, model_args.ema_decay) if model_args.use_ema else None
        self.vae_identity = autoencoder_identity(self.components.vae)
        self.latents_of, self.autoencoder_source = fingerprint(self.vae_identity), self.components.vae_source
        self.vae_folder = None

    def check_resume(self, checkpoint):
        check_autoencoder(checkpoint, recorded_autoencoder(checkpoint), self.vae_identity,
                          f"this run's autoencoder ({self.components.vae_source})")

    def start(self, run_dir):
        self.vae_folder, _ = run_dir.write_vae(self.components.vae)

    def loss(self, net, batch):
        return net(batch.get("pixel_values"), batch["input_ids"], batch.get("latent_moments")), {}

    def save(self, folder, final_folder):
        save_model(folder, unet=self.model.unet, text_encoder=self.model.text_encoder, tokenizer=self.tokenizer,
                   noise_scheduler=self.model.noise_scheduler, vae_folder=self.vae_folder,
                   vae_identity=self.vae_identity, final_folder=final_folder,
                   ema_state=self.ema.state_dict() if self.ema is not None else None)

    def load(self, folder):
        load_ldm_weights(folder, self.model)
        if self.ema is not None:
            load_ema(folder, self.ema)

    def log_images(self, writer, step, batch):
        samples.log_validation(writer, step, self.model, self.tokenizer, self.data.model_max_length, self.sampling,
                               ema=self.ema)

    def finish(self, checkpoint, batches, dist, run_dir):
        if dist.is_main and checkpoint:
            run_dir.export(checkpoint)


def start_batches(objective: Objective, resume: str | None, data: DataArguments, *, batch_size: int, seed: int,
                  dist: Distributed, num_workers: int):
    """(training state of `resume` or None, started batches): the checkpoint is checked against the objective
    and the batches continue from its data position; unusable data fails here. Both paths call this
    after building the model and before the first write."""
    state = read_training_state(resume) if resume else None
    if resume:
        objective.check_resume(resume)
    batches = build_batches(data, objective.tokenizer, batch_size=batch_size, seed=seed, dist=dist,
                            num_workers=num_workers, saved_streams=state["stream"] if state else None,
                            autoencoder=objective.latents_of, autoencoder_source=objective.autoencoder_source)
    batches.start()
    return state, batches


def train(loop: LoopArguments, model_args: ModelArguments, data: DataArguments, sampling: SamplingArguments) -> dict:
    """The LDM through the hand-written loop; ends with `<output_dir>/pipeline`."""
    return run(loop, data, lambda dist: TextToImage(model_args, data, sampling, recompute=loop.recompute,
                                                    seed=loop.seed),
               image_logging_steps=sampling.image_logging_steps)


def run(loop: LoopArguments, data: DataArguments, build_objective, *, image_logging_steps: int = 0) -> dict:
    """Train `build_objective(dist)` on the streamed shards; returns {"step", "checkpoint", "exit_code"}.

    Every input (folder policy, checkpoint, model, tokenizer, file list) is checked before the first
    write, so a failed start leaves nothing behind.
    """
    dist = Distributed.init()
    setup.setup_logging(dist)
    run_dir = RunFolder(loop.output_dir, dist, loop.checkpoints_total_limit)
    resume = run_dir.check(loop.resume_from_checkpoint, loop.overwrite_output_dir)
    precision = setup.resolve_precision(loop.mixed_precision)

    objective = build_objective(dist)
    model, ema = objective.model, objective.ema
    trained = [p for p in model.parameters() if not p.stop_gradient]
    lr = optim.lr_schedule(loop.lr_scheduler, loop.learning_rate, loop.lr_warmup_steps, loop.max_train_steps)
    optimizer = paddle.optimizer.AdamW(lr, parameters=trained, beta1=loop.adam_beta1, beta2=loop.adam_beta2,
                                       epsilon=loop.adam_epsilon, weight_decay=loop.adam_weight_decay)
    scaler = paddle.amp.GradScaler(enable=precision == "fp16", init_loss_scaling=2.0**16)
    state, data_stream = start_batches(objective, resume, data, batch_size=loop.train_batch_size, seed=loop.seed,
                                       dist=dist, num_workers=loop.num_workers)
    writer, progress = NullWriter(), None
    try:
        run_dir.create(resume)  # the first write
        objective.start(run_dir)
        writer = make_writer(loop.report_to, run_dir.path(), {**dataclasses.asdict(loop), **dataclasses.asdict(data)},
                             dist.is_main)
        step = 0
        if resume:
            objective.load(resume)
            load_optimizer(resume, optimizer)
            step = state["step"]
            lr.set_state_dict(state["lr_scheduler"])
            scaler.load_state_dict(state["scaler"])
            if state["world_size"] == dist.world_size:
                paddle.set_rng_state(state["rng"][dist.rank])
                np.random.set_state(state["numpy"][dist.rank])
                random.setstate(state["python"][dist.rank])
            else:
                logger.warning("resuming a %d-rank run on %d ranks: data stream and noise restart from new seeds",
                               state["world_size"], dist.world_size)
                paddle.seed(loop.seed + 1000 * dist.rank + step)
            logger.info("resumed from %s at update %d", resume, step)
        else:
            paddle.seed(loop.seed + 1000 * dist.rank)  # the same weights everywhere, different noise per rank

        ddp = paddle.DataParallel(model) if dist.world_size > 1 else model
        no_sync = ddp.no_sync if dist.world_size > 1 else contextlib.nullcontext

        def save(step: int) -> str | None:
            state = training_state(
                step, dist, data_stream, trained,
                rng=dist.gather(paddle.get_rng_state()), numpy=dist.gather(np.random.get_state()),
                python=dist.gather(random.getstate()), lr_scheduler=lr.state_dict(), scaler=scaler.state_dict())

            def write(folder: str, final_folder: str) -> None:
                objective.save(folder, final_folder)
                save_optimizer(folder, optimizer)
                write_training_state(folder, state)

            path = dist.from_main(lambda: run_dir.save(step, write))
            logger.info("saved %s", path)
            return path

        model.train()
        # loss and gradient norm stay on the device until logged: no host sync per micro-step
        window = {"loss": 0.0, "grad_norm": 0.0, "updates": 0, "extra": {}}
        accumulation = loop.gradient_accumulation_steps
        target, label = progress_target(step, loop.max_train_steps, loop.save_steps)
        progress = tqdm(total=target, initial=step, disable=not dist.is_main, desc=label, unit="upd")
        last_checkpoint, stopping = resume, False  # resumed at the end already: that checkpoint is the last
        batches = iter(data_stream)
        with GracefulStop(dist) as stop:
            while step < loop.max_train_steps and not stopping:
                for _ in range(accumulation):
                    batch = next(batches)
                    with no_sync(), autocast(precision):
                        loss, extra = objective.loss(ddp, batch)
                    scaler.scale(loss / accumulation).backward()
                    window["loss"] += loss.detach() / accumulation
                    for name, value in extra.items():
                        window["extra"][name] = window["extra"].get(name, 0.0) + value.detach() / accumulation
                sync_gradients(trained, dist.world_size)
                scaler.unscale_(optimizer)
                max_norm = loop.max_grad_norm if loop.max_grad_norm > 0 else float("inf")
                window["grad_norm"] += optim.clip_grad_norm(trained, max_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.clear_grad()
                lr.step()
                if ema is not None:
                    ema.update()
                step += 1
                progress.update(1)
                window["updates"] += 1
                stopping = stop.requested()

                if step % loop.logging_steps == 0 or step == loop.max_train_steps or stopping:
                    samples_per_second, wait_fraction, counts = data_stream.window(dist)
                    metrics = {  # the trackers show them as train/<name>, like the Trainer path's
                        "loss": dist.mean(float(window["loss"]) / window["updates"]),
                        "learning_rate": optimizer.get_lr(),
                        "grad_norm": dist.mean(float(window["grad_norm"]) / window["updates"]),
                        "global_samples_per_second": samples_per_second,  # the Trainer path's name
                        "data_wait_fraction": wait_fraction,
                    }
                    metrics.update({name: dist.mean(float(value) / window["updates"])
                                    for name, value in sorted(window["extra"].items())})
                    metrics.update({f"data_{reason}": count for reason, count in sorted(counts.items())})
                    writer.scalars(metrics, step)
                    progress.set_postfix(loss=f"{metrics['loss']:.4f}", samples_s=f"{samples_per_second:.1f}",
                                         data_wait=f"{wait_fraction:.0%}")
                    window = {"loss": 0.0, "grad_norm": 0.0, "updates": 0, "extra": {}}
                if image_logging_steps and step % image_logging_steps == 0 and writer.active:
                    objective.log_images(writer, step, batch)
                if step % loop.save_steps == 0 or step == loop.max_train_steps or stopping:
                    last_checkpoint = save(step)
                    if step >= target and not stopping:  # an endless run: count toward the next checkpoint
                        target, label = progress_target(step, loop.max_train_steps, loop.save_steps)
                        progress.total = target
                        progress.set_description(label)
            progress.close()
            if stopping:
                stop.announce(step, last_checkpoint)
            else:
                objective.finish(last_checkpoint, batches, dist, run_dir)
    finally:
        if progress is not None:
            progress.close()  # an error's message then starts on a line of its own
        data_stream.close()  # loader workers and reader thread stop here, not during interpreter exit
        writer.close()
    dist.barrier()
    # a signal after the last update changed nothing: the run is complete
    return {"step": step, "checkpoint": last_checkpoint, "exit_code": stop.exit_code if stopping else 0}
