"""The Paddle streaming dataset over caption-image shards, and the stream state the training loop keeps.

`CaptionImageStream` batches inside each (rank, worker) slot and attaches the slot's state after
each batch. Paddle's DataLoader takes batches from its workers in strict round-robin order, so the
loop's `StreamState` (last consumed state per slot + number of batches consumed) is enough to
restart every worker exactly where the consumer left it: on restore, worker w takes the role of
slot (w + batches) mod workers, so the next batch comes from the slot that was next.

Resumed with another (ranks x workers) layout, the saved states of every slot are turned into the
plan of what is left of the interrupted pass(es) (`ldm.data.resume`), which the new slots read
first, each record exactly once, before the next pass starts. A state saved without a layout
change stays the same state: same-layout resumes are bit-identical to an uninterrupted run.

`LDM_DATA_CONSUMED_LOG=PATH` (tests, checks, `scripts/soak.py`) appends "pass copy shard line shape rank batch"
for every record of every batch the training loop takes to PATH: `shape` the batch's HxW (of pixels or latents),
`rank` the process's, `batch` how many batches this process took before that one (so the update a record was
trained in is the resumed step + batch // accumulation + 1). Under `python -m ldm.launch`, `{restarts}` in PATH
becomes the number of restarts so far: a ledger per try.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter
from typing import Any

import cv2
import numpy as np
from paddle.io import DataLoader, IterableDataset, get_worker_info

from ldm.data.filelist import FileListError, Shard, shard_set_change
from ldm.data.filters import MetadataFilters, record_parts
from ldm.data.latents import LatentMismatch, LatentTransform, is_latent_line
from ldm.data.readers import count_records as shard_records
from ldm.data.record import GEOMETRY, ImageTransform, SkipRecord, sample_rng
from ldm.data.resume import Picked, Schedule, counts_of, remainder
from ldm.data.shard import ShardError
from ldm.data.stream import PHASE_END, TRUNCATED_CAPTIONS, Record, SlotStream
from ldm.data.watchdog import ReadingBoard, error_batch, in_worker_process
from ldm.runtime.compat import READER_POLL_SECONDS, check_loader_classes
from ldm.runtime.heartbeat import RESTARTS_ENV

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


def batch_shape(batch: dict, latent_scale: int = 8) -> str:
    """HxW of a training batch's images in pixels (of latents: times the autoencoder's downsampling)."""
    if "pixel_values" in batch:
        return "x".join(map(str, batch["pixel_values"].shape[-2:]))
    return "x".join(str(n * latent_scale) for n in batch["latent_moments"].shape[-2:])


def to_pixel_values(images: list[np.ndarray]) -> np.ndarray:
    """uint8 HWC crops -> float32 [B, 3, R, R] in [-1, 1]."""
    batch = np.stack(images).transpose(0, 3, 1, 2).astype(np.float32)
    batch *= 2.0 / 255.0
    batch -= 1.0
    return batch


CONSUMED_LOG = "LDM_DATA_CONSUMED_LOG"


def rank_stream_state(saved: list[dict], rank: int, world_size: int) -> dict:
    """What rank `rank` of `world_size` resumes from, given every rank's stream state in a checkpoint.

    The stream resolves it (`CaptionImageStream.load_state_dict`: it knows the shards and this run's
    workers) and leaves this rank's state in it under "resolved", which the loop's
    `StreamState.load_state_dict` then takes: the same rank's state if the layout is the same, else
    the plan of what the interrupted pass has left (`ldm.data.resume`) and no slot position yet.
    """
    return {"saved": list(saved), "rank": rank, "world_size": world_size}


class DataChanged(FileListError):
    """A resume over other shards than the checkpoint's data position was made for."""


def resolve_stream_state(request: dict, shards: list[Shard], seed: int, num_workers: int,
                         allow_data_change: bool = False) -> dict:
    """This rank's stream state in this run's layout (see `rank_stream_state`).

    Positions in a pass are positions in its shard order, a function of the seed and the shard list: with another
    seed the interrupted pass ends and a new one starts; with other shards the resume is refused (DataChanged)
    unless `allow_data_change`, since reading on would read some records of the pass twice and others never."""
    saved, rank, world_size = request["saved"], request["rank"], request["world_size"]
    workers = max(1, num_workers)
    schedule = next((s["schedule"] for s in saved if s.get("schedule")), None)  # kept by one rank
    counts_before = Counter()
    for s in saved:
        counts_before.update(s.get("counts_before", {}))
    holder = rank == 0
    old_workers = saved[0]["num_workers"]
    slots = {int(k): v for rank_state in saved for k, v in rank_state["slots"].items()}
    old = Schedule.from_json(schedule)
    next_pass = 1 + max((s["pass"] for s in slots.values()), default=-1)
    changed = [f"--seed {s['seed']}, now {seed}" for s in list(slots.values())[:1] if s.get("seed", seed) != seed]
    recorded = next((s["shards"] for s in saved if s.get("shards")), None) or (
        {"count": old.num_shards} if old.num_shards is not None else None)  # checkpoints before shard digests
    data_change = shard_set_change(recorded, shards)
    if data_change:
        if not allow_data_change:
            raise DataChanged(
                f"the file list names other shards than the checkpoint's data position was made for ({data_change}): "
                "resuming would read some records of the interrupted pass twice and others never. Restore the file "
                f"list, or pass --allow_data_change to end the interrupted pass there and start pass {next_pass} over "
                "the new shards")
        changed.append(f"the file list's shards changed: {data_change}")
    if changed:
        logger.warning("the data stream cannot resume the interrupted pass (%s); starting pass %d",
                       "; ".join(changed), next_pass)
        return {"num_workers": workers, "batches": 0, "slots": {}, "schedule": Schedule([], next_pass).to_json(),
                "holder": holder, "counts_before": {}}
    if len(saved) == world_size and old_workers == workers and all(
            s["num_slots"] == world_size * workers for s in slots.values()):
        return {"num_workers": workers, "batches": saved[rank]["batches"], "slots": saved[rank]["slots"],
                "schedule": schedule, "holder": holder, "counts_before": dict(counts_before) if holder else {}}
    plan = remainder(shards, seed, old, len(saved) * old_workers, slots)
    counts_before.update(counts_of(slots))
    units = sum(1 for segment in plan.plan for item in segment.extras if not isinstance(item, Picked))
    picked = sum(len(item.records) for segment in plan.plan for item in segment.extras if isinstance(item, Picked))
    logger.info(
        "data stream state saved by %d rank(s) x %d worker(s); this run's %d x %d read the rest first: pass(es) %s "
        "(%d partly read or skipped-over unit(s), %d buffered record(s), then the untouched units), then pass %d",
        len(saved), old_workers, world_size, workers, sorted({s.pass_index for s in plan.plan}) or "none", units,
        picked, plan.next_pass)
    return {"num_workers": workers, "batches": 0, "slots": {}, "schedule": plan.to_json(), "holder": holder,
            "counts_before": dict(counts_before) if holder else {}}


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
        allow_data_change: bool = False,
    ):
        super().__init__()
        self.allow_data_change = allow_data_change
        self.shards, self.tokenize, self.transform, self.latents = shards, tokenize, transform, latents
        self.metadata_filter = metadata_filter or None  # no filters: nothing checked
        self.batch_size, self.caption_dropout_prob, self.seed = batch_size, caption_dropout_prob, seed
        self.rank, self.world_size = rank, world_size
        self.workers = max(1, num_workers)
        self.shuffle_buffer = shuffle_buffer
        self.bucketed = transform is not None and transform.buckets is not None  # batches of several shapes
        self.kind: bool | None = None  # latent records? set by the first record this process reads
        self.text_kind: bool | None = None  # with cached text states? the same
        check_enough_records(shards, world_size * self.workers)
        self.board = ReadingBoard(self.workers)
        self.slot_states: dict[int, dict] = {}
        self.first_role = 0
        self.schedule = Schedule()
        self.resumes_exactly = False  # the loop's StreamState loads the state too (it always does now)
        if state:
            self.load_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A request of `rank_stream_state` (any saved layout: resolved here, the result left in it under
        "resolved"), or this rank's state of a run of this very layout."""
        if "saved" in state:
            state["resolved"] = resolve_stream_state(state, self.shards, self.seed, self.workers,
                                                     self.allow_data_change)
            state = state["resolved"]
        slots = {int(k): v for k, v in state["slots"].items()}
        if state["num_workers"] != self.workers or any(
                s["num_slots"] != self.world_size * self.workers for s in slots.values()):
            raise ValueError("a stream state of another rank/worker layout: pass every rank's states through "
                             "rank_stream_state")
        self.slot_states = slots
        self.schedule = Schedule.from_json(state.get("schedule"))
        self.first_role = state["batches"] % self.workers
        self.resumes_exactly = True

    def make_sample(self, record: Record, counts: Counter | None = None) -> tuple[np.ndarray, Any, np.ndarray | None]:
        """(uint8 HWC image crop, or float32 latent moments; token ids, or the record's cached text states, their mask,
        pooled vector and whether its caption was dropped; the crop's geometry, `ldm.models.conditioning.GEOMETRY`, or
        None for a latent record encoded without it): the record's kind is read from its content.
        `counts`: the stream's, which count a caption cut to the tokenizer's length (`truncated_captions`).

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
        _, caption, payload = record_parts(line, self.transform.parse, self.latents and self.latents.parse,
                                           self.metadata_filter)
        rng = sample_rng(self.seed, record.pass_index, record.seed_key, record.line_number, record.copy)
        dropped = rng.random() < self.caption_dropout_prob
        if dropped:
            caption = ""
        try:
            sample, geometry = transform.sample(payload, rng)
        except LatentMismatch as e:
            raise LatentMismatch(f"{record.shard}:{record.line_number}: {e}") from None
        cached = self.latents.text_states(payload) if latent and self.tokenize else None
        if self.tokenize and self.latents is not None and self.latents.cached_text:
            if self.text_kind is None:
                self.text_kind = cached is not None  # as `kind`: the first record's
            elif self.text_kind != (cached is not None):
                raise LatentMismatch(f"{record.shard}:{record.line_number} {'has' if cached is not None else 'lacks'} "
                                     "cached text states and the records before it did not: encode all of the corpus "
                                     "with --text_embeddings, or none of it")
        if cached is not None:  # cached text states: a dropped caption's are replaced by the empty caption's
            return sample, (*cached, dropped), geometry
        if not self.tokenize:
            return sample, None, geometry
        ids = self.tokenize(caption)
        if counts is not None and getattr(self.tokenize, "cut", 0):
            counts[TRUNCATED_CAPTIONS] += 1
        return sample, ids, geometry

    def slot_stream(self, role: int) -> SlotStream:
        slot = self.rank * self.workers + role
        return SlotStream(self.shards, slot, self.world_size * self.workers, self.seed, self.shuffle_buffer,
                          state=self.slot_states.get(slot), schedule=self.schedule)

    def __iter__(self):
        return run_slot(self.batches)

    def batches(self, worker: int):
        """This slot's batches: samples grouped by shape (one group without buckets), a group sent when it holds
        `batch_size`. What waits in partly filled groups is saved with each batch's state (`held`) and read again
        on restore; with buckets, the groups left at the end of a phase are sent as they are (short batches,
        counted as `short_batch_records`), so that a pass ends before the next begins."""
        stream = self.slot_stream((worker + self.first_role) % self.workers)
        where = f"slot {stream.slot} of {stream.num_slots}"
        stream.on_open = lambda path: self.board.post(worker, f"{where}: opening {path}")
        groups = ShapeGroups(self.batch_size)
        for record in stream.held_records():
            try:
                groups.restore((*self.make_sample(record), record))
            except SkipRecord as e:  # usable when it was taken: its shard or the run's settings changed since
                stream.counts["ok"] -= 1
                stream.count_skip(e.reason, f"{record.shard}:{record.line_number}", f"{e.detail} (it waited in a "
                                  "bucket at the checkpoint)")

        def batch(taken: list[Held]) -> dict:
            self.board.post(worker, f"{where}: {stream.reading()}")
            return self.make_batch(taken, stream.state_dict(held=groups.pointers()))

        # restored groups may be full now (buckets turned off or changed, a smaller batch): sent before reading on
        while (taken := groups.take_full()) is not None:
            yield batch(taken)
        # a held record was counted when first read: only the stream's own records count
        for sample in stream.samples(lambda r: (*self.make_sample(r, stream.counts), r), phase_ends=self.bucketed):
            if sample is PHASE_END:
                while (taken := groups.take_oldest()) is not None:
                    stream.counts["short_batch_records"] += len(taken)
                    yield batch(taken)
            elif (taken := groups.add(sample)) is not None:
                yield batch(taken)

    def make_batch(self, taken: list[Held], state: dict) -> dict:
        samples = [sample for sample, *_ in taken]
        batch = {"stream_state": json.dumps(state)}
        if self.kind:
            batch["latent_moments"] = np.stack(samples)
        else:
            batch["pixel_values"] = to_uint8_batch(samples)
        if self.tokenize:
            texts = [text for _, text, *_ in taken]
            cached = [isinstance(text, tuple) for text in texts]
            if all(cached):  # the fields of the model's conditioning record (`ldm.models.conditioning`)
                states, masks, pooled, dropped = zip(*texts, strict=True)
                batch["conditioning"] = {"states": np.stack(states), "dropped": np.array(dropped)}
                if masks[0] is not None:  # a masked encoder's
                    batch["conditioning"]["mask"] = np.stack(masks)
                if pooled[0] is not None:  # the pooled vectors a backbone reads (SD3's)
                    batch["conditioning"]["pooled"] = np.stack(pooled)
            elif any(cached):
                record = taken[cached.index(False)][-1]
                raise LatentMismatch(f"{record.shard}:{record.line_number} has no cached text states and other records "
                                     "of the corpus have: encode all of it with --text_embeddings, or none")
            else:
                batch["input_ids"] = np.stack(texts)
            # Every text-to-image batch carries its images' geometry, whichever model it trains: 24 bytes a sample, and
            # the data path then never asks which family reads it (a corpus serves any). Latent records encoded before
            # it was stored have none: their batches carry none, and a model that reads it refuses them at the first
            # record (`LatentTransform.reads_geometry`).
            geometry = [g for _, _, g, _ in taken]
            if all(g is not None for g in geometry):
                batch.setdefault("conditioning", {})["added"] = {GEOMETRY: np.stack(geometry)}
        if os.environ.get(CONSUMED_LOG):
            shape = batch_shape(batch, latent_scale=1)  # of latents: in latent units (the stream knows no autoencoder)
            batch["records"] = "".join(f"{r.pass_index} {r.copy} {r.shard} {r.line_number} {shape}\n"
                                       for *_, r in taken)
        return batch


Held = tuple[np.ndarray, Any, np.ndarray | None, Record]  # (sample, token ids, geometry, the record it was made of)


class ShapeGroups:
    """Samples taken from a slot's stream and not yet batched, grouped by shape (an aspect-ratio bucket)."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.groups: dict[tuple[int, ...], list[tuple[int, Held]]] = {}
        self.arrivals = 0

    def restore(self, held: Held) -> None:
        """Hold a sample, whatever its group's size (`take_full` then sends the full groups)."""
        self.groups.setdefault(held[0].shape, []).append((self.arrivals, held))
        self.arrivals += 1

    def add(self, held: Held) -> list[Held] | None:
        """Hold a sample; its group's samples when that makes `batch_size` of them."""
        self.restore(held)
        group = self.groups[held[0].shape]
        if len(group) < self.batch_size:
            return None
        del self.groups[held[0].shape]
        return [h for _, h in group]

    def take_full(self) -> list[Held] | None:
        """`batch_size` samples of the group holding at least that many whose oldest waited longest (None: no such
        group)."""
        full = [shape for shape, group in self.groups.items() if len(group) >= self.batch_size]
        if not full:
            return None
        shape = min(full, key=lambda s: self.groups[s][0][0])
        taken, self.groups[shape] = self.groups[shape][:self.batch_size], self.groups[shape][self.batch_size:]
        if not self.groups[shape]:
            del self.groups[shape]
        return [h for _, h in taken]

    def take_oldest(self) -> list[Held] | None:
        """The group holding the longest-waiting sample (None when nothing is held)."""
        if not self.groups:
            return None
        shape = min(self.groups, key=lambda s: self.groups[s][0][0])
        return [h for _, h in self.groups.pop(shape)]

    def pointers(self) -> list[tuple[int, int]]:
        """Where the held samples' records are in the stream (`Record.pointer`), in the order they arrived."""
        waiting = sorted((n, held[-1].pointer) for group in self.groups.values() for n, held in group)
        return [pointer for _, pointer in waiting]


class StreamState:
    """The training loop's record of the data stream: what it consumed, per slot."""

    def __init__(self, num_workers: int, shards: dict | None = None):
        self.num_workers = max(1, num_workers)
        self.shards = shards  # `filelist.shard_set` of the shards read: what the position is a position in
        self.taken = 0  # batches this process took (not saved: the consumed log's batch numbers)
        self.slots: dict[int, dict] = {}
        self.batches = 0
        self.schedule: dict | None = None  # the plan this run resumed with (ldm.data.resume), kept by one rank
        self.counts_before: Counter = Counter()  # records counted by the slots of runs of another layout

    def update(self, batch: dict) -> dict:
        """Record the batch's slot state; returns the batch without it."""
        batch = dict(batch)
        state = json.loads(batch.pop("stream_state"))
        self.slots[state["slot"]] = state
        self.batches += 1
        records = batch.pop("records", None)
        if records and os.environ.get(CONSUMED_LOG):
            suffix = f" {os.environ.get('PADDLE_TRAINER_ID', '0')} {self.taken}\n"
            path = os.environ[CONSUMED_LOG].replace("{restarts}", os.environ.get(RESTARTS_ENV, "0"))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                os.write(fd, records.replace("\n", suffix).encode())
            finally:
                os.close(fd)
        self.taken += 1
        return batch

    def counts(self) -> Counter:
        total: Counter = Counter(self.counts_before)
        total.update(counts_of(self.slots))
        return total

    def state_dict(self) -> dict[str, Any]:
        state = {"num_workers": self.num_workers, "batches": self.batches, "slots": dict(self.slots)}
        if self.shards:
            state["shards"] = self.shards
        if self.schedule:
            state["schedule"] = self.schedule
        if self.counts_before:
            state["counts_before"] = dict(self.counts_before)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's state, or a `rank_stream_state` request the stream has resolved."""
        state = state.get("resolved", state)
        if "saved" in state:
            raise ValueError("load the stream state into the CaptionImageStream first: it resolves the request")
        self.slots = {int(k): v for k, v in state["slots"].items()}
        self.batches = state["batches"]
        self.schedule = state.get("schedule") if state.get("holder", True) else None
        self.counts_before = Counter(state.get("counts_before", {}))


def build_dataloader(stream: CaptionImageStream, num_workers: int) -> DataLoader:
    check_loader_classes()  # `compat.stop_loader` will need Paddle's iterator internals
    return DataLoader(stream, batch_size=None, num_workers=num_workers, use_shared_memory=False,
                      timeout=READER_POLL_SECONDS)  # only the poll interval: no batch ever times out
