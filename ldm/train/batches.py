"""The training batches both paths consume: the stream built from the data flags, timed, watched
for stalls, closed on every exit."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

from ldm.config.args import DataArguments
from ldm.data.dataset import (
    CaptionImageStream,
    StreamState,
    batch_samples,
    batch_shape,
    build_dataloader,
    rank_stream_state,
)
from ldm.data.filelist import check_shards, read_file_list, shard_set
from ldm.data.filters import parse_filters
from ldm.data.latents import LatentTransform
from ldm.data.loader import watched
from ldm.data.record import ImageTransform
from ldm.data.tokenize import CaptionTokenizer
from ldm.models.buckets import bucket_name, far_from_area
from ldm.models.conditioning import GEOMETRY
from ldm.runtime.distributed import Distributed
from ldm.runtime.tracking import StepClock

logger = logging.getLogger("ldm.train")


class DataPosition:
    """Each rank's place in the data: the checkpoint part `stream`. Restored, it holds every saved rank's position,
    which the batches start from (`build_batches`); then it is what the batches' tracker says."""

    def __init__(self):
        self.saved: list[dict] | None = None
        self.tracker: StreamState | None = None

    def load_state_dict(self, saved: list[dict]) -> None:
        self.saved = saved

    def follow(self, tracker: StreamState) -> None:
        self.tracker = tracker

    def state_dict(self) -> dict:
        return self.tracker.state_dict()


class TimedBatches:
    """The training batches: records each batch's stream state and the time spent waiting for it.

    A data-path exception is raised here as itself; a wait longer than `data_timeout` seconds ends
    the process with stacks and the shards being read (`ldm.data.watchdog`).
    """

    def __init__(self, loader, tracker, data_timeout: float = 0, buckets: tuple[str, ...] = (),
                 latent_scale: int = 8):
        self.loader, self.tracker, self.clock = loader, tracker, StepClock()
        self.buckets = list(buckets)  # HxW of the aspect-ratio buckets, if any: their mix is logged
        self.latent_scale = latent_scale
        self.data_timeout = data_timeout
        self._iterators: list = []
        self._first = None
        self.on_latents = False  # the batches carry precomputed latents (known once started)
        self.cached_text = False  # and cached text states
        self.shapes: Counter = Counter()  # samples per batch shape (an aspect-ratio bucket) since the last window

    def start(self) -> None:
        """Read the first batch now: a run calls this before it writes anything, so that data it cannot use
        fails the start and leaves nothing behind. The next iteration begins with that batch."""
        iterator = self._batches()
        self._iterators.append(iterator)
        self._first = (iterator, next(iterator))
        self.on_latents = "latent_moments" in self._first[1]
        self.cached_text = "states" in self._first[1].get("conditioning", {})
        if self.on_latents:
            logger.info("training on precomputed latents%s: the autoencoder is not run while training%s",
                        " and text states" if self.cached_text else "", ", nor the text encoder" if self.cached_text
                        else "")

    def __iter__(self):
        """Batches until the stream ends; `close()` stops the loader at once."""
        if self._first is not None:
            iterator, batch = self._first
            self._first = None
            # that batch was read at the start, before the first update: the window (and its data wait) begins
            # now, as `--phase_timing`'s does, or the loader's start-up would read as waiting for data
            self.clock.reset()
            self.clock.waited(0.0, batch_samples(batch))
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
        start = time.perf_counter()
        for batch in watched(self.loader, self.data_timeout):
            batch = self.tracker.update(batch)
            self.clock.waited(time.perf_counter() - start, batch_samples(batch))
            self.shapes[batch_shape(batch, self.latent_scale)] += batch_samples(batch)
            yield batch
            start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent on something else (an evaluation) out of the window's speed."""
        self.clock.start += seconds

    def window(self, dist: Distributed) -> tuple[float, float, Counter, Counter]:
        """(global samples/s, mean data-wait fraction, skipped-record counts over ranks, samples per batch shape
        over ranks) since the last call."""
        elapsed, wait_fraction, samples = self.clock.read()
        self.clock.reset()
        # ranks meet different skip reasons and shapes: gather the dicts (one collective) rather than all-reducing
        # key by key, which would pair different keys across ranks and deadlock
        counts: Counter = Counter()
        shapes: Counter = Counter()
        for rank_counts, rank_shapes in dist.gather((dict(self.tracker.counts()), dict(self.shapes))):
            counts.update(rank_counts)
            shapes.update(rank_shapes)
        self.shapes = Counter()
        return dist.sum(samples) / elapsed, dist.mean(wait_fraction), counts, shapes


def build_batches(data: DataArguments, tokenizer, *, batch_size: int, seed: int, dist: Distributed,
                  num_workers: int, saved_streams: list[dict] | None = None, autoencoder: str | None = None,
                  autoencoder_source: str = "", buckets: tuple[tuple[int, int], ...] | None = None,
                  latent_scale: int = 8, cached_text: str | None = None,
                  added_conditions: tuple[str, ...] = ()) -> TimedBatches:
    """The streaming loader of this rank, resumed from a checkpoint's per-rank stream states if given.

    Without a tokenizer (the autoencoder) batches carry images only and captions are not read. Latent
    records (`ldm.data.latents`, told from the content) are taken when they were encoded by `autoencoder`
    (its fingerprint; None: this run trains on images only); their batches carry `latent_moments`. `buckets`:
    the run's aspect-ratio buckets (the objective's, for its model; None: square crops); `latent_scale`, the
    autoencoder's downsampling, names a latent batch's bucket in pixels. `cached_text`: the fingerprint of the run's
    frozen text encoder, whose cached text states latent records may carry (batches then carry them in
    `conditioning` instead of `input_ids`); "" when the run trains its text encoder. `added_conditions`: those the
    run's model reads (image batches carry the geometry whatever the model; latent records encoded without it are
    refused when the model reads it).
    """
    if buckets and dist.is_main:
        logger.info("aspect-ratio buckets (height x width): %s", ", ".join(map(bucket_name, buckets)))
        if far := far_from_area(buckets, data.resolution):
            logger.warning("bucket(s) %s are far from --resolution %d squared in area: each is trained at its own "
                           "cost, while FLOPs and MFU are counted at %dx%d", ", ".join(map(bucket_name, far)),
                           data.resolution, data.resolution, data.resolution)
    state = rank_stream_state(saved_streams, dist.rank, dist.world_size) if saved_streams else None
    shards = read_file_list(data.file_list)
    # a tokenizer: an LDM run, whose slots batch one kind of record (the autoencoder refuses latents record by record)
    dist.from_main(lambda: check_shards(shards, data.file_list, one_kind=tokenizer is not None))
    stream = CaptionImageStream(
        shards,
        tokenize=CaptionTokenizer(tokenizer, data.model_max_length) if tokenizer is not None else None,
        transform=ImageTransform(data.resolution, center_crop=data.center_crop, random_flip=data.random_flip,
                                 min_image_size=data.min_image_size, buckets=buckets),
        latents=LatentTransform(autoencoder, autoencoder_source, data.resolution, data.random_flip, buckets,
                                cached_text, GEOMETRY in added_conditions) if autoencoder is not None else None,
        batch_size=batch_size,
        caption_dropout_prob=data.caption_dropout_prob,
        seed=seed,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=num_workers,
        shuffle_buffer=data.shuffle_buffer,
        state=state,
        metadata_filter=parse_filters(data.metadata_filter),
        allow_data_change=data.allow_data_change,
    )
    tracker = StreamState(num_workers, shard_set(shards))
    if stream.resumes_exactly:
        tracker.load_state_dict(state)
    return TimedBatches(build_dataloader(stream, num_workers), tracker, data.data_timeout,
                        buckets=tuple(map(bucket_name, buckets or ())), latent_scale=latent_scale)
