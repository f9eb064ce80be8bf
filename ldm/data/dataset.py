"""The Paddle streaming dataset over caption-image shards, and the stream state the training loop keeps.

`CaptionImageStream` batches inside each (rank, worker) slot and attaches the slot's state after
each batch. Paddle's DataLoader takes batches from its workers in strict round-robin order, so the
loop's `StreamState` (last consumed state per slot + number of batches consumed) is enough to
restart every worker exactly where the consumer left it: on restore, worker w takes the role of
slot (w + batches) mod workers, so the next batch comes from the slot that was next.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from typing import Any

import cv2
import numpy as np
from paddle.io import DataLoader, IterableDataset, get_worker_info

from ldm.compat import READER_POLL_SECONDS, check_loader_classes
from ldm.data.filelist import FileListError, Shard
from ldm.data.filters import MetadataFilters, latent_metadata, sample_parts, text_metadata
from ldm.data.latents import LatentMismatch, LatentTransform, is_latent_line
from ldm.data.readers import count_records as shard_records
from ldm.data.record import ImageTransform, sample_rng
from ldm.data.shard import ShardError
from ldm.data.stream import Record, SlotStream
from ldm.data.watchdog import ReadingBoard, error_batch, in_worker_process

logger = logging.getLogger("ldm.data")


def count_records(shards: list[Shard]) -> int:
    total = 0
    for shard in shards:
        with contextlib.suppress(ShardError):  # counted where it is read; here only the total matters
            total += shard_records(shard.path)
    return total


def check_enough_records(shards: list[Shard], num_slots: int) -> None:
    """Every slot needs at least one record: checked (cheaply) only when shards are fewer than slots."""
    if len(shards) >= num_slots:
        return
    records = count_records(shards)
    if records < num_slots:
        raise FileListError(
            f"the file list holds {records} record(s) in {len(shards)} shard(s), fewer than the "
            f"{num_slots} (rank, dataloader worker) slots that read it; use fewer workers or more data"
        )


def to_uint8_batch(images: list[np.ndarray]) -> np.ndarray:
    """uint8 HWC crops -> uint8 [B, 3, R, R]: what crosses from a loader worker to the trainer (a quarter
    of float32's bytes to pickle, send and copy to the device); the model scales it (`unit_range`)."""
    return np.ascontiguousarray(np.stack(images).transpose(0, 3, 1, 2))


def batch_samples(batch: dict) -> int:
    """How many samples a training batch holds (of images or of latents)."""
    return len(batch["pixel_values"] if "pixel_values" in batch else batch["latent_moments"])


def to_pixel_values(images: list[np.ndarray]) -> np.ndarray:
    """uint8 HWC crops -> float32 [B, 3, R, R] in [-1, 1]."""
    batch = np.stack(images).transpose(0, 3, 1, 2).astype(np.float32)
    batch *= 2.0 / 255.0
    batch -= 1.0
    return batch


def rank_stream_state(saved: list[dict], rank: int, world_size: int) -> dict:
    """This rank's part of the per-rank stream states a checkpoint holds.

    Saved with another number of ranks, every rank's slots are returned: their layout differs from
    this run's, so the stream starts the pass after the furthest one instead of resuming exactly.
    """
    if len(saved) == world_size:
        return saved[rank]
    slots = {slot: state for rank_state in saved for slot, state in rank_state["slots"].items()}
    return {"num_workers": saved[0]["num_workers"], "batches": 0, "slots": slots}


def run_slot(batches):
    """`batches(worker)` in a loader worker (or, without workers, the loader's thread): one OpenCV thread (the
    slots are the parallelism), the worker's set-up, and any exception carried to the consumer as a batch."""
    cv2.setNumThreads(1)
    info = get_worker_info()
    if info is not None:
        in_worker_process()
    try:
        yield from batches(info.id if info is not None else 0)
    except Exception as e:  # noqa: BLE001 - carried to the training loop and raised there (ldm.data.watchdog)
        yield error_batch(e)


class CaptionImageStream(IterableDataset):
    def __init__(
        self,
        shards: list[Shard],
        *,
        tokenize,
        transform: ImageTransform,
        latents: LatentTransform | None = None,
        batch_size: int,
        caption_dropout_prob: float = 0.1,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        shuffle_buffer: int = 256,
        state: dict[str, Any] | None = None,
        metadata_filter: MetadataFilters | None = None,
    ):
        super().__init__()
        self.shards, self.tokenize, self.transform, self.latents = shards, tokenize, transform, latents
        self.metadata_filter = metadata_filter or None  # no filters: nothing checked
        self.batch_size, self.caption_dropout_prob, self.seed = batch_size, caption_dropout_prob, seed
        self.rank, self.world_size = rank, world_size
        self.workers = max(1, num_workers)
        self.shuffle_buffer = shuffle_buffer
        self.kind: bool | None = None  # latent records? set by the first record this process reads
        check_enough_records(shards, world_size * self.workers)
        self.board = ReadingBoard(self.workers)
        self.slot_states: dict[int, dict] = {}
        self.first_role = 0
        self.start_pass = 0
        self.resumes_exactly = False
        if state:
            self.load_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        slots = {int(k): v for k, v in state["slots"].items()}
        same_layout = state["num_workers"] == self.workers and all(
            s["num_slots"] == self.world_size * self.workers for s in slots.values()
        )
        if same_layout:
            self.slot_states = slots
            self.first_role = state["batches"] % self.workers
            self.resumes_exactly = True
        else:
            # Exact resume needs the same (ranks x workers) layout; otherwise start a fresh pass.
            self.start_pass = 1 + max((s["pass"] for s in slots.values()), default=-1)
            logger.warning(
                "data stream state was saved with another rank/worker layout; starting pass %d instead "
                "of resuming exactly", self.start_pass,
            )

    def make_sample(self, record: Record) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 HWC image crop, or float32 latent moments; token ids): the record's kind is read from its content.

        A tar's or parquet's record (`ldm.data.readers.Sample`) is an image record; its metadata filters run before
        its image is decoded."""
        line = record.line
        text = isinstance(line, bytes)
        latent = text and is_latent_line(line)
        if latent and self.latents is None:
            raise LatentMismatch(f"{record.shard}:{record.line_number} is a latent record; this run trains on "
                                 "images (train_autoencoder.py needs image shards)")
        if self.kind is None:
            self.kind = latent  # this process's slot batches one kind: the kind of its first record
        elif latent != self.kind:
            raise LatentMismatch(f"{record.shard}:{record.line_number} is {'a latent' if latent else 'an image'} "
                                 "record, but the file list began with the other kind: train on one kind")
        transform = self.latents if latent else self.transform
        if not text:
            caption, payload = sample_parts(line, self.metadata_filter)
        else:
            caption, payload = transform.parse(line)
            if self.metadata_filter:
                self.metadata_filter.check(latent_metadata(line) if latent else text_metadata(line),
                                           None if latent else payload)
        rng = sample_rng(self.seed, record.pass_index, record.seed_key, record.line_number, record.copy)
        if rng.random() < self.caption_dropout_prob:
            caption = ""
        try:
            sample = transform(payload, rng)
        except LatentMismatch as e:
            raise LatentMismatch(f"{record.shard}:{record.line_number}: {e}") from None
        return sample, self.tokenize(caption) if self.tokenize else None

    def slot_stream(self, role: int) -> SlotStream:
        slot = self.rank * self.workers + role
        stream = SlotStream(
            self.shards, slot, self.world_size * self.workers, self.seed, self.shuffle_buffer,
            state=self.slot_states.get(slot),
        )
        if slot not in self.slot_states:
            stream.pass_index = self.start_pass
        return stream

    def __iter__(self):
        return run_slot(self.batches)

    def batches(self, worker: int):
        stream = self.slot_stream((worker + self.first_role) % self.workers)
        where = f"slot {stream.slot} of {stream.num_slots}"
        stream.on_open = lambda path: self.board.post(worker, f"{where}: opening {path}")
        images, ids = [], []
        for image, input_ids in stream.samples(self.make_sample):
            images.append(image)
            ids.append(input_ids)
            if len(images) == self.batch_size:
                batch = {"stream_state": json.dumps(stream.state_dict())}
                if self.kind:
                    batch["latent_moments"] = np.stack(images)
                else:
                    batch["pixel_values"] = to_uint8_batch(images)
                if self.tokenize:
                    batch["input_ids"] = np.stack(ids)
                self.board.post(worker, f"{where}: {stream.reading()}")
                yield batch
                images, ids = [], []


class StreamState:
    """The training loop's record of the data stream: what it consumed, per slot."""

    def __init__(self, num_workers: int):
        self.num_workers = max(1, num_workers)
        self.slots: dict[int, dict] = {}
        self.batches = 0

    def update(self, batch: dict) -> dict:
        """Record the batch's slot state; returns the batch without it."""
        batch = dict(batch)
        state = json.loads(batch.pop("stream_state"))
        self.slots[state["slot"]] = state
        self.batches += 1
        return batch

    def counts(self) -> Counter:
        total: Counter = Counter()
        for state in self.slots.values():
            total.update(state["counts"])
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "batches": self.batches, "slots": dict(self.slots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.slots = {int(k): v for k, v in state["slots"].items()}
        self.batches = state["batches"]


def build_dataloader(stream: CaptionImageStream, num_workers: int) -> DataLoader:
    check_loader_classes()  # `compat.stop_loader` will need Paddle's iterator internals
    return DataLoader(stream, batch_size=None, num_workers=num_workers, use_shared_memory=False,
                      timeout=READER_POLL_SECONDS)  # only the poll interval: no batch ever times out
