"""The hand-written training loop (`train_txt2img_laion400m_no_trainer.py`, `train_autoencoder.py`).

One optimizer update = `gradient_accumulation_steps` micro-steps, all under DataParallel's `no_sync`, then one
explicit gradient all-reduce, unscale (fp16), global-norm clip, step. The step counter, LR schedule, logging, image
logging and checkpoints all count updates.

The loop is the same for every model; an `Objective` (`ldm.train.objective`) says what is trained: the model and
its loss, its weights in a checkpoint, which images to log, what to write at the end. The run's life around the
updates (set-up, logging, evaluation, checkpoints, stops, teardown) is `ldm.train.run.TrainingRun`'s, shared with
the Trainer path.
"""

from __future__ import annotations

import contextlib
import dataclasses

import paddle

from ldm.config import args
from ldm.runtime.compat import shard_optimizer
from ldm.train.flat import FlatAdamW
from ldm.train.gradients import clip_factor
from ldm.train.objective import TextToImage
from ldm.train.optim import lr_schedule
from ldm.train.run import TrainingRun, loop_plan


def autocast(precision: str):
    if precision == "no":
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(enable=True, dtype="float16" if precision == "fp16" else "bfloat16", level="O1")


def train(loop: args.LoopArguments, model_args: args.ModelArguments, data: args.DataArguments,
          sampling: args.SamplingArguments, run_args: args.RunArguments | None = None,
          validation: args.ValidationArguments | None = None) -> dict:
    """The LDM through the hand-written loop; ends with `<output_dir>/pipeline`."""
    run_args = run_args or args.RunArguments()  # recorded among the groups
    return run(loop, data, lambda dist, resume, resolved: TextToImage(
                   model_args, data, sampling, recompute=resolved.recompute, seed=resolved.seed,
                   validation=validation, resume=resume),
               image_logging_steps=sampling.image_logging_steps, run_args=run_args,
               groups=(model_args, data, sampling, loop, run_args, validation or args.ValidationArguments()))


def run(loop: args.LoopArguments, data: args.DataArguments, build_objective, *, image_logging_steps: int = 0,
        run_args: args.RunArguments | None = None, groups=()) -> dict:
    """Train `build_objective(dist, resume, loop)` (`loop` with its seed resolved) on the streamed shards; returns
    {"step", "checkpoint", "exit_code"}.
    `groups`: every argument group of the entry point, for the run's record (default: `loop`, `data`, `run_args`).

    Every input (folder policy, checkpoint, recorded configuration, model, tokenizer, file list) is checked
    before the first write, so a failed start leaves nothing behind.
    """
    run_args = run_args or args.RunArguments()
    training = TrainingRun(loop_plan(loop, run_args, image_logging_steps), run_args)
    resolved = dataclasses.replace(loop, seed=training.seed)
    groups = tuple(resolved if group is loop else group for group in groups or (loop, data, run_args))
    training.build(lambda: build_objective(training.dist, training.resume, resolved), data, groups)
    lr = lr_schedule(loop.lr_scheduler, loop.learning_rate, loop.lr_warmup_steps, loop.max_train_steps)
    adamw = FlatAdamW if training.flat_update else paddle.optimizer.AdamW  # laid out flat by `training.adopt`
    optimizer = adamw(lr, parameters=training.trained, beta1=loop.adam_beta1, beta2=loop.adam_beta2,
                      epsilon=loop.adam_epsilon, weight_decay=loop.adam_weight_decay)
    if training.shards > 1:
        optimizer = shard_optimizer(optimizer, training.shards)
    training.adopt(optimizer)
    scaler = paddle.amp.GradScaler(enable=training.precision == "fp16", init_loss_scaling=2.0**16)
    training.keep(optimizer=lambda: optimizer, schedule=lambda: lr, scaler=lambda: scaler)
    with training.started(), training.stoppable():
        batches = updates(training, optimizer, lr, scaler, loop.gradient_accumulation_steps,
                          loop.max_grad_norm if loop.max_grad_norm > 0 else float("inf"))
        training.finish(batches)
    return training.result


def updates(training: TrainingRun, optimizer, lr, scaler, accumulation: int, max_norm: float):
    """The updates from where the run starts to its last (or a stop), then `training.end`; returns the iterator of
    batches (the export may go on drawing from it)."""
    model, update, dist, window = training.objective.model, training.update, training.dist, training.window
    ddp = paddle.DataParallel(model) if dist.world_size > 1 else model
    no_sync = ddp.no_sync if dist.world_size > 1 else contextlib.nullcontext
    model.train()
    batches, step, lap = iter(training.batches), training.step, training.phases.lap  # lap: `--phase_timing`
    training.phases.restart()
    while step < training.max_steps and not training.stop.agreed:
        for _ in range(accumulation):
            batch = next(batches)
            lap("data")
            with no_sync(), autocast(training.precision):
                loss, extra = training.objective.loss(ddp, batch)
            lap("forward")
            scaler.scale(loss / accumulation).backward()
            window.add_micro_step(loss, extra, 1 / accumulation)
            lap("backward")
        update.sync(dist.world_size)
        lap("sync")
        scaler.unscale_(optimizer)
        grad_norm, update_loss = update.norm(), window.update_loss()
        lap("clip")
        # the update's one host read: the non-finite verdict, the stop and save votes and the clip factor, agreed
        # by every rank; a norm within the maximum has a factor of exactly 1: no rescaling pass
        skip = training.agree(update_loss, grad_norm, clip_factor(grad_norm, max_norm))
        lap("vote")
        if training.guard.clip_factor < 1 and not skip:
            update.clip(training.guard.clip_factor)
            lap("clip")
        training.guard.hand_to(optimizer, skip, scaler)
        update.step(scaler)
        skipped = training.guard.was_skipped(optimizer)  # ours, or an fp16 overflow
        update.clear()
        lap("optimizer")
        step += 1
        training.updated(step, skipped, loss=update_loss, grad_norm=grad_norm)
        if not skipped:
            lr.step(training.clock.position)  # the schedule follows samples seen
        last = step == training.max_steps
        logging_step = training.log_due(step, last)
        if logging_step:
            training.log_update(step, {"learning_rate": optimizer.get_lr()})
        training.between_updates(step, last=last, logging_step=logging_step, batch=batch)
    training.end(step, stopped=training.stop.agreed)
    return batches
