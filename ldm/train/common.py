"""Building blocks both entry points use: logging set-up, tokenizer, model, data stream, optimizer
schedule, gradient clipping, sample-image logging."""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from collections import Counter

import numpy as np
import paddle

from ldm.args import DataArguments, ModelArguments
from ldm.distributed import Distributed
from ldm.tracking import StepClock, quiet_libraries

logger = logging.getLogger("ldm.train")

# Prompts of the sample images logged during training (fixed, so that runs compare).
SAMPLE_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a red circle on a blue background",
    "a painting of a lighthouse at sunset",
    "a green square on a white background",
)


def setup_logging(dist: Distributed) -> None:
    logging.basicConfig(
        level=logging.INFO if dist.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {dist.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    quiet_libraries()


def resolve_precision(requested: str) -> str:
    """The mixed-precision mode to use: the requested one, or "no" with a message if unsupported here."""
    supported = {"fp16": paddle.amp.is_float16_supported, "bf16": paddle.amp.is_bfloat16_supported}
    if requested in supported and not supported[requested]():
        logger.warning("%s mixed precision is not supported on this device (%s): training in fp32",
                       requested, paddle.device.get_device())
        return "no"
    return requested


def build_tokenizer(data: DataArguments):
    from ldm.data.tokenize import load_tokenizer

    return load_tokenizer(data.tokenizer_name, data.model_max_length)


def build_model(model_args: ModelArguments, data: DataArguments, tokenizer, *, recompute: bool, seed: int):
    """The LatentDiffusion wrapper and its components, identical on every rank for a seed.

    Built under a fresh unique-name scope, so parameter names (and with them optimizer state keys)
    do not depend on what the process built before.
    """
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion

    with paddle.utils.unique_name.guard():
        components = build_components(
            model_args.model_name_or_path,
            vae_name_or_path=model_args.vae_name_or_path,
            vocab_size=tokenizer.vocab_size,
            model_max_length=data.model_max_length,
            pad_token_id=tokenizer.pad_token_id,
            prediction_type=model_args.prediction_type,
            seed=seed,
        )
        model = LatentDiffusion(
            components.unet, components.text_encoder, components.vae, components.noise_scheduler,
            noise_offset=model_args.noise_offset, snr_gamma=model_args.snr_gamma,
            freeze_text_encoder=model_args.freeze_text_encoder, recompute=recompute,
        )
    logger.info("model from %s; %s", components.source, components.describe())
    return model, components


def warn_if_loader_threads_run() -> None:
    """Workers forked while another loader's reader thread runs can inherit a lock that thread holds (a
    log handler's, stderr's) and hang on their first log line: seen in this project's test suite."""
    import threading

    others = [t.name for t in threading.enumerate() if "_thread_loop" in t.name]
    if others:
        logger.warning("starting data loader workers while %d other loader thread(s) run (%s): a worker can hang "
                       "on a lock one of them holds; close the other loader first", len(others), ", ".join(others))


class TimedBatches:
    """The training batches: records each batch's stream state and the time spent waiting for it.

    A data-path exception is raised here as itself; a wait longer than `data_timeout` seconds ends
    the process with stacks and the shards being read (`ldm.data.watchdog`).
    """

    def __init__(self, loader, tracker, data_timeout: float = 0):
        self.loader, self.tracker, self.clock = loader, tracker, StepClock()
        self.data_timeout = data_timeout
        self._iterators: list = []
        self._first = None

    def start(self) -> None:
        """Read the first batch now: a run calls this before it writes anything, so that data it cannot use
        fails the start and leaves nothing behind. The next iteration begins with that batch."""
        iterator = self._batches()
        self._iterators.append(iterator)
        self._first = (iterator, next(iterator))

    def __iter__(self):
        """Batches until the stream ends; `close()` stops the loader at once."""
        if self._first is not None:
            iterator, batch = self._first
            self._first = None
            return itertools.chain([batch], iterator)
        iterator = self._batches()
        self._iterators.append(iterator)
        return iterator

    def close(self) -> None:
        """Stop every loader this object started (a consumer such as the Trainer may not close its own)."""
        for iterator in self._iterators:
            iterator.close()
        self._iterators, self._first = [], None

    def _batches(self):
        from ldm.compat import stop_loader
        from ldm.data.watchdog import StallWatchdog, raise_if_error

        if self.loader.num_workers:
            warn_if_loader_threads_run()
        iterator = iter(self.loader)  # forks the workers
        watchdog = StallWatchdog(self.data_timeout, self.loader.dataset.board)  # its thread starts after that
        try:
            while True:
                start = time.perf_counter()
                watchdog.waiting()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                finally:
                    watchdog.received()
                raise_if_error(batch)
                batch = self.tracker.update(batch)
                self.clock.waited(time.perf_counter() - start, batch["pixel_values"].shape[0])
                yield batch
        finally:
            watchdog.close()
            stop_loader(iterator)

    def window(self, dist: Distributed) -> tuple[float, float, Counter]:
        """(global samples/s, mean data-wait fraction, skipped-record counts over ranks) since the last call."""
        elapsed, wait_fraction, samples = self.clock.read()
        self.clock.reset()
        # ranks meet different skip reasons: gather the dicts (one collective) rather than all-reducing
        # key by key, which would pair different keys across ranks and deadlock
        counts: Counter = Counter()
        for rank_counts in dist.gather(dict(self.tracker.counts())):
            counts.update(rank_counts)
        return dist.sum(samples) / elapsed, dist.mean(wait_fraction), counts


def build_batches(data: DataArguments, tokenizer, *, batch_size: int, seed: int, dist: Distributed,
                  num_workers: int, saved_streams: list[dict] | None = None) -> TimedBatches:
    """The streaming loader of this rank, resumed from a checkpoint's per-rank stream states if given.

    Without a tokenizer (the autoencoder) batches carry images only and captions are not read.
    """
    from ldm.data.dataset import CaptionImageStream, StreamState, build_dataloader, rank_stream_state
    from ldm.data.filelist import check_shards, read_file_list
    from ldm.data.record import ImageTransform
    from ldm.data.tokenize import CaptionTokenizer

    state = rank_stream_state(saved_streams, dist.rank, dist.world_size) if saved_streams else None
    shards = read_file_list(data.file_list)
    dist.from_main(lambda: check_shards(shards, data.file_list))
    stream = CaptionImageStream(
        shards,
        tokenize=CaptionTokenizer(tokenizer, data.model_max_length) if tokenizer is not None else None,
        transform=ImageTransform(data.resolution, center_crop=data.center_crop, random_flip=data.random_flip,
                                 min_image_size=data.min_image_size),
        batch_size=batch_size,
        caption_dropout_prob=data.caption_dropout_prob,
        seed=seed,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=num_workers,
        shuffle_buffer=data.shuffle_buffer,
        state=state,
    )
    tracker = StreamState(num_workers)
    if stream.resumes_exactly:
        tracker.load_state_dict(state)
    return TimedBatches(build_dataloader(stream, num_workers), tracker, data.data_timeout)


@paddle.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> paddle.Tensor:
    """Global L2 norm of the gradients (fp32); gradients are scaled in place to `max_norm` if above it.

    The result of `paddle.nn.utils.clip_grad_norm_`, computed the way Paddle's own
    `ClipGradByGlobalNorm` does (one squared-norm kernel per gradient, one sum) instead of a norm
    per gradient, a stack and a second norm; no rescaling pass when `max_norm` is infinite. Per-op
    cost dominates for small models on a CPU: see `scripts/bench_step.py`.
    """
    from ldm.compat import squared_l2_norm

    grads = [p.grad_ for p in parameters if p.grad_ is not None]  # grad_: the gradient itself, writable
    if not grads:
        return paddle.zeros([], dtype="float32")
    total = paddle.sqrt(paddle.add_n([squared_l2_norm(g).astype("float32").reshape([]) for g in grads]))
    if math.isfinite(max_norm):
        scale = paddle.clip(max_norm / (total + 1e-6), max=1.0)
        scales = {dtype: scale.astype(dtype) for dtype in {g.dtype for g in grads}}  # one cast per dtype
        for g in grads:
            g.multiply_(scales[g.dtype])
    return total


def lr_schedule(name: str, learning_rate: float, warmup_steps: int, total_steps: int):
    """PaddleNLP's schedules, counted in optimizer updates."""
    from paddlenlp.trainer.trainer_utils import get_scheduler

    return get_scheduler(name, learning_rate=learning_rate, num_warmup_steps=warmup_steps,
                         num_training_steps=total_steps)


def log_samples(writer, step: int, model, tokenizer, model_max_length: int, num_inference_steps: int,
                seed: int = 0, tag: str = "samples") -> None:
    """Sample images at guidance 1.0 and 7.5 for the fixed prompts (on the writing rank only)."""
    if not writer.active:
        return
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.sampling import ddim_scheduler, generate, image_grid

    tokenize = CaptionTokenizer(tokenizer, model_max_length)
    scheduler = ddim_scheduler(dict(model.noise_scheduler.config))
    for guidance in (1.0, 7.5):
        images = generate(model.unet, model.text_encoder, model.vae, scheduler, tokenize, SAMPLE_PROMPTS,
                          guidance_scale=guidance, num_inference_steps=num_inference_steps, seed=seed)
        writer.image(f"{tag}/guidance_{guidance}", np.asarray(image_grid(images, 1)), step)
