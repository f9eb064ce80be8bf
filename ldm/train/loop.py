"""The hand-written training loop (`train_txt2img_laion400m_no_trainer.py`).

One optimizer update = `gradient_accumulation_steps` micro-steps, all under DataParallel's
`no_sync`, then one explicit gradient all-reduce, unscale (fp16), global-norm clip, step. The step
counter, LR schedule, logging, image logging and checkpoints all count updates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random

import numpy as np
import paddle
from tqdm import tqdm

from ldm.args import DataArguments, LoopArguments, ModelArguments, SamplingArguments
from ldm.checkpoint import load_training_checkpoint, prepare_output_dir, save_training_checkpoint
from ldm.distributed import Distributed, sync_gradients, weights_checksum
from ldm.tracking import make_writer
from ldm.train import common

logger = logging.getLogger("ldm.train")


def autocast(precision: str):
    if precision == "no":
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(enable=True, dtype="float16" if precision == "fp16" else "bfloat16", level="O1")


def train(loop: LoopArguments, model_args: ModelArguments, data: DataArguments, sampling: SamplingArguments) -> dict:
    dist = Distributed.init()
    common.setup_logging(dist)
    resume = prepare_output_dir(loop.output_dir, loop.resume_from_checkpoint, loop.overwrite_output_dir)
    dist.barrier()  # every rank has checked the folder before any writes into it
    writer = make_writer(os.path.join(loop.output_dir, "visualdl"), dist.is_main)
    precision = common.resolve_precision(loop.mixed_precision)

    tokenizer = common.build_tokenizer(data)
    model, components = common.build_model(model_args, data, tokenizer, recompute=loop.recompute, seed=loop.seed)
    from ldm.models.ema import EMA

    ema = EMA(model, model_args.ema_decay) if model_args.use_ema else None
    vae_folder = common.save_vae(loop.output_dir, components.vae, dist)
    trained = [p for p in model.parameters() if not p.stop_gradient]
    lr = common.lr_schedule(loop.lr_scheduler, loop.learning_rate, loop.lr_warmup_steps, loop.max_train_steps)
    optimizer = paddle.optimizer.AdamW(lr, parameters=trained, beta1=loop.adam_beta1, beta2=loop.adam_beta2,
                                       epsilon=loop.adam_epsilon, weight_decay=loop.adam_weight_decay)
    scaler = paddle.amp.GradScaler(enable=precision == "fp16", init_loss_scaling=2.0**16)

    step, saved_streams = 0, None
    if resume:
        state = load_training_checkpoint(resume, model=model, optimizer=optimizer, ema=ema)
        step, saved_streams = state["step"], state["stream"]
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

    data_stream = common.build_batches(data, tokenizer, batch_size=loop.train_batch_size, seed=loop.seed, dist=dist,
                                       num_workers=loop.num_workers, saved_streams=saved_streams)
    batches = iter(data_stream)
    ddp = paddle.DataParallel(model) if dist.world_size > 1 else model
    no_sync = ddp.no_sync if dist.world_size > 1 else contextlib.nullcontext

    def save(step: int) -> str | None:
        training_state = {
            "step": step,
            "world_size": dist.world_size,
            "stream": dist.gather(data_stream.tracker.state_dict()),
            "rng": dist.gather(paddle.get_rng_state()),
            "numpy": dist.gather(np.random.get_state()),
            "python": dist.gather(random.getstate()),
            "lr_scheduler": lr.state_dict(),
            "scaler": scaler.state_dict(),
            # per-rank fingerprint of the trained weights: ranks that drifted apart show here
            "weights_checksum": dist.gather(weights_checksum(trained)),
        }
        path = None
        if dist.is_main:
            path = save_training_checkpoint(loop.output_dir, step, model=model, tokenizer=tokenizer,
                                            vae_folder=vae_folder, optimizer=optimizer,
                                            training_state=training_state, ema=ema,
                                            limit=loop.checkpoints_total_limit)
            logger.info("saved %s", path)
        dist.barrier()
        return path

    model.train()
    # loss and gradient norm stay on the device until logged: no host sync per micro-step
    window = {"loss": 0.0, "grad_norm": 0.0, "updates": 0}
    progress = tqdm(total=loop.max_train_steps, initial=step, disable=not dist.is_main, desc="train", unit="upd")
    last_checkpoint = None
    while step < loop.max_train_steps:
        for _ in range(loop.gradient_accumulation_steps):
            batch = next(batches)
            with no_sync(), autocast(precision):
                loss = ddp(batch["pixel_values"], batch["input_ids"])
            scaler.scale(loss / loop.gradient_accumulation_steps).backward()
            window["loss"] += loss.detach() / loop.gradient_accumulation_steps
        sync_gradients(trained, dist.world_size)
        scaler.unscale_(optimizer)
        max_norm = loop.max_grad_norm if loop.max_grad_norm > 0 else float("inf")
        window["grad_norm"] += paddle.nn.utils.clip_grad_norm_(trained, max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.clear_grad()
        lr.step()
        if ema is not None:
            ema.update()
        step += 1
        progress.update(1)
        window["updates"] += 1

        if step % loop.logging_steps == 0 or step == loop.max_train_steps:
            samples_per_second, wait_fraction, counts = data_stream.window(dist)
            metrics = {
                "train/loss": dist.mean(float(window["loss"]) / window["updates"]),
                "train/learning_rate": optimizer.get_lr(),
                "train/grad_norm": dist.mean(float(window["grad_norm"]) / window["updates"]),
                "train/samples_per_second": samples_per_second,
                "train/data_wait_fraction": wait_fraction,
            }
            metrics.update({f"data/{reason}": count for reason, count in sorted(counts.items())})
            writer.scalars(metrics, step)
            progress.set_postfix(loss=f"{metrics['train/loss']:.4f}")
            window = {"loss": 0.0, "grad_norm": 0.0, "updates": 0}
        if sampling.image_logging_steps and step % sampling.image_logging_steps == 0:
            # generate() puts every part back in the mode it found it in
            common.log_samples(writer, step, model, tokenizer, data.model_max_length, sampling.num_inference_steps)
        if step % loop.save_steps == 0 or step == loop.max_train_steps:
            last_checkpoint = save(step)
    progress.close()

    if dist.is_main and last_checkpoint:
        from ldm.export import export_checkpoint

        pipeline, used_ema = export_checkpoint(last_checkpoint, os.path.join(loop.output_dir, "pipeline"))
        logger.info("exported %s (%s weights) to %s", last_checkpoint, "EMA" if used_ema else "raw", pipeline)
    dist.barrier()
    writer.close()
    return {"step": step, "checkpoint": last_checkpoint}
