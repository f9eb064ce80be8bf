"""The hand-written training loop (`train_txt2img_laion400m_no_trainer.py`, `train_autoencoder.py`).

One optimizer update = `gradient_accumulation_steps` micro-steps, all under DataParallel's
`no_sync`, then one explicit gradient all-reduce, unscale (fp16), global-norm clip, step. The step
counter, LR schedule, logging, image logging and checkpoints all count updates.

The loop is the same for every model; an `Objective` (`ldm.train.objective`) says what is trained:
the model and its loss, its weights in a checkpoint, which images to log, what to write at the end.
The `Checkpointer` owns the rest of the run state and when it is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import paddle

from ldm.checkpoint.run_folder import RunFolder
from ldm.config.args import (
    DataArguments,
    LoopArguments,
    ModelArguments,
    RunArguments,
    SamplingArguments,
    ValidationArguments,
)
from ldm.config.record import describe_run, hyperparameters, resolve_seed
from ldm.models.flops import throughput_metrics
from ldm.runtime.compat import shard_optimizer, sharding_owners
from ldm.runtime.device import check_sharding, resolve_precision
from ldm.runtime.distributed import Distributed, sync_gradients
from ldm.runtime.tracking import NullWriter, make_writer
from ldm.train import setup
from ldm.train.checkpointer import Checkpointer, optimizer_part, scaler_part, shard_ema, stateful
from ldm.train.elastic import SampleClock
from ldm.train.gradients import clip_factor, global_grad_norm, scale_gradients
from ldm.train.health import NonFiniteGuard, batch_positions
from ldm.train.memory import log_largest, memory_by_rank
from ldm.train.metrics import EvalClock, MetricsWindow, evaluate
from ldm.train.objective import TextToImage, rank_seed, start_batches
from ldm.train.optim import lr_schedule
from ldm.train.preflight import check_before_writing
from ldm.train.progress import Progress
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


def train(loop: LoopArguments, model_args: ModelArguments, data: DataArguments, sampling: SamplingArguments,
          run_args: RunArguments | None = None, validation: ValidationArguments | None = None) -> dict:
    """The LDM through the hand-written loop; ends with `<output_dir>/pipeline`."""
    run_args, validation = run_args or RunArguments(), validation or ValidationArguments()
    return run(loop, data, lambda dist, resume, resolved: TextToImage(
                   model_args, data, sampling, recompute=resolved.recompute, seed=resolved.seed,
                   validation=validation, resume=resume),
               image_logging_steps=sampling.image_logging_steps, run_args=run_args,
               groups=(model_args, data, sampling, loop, run_args, validation))


def run(loop: LoopArguments, data: DataArguments, build_objective, *, image_logging_steps: int = 0,
        run_args: RunArguments | None = None, groups=()) -> dict:
    """Train `build_objective(dist, resume, loop)` (`loop` with its seed resolved) on the streamed shards; returns
    {"step", "checkpoint", "exit_code"}.
    `groups`: every argument group of the entry point, for the run's record (default: `loop`, `data`, `run_args`).

    Every input (folder policy, checkpoint, recorded configuration, model, tokenizer, file list) is checked
    before the first write, so a failed start leaves nothing behind.
    """
    run_args = run_args or RunArguments()
    dist = Distributed.init()
    setup.setup_logging(dist)
    check_sharding({loop.sharding} - {""})
    shards, _ = setup.sharding_layout(loop.sharding, loop.sharding_parallel_degree, dist)
    run_dir = RunFolder(loop.output_dir, dist, loop.checkpoints_total_limit)
    resume = run_dir.check(loop.resume_from_checkpoint, loop.overwrite_output_dir)
    given = loop
    loop = dataclasses.replace(loop, seed=resolve_seed(loop.seed, resume))
    groups = tuple(loop if group is given else group for group in groups)
    precision = resolve_precision(loop.mixed_precision)

    objective = build_objective(dist, resume, loop)
    record = describe_run(groups or (loop, data, run_args), dist=dist, num_workers=loop.num_workers,
                          model=objective.identity(), precision=precision)
    model, ema = objective.model, objective.ema
    trained = [p for p in model.parameters() if not p.stop_gradient]
    lr = lr_schedule(loop.lr_scheduler, loop.learning_rate, loop.lr_warmup_steps, loop.max_train_steps)
    optimizer = paddle.optimizer.AdamW(lr, parameters=trained, beta1=loop.adam_beta1, beta2=loop.adam_beta2,
                                       epsilon=loop.adam_epsilon, weight_decay=loop.adam_weight_decay)
    if shards > 1:
        optimizer = shard_optimizer(optimizer, shards)
        shard_ema(ema, model, optimizer)
    owners = sharding_owners(optimizer)
    record["memory"] = memory_by_rank(model, world_size=dist.world_size, sharding_degree=shards, ema=ema is not None,
                                      owners=owners[0] if owners else None)
    log_largest(record["memory"])
    scaler = paddle.amp.GradScaler(enable=precision == "fp16", init_loss_scaling=2.0**16)
    data_stream = start_batches(objective, resume, data, batch_size=loop.train_batch_size, seed=loop.seed,
                                dist=dist, num_workers=loop.num_workers)
    writer, progress, checkpointer = NullWriter(), None, None  # from here on, every exit stops the loader (`finally`)
    try:
        accumulation = loop.gradient_accumulation_steps
        samples = SampleClock(loop.train_batch_size * accumulation * dist.world_size, dist.world_size,
                              loop.max_train_steps)
        checkpointer = Checkpointer(
            run_dir, dist, objective, save_steps=loop.save_steps, seed=loop.seed, trained=trained,
            data_position=data_stream.tracker.state_dict, record=record, async_save=run_args.async_save,
            parts={"optimizer": optimizer_part(lambda: optimizer), "lr_scheduler": stateful(lr),
                   "scaler": scaler_part(scaler), "samples": samples.part()})
        guard = NonFiniteGuard(dist, run_args.max_nonfinite_updates)
        flops = check_before_writing(objective, data_stream, record, resume,
                                     allow_config_change=run_args.allow_config_change, dist=dist)
        run_dir.create(resume, record)  # the first write
        objective.start(run_dir)
        step = 0
        if resume:
            step = checkpointer.load(resume)
            logger.info("resumed from %s at update %d (read in %.2f s)", resume, step, checkpointer.load_seconds)
            if samples.message:
                logger.warning("%s", samples.message)
        else:
            paddle.seed(rank_seed(loop.seed, dist.rank))
        writer = make_writer(loop.report_to, run_dir.path(), hyperparameters(record), dist.is_main,
                             resume_step=step if resume else None)

        ddp = paddle.DataParallel(model) if dist.world_size > 1 else model
        no_sync = ddp.no_sync if dist.world_size > 1 else contextlib.nullcontext
        model.train()
        window = MetricsWindow()
        max_steps = samples.max_steps  # --max_train_steps, unless a resume changed the global batch (ldm.train.elastic)
        max_norm = loop.max_grad_norm if loop.max_grad_norm > 0 else float("inf")
        target, label = progress_target(step, max_steps, loop.save_steps)
        progress = Progress(run_args.progress, total=target, initial=step, label=label, enabled=dist.is_main,
                            seconds=run_args.progress_seconds)
        stopping = False
        batches = iter(data_stream)
        clock = EvalClock()
        with GracefulStop(dist) as stop:
            while step < max_steps and not stopping:
                for _ in range(accumulation):
                    batch = next(batches)
                    with no_sync(), autocast(precision):
                        loss, extra = objective.loss(ddp, batch)
                    scaler.scale(loss / accumulation).backward()
                    window.add_micro_step(loss, extra, 1 / accumulation)
                sync_gradients(trained, dist.world_size)
                scaler.unscale_(optimizer)
                grad_norm = global_grad_norm(trained)
                update_loss = window.update_loss()
                # the update's one host read: the non-finite verdict, the stop vote and the clip factor, agreed
                # by every rank; a norm within the maximum has a factor of exactly 1: no rescaling pass
                verdict = guard.check(update_loss, grad_norm, stop, clip_factor=clip_factor(grad_norm, max_norm),
                                      saves=checkpointer)
                if guard.clip_factor < 1 and not verdict:
                    scale_gradients(trained, guard.clip_factor)
                stopping = stop.agreed
                guard.hand_to(optimizer, verdict, scaler)
                scaler.step(optimizer)
                scaler.update()
                skipped = guard.was_skipped(optimizer)  # ours, or an fp16 overflow
                window.add_update(grad_norm, skipped)
                optimizer.clear_grad()
                if skipped:
                    samples.skip()
                else:
                    samples.advance()
                    lr.step(samples.position)  # the schedule follows samples seen
                    if ema is not None:
                        ema.update()
                step += 1
                guard.record(step, skipped, loss=update_loss, grad_norm=grad_norm,
                             where=batch_positions(data_stream.tracker.state_dict()) if skipped else "")
                last = step == max_steps
                logging_step = step % loop.logging_steps == 0 or last or stopping or guard.exhausted

                if logging_step:
                    metrics = {"learning_rate": optimizer.get_lr(), **window.read(dist, data_stream), **guard.read()}
                    metrics.update(throughput_metrics(flops and flops.mean(metrics),
                                                      metrics["global_samples_per_second"], dist.world_size,
                                                      run_args.peak_tflops))
                    writer.scalars(metrics, step)
                    progress.show({"loss": f"{metrics['loss']:.4f}",
                                   "samples_s": f"{metrics['global_samples_per_second']:.1f}",
                                   "data_wait": f"{metrics['data_wait_fraction']:.0%}"})
                progress.update(step, logging_step=logging_step, saving=checkpointer.in_flight)
                guard.stop_if_exhausted(checkpointer)  # every rank at the same update: the verdict is shared
                if objective.validation_due(step, last) and not stopping:
                    writer.scalars(evaluate(objective, dist, step, clock, data_stream), step)
                if image_logging_steps and step % image_logging_steps == 0:
                    objective.log_images(writer, step, batch)  # every rank: a sharded EMA is gathered first
                if checkpointer.due(step, last=last, stopping=stopping):
                    checkpointer.save(step)
                    if step >= target and not stopping:  # an endless run: count toward the next checkpoint
                        target, label = progress_target(step, max_steps, loop.save_steps)
                        progress.retarget(target, label)
                for values in checkpointer.take_metrics():
                    writer.scalars(values, step)
            checkpointer.wait()  # the last save, written by every rank, sealed before anything reads it
            for values in checkpointer.take_metrics():
                writer.scalars(values, step)
            progress.close()
            if stopping:
                stop.announce(step, checkpointer.last, checkpointer.sealed)
            else:
                objective.finish(checkpointer.last, batches, dist, run_dir)
    except Exception as e:
        run_dir.record_failure(e)
        raise
    finally:
        if progress is not None:
            progress.close()  # an error's message then starts on a line of its own
        if checkpointer is not None:
            checkpointer.close()  # never leave with a save in flight
        data_stream.close()  # loader workers and reader thread stop here, not during interpreter exit
        writer.close()
        run_dir.release()
    dist.barrier()
    # a signal after the last update changed nothing: the run is complete
    return {"step": step, "checkpoint": checkpointer.last, "exit_code": stop.exit_code if stopping else 0}
