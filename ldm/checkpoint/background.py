"""Checkpoint files written beside training: a snapshot into host buffers, then a writer thread.

A save stops the update loop only for the snapshot: every array a rank writes is copied into a host buffer
allocated at the first save and reused at every later one (a CPU tensor is read through DLPack, without a
copy of its own: one memory copy per array; a GPU tensor is copied to the host by `Tensor.numpy()`, then into its
buffer: reused pinned memory would save that second copy, untried without a GPU). The files are then
written, hashed while written (`ldm.checkpoint.serialization.write_safetensors`) and flushed by one thread.

Why a thread, measured on a 2-core CPU (`scripts/bench_checkpoint.py`): file writes, fsync and sha256 release
the GIL, so the thread costs the training thread only CPU time, not the interpreter. A forked writer would have
copy-on-write snapshot for free on a CPU, but the fork copies the page tables of a process holding tens of GB,
a child of a process with Paddle's, the loader's and the collectives' threads may inherit a lock held by one
of them, and it cannot see a GPU's memory; Paddle's and PaddleNLP's own asynchronous saves pickle the state to
a spawned process, which blocked the caller 5-11 s per GiB here.

Each rank's writer reports what it wrote in a receipt, `.written-<rank>-of-<world>.json` in the checkpoint's
temporary folder, once every file is on disk: the rank that seals the checkpoint builds the manifest from the
receipts (no file is read back) and removes them. A rank that never finished leaves no receipt, so the seal
refuses; a folder without a manifest is never a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ldm.checkpoint.serialization import LiveTensor, Written, is_tensor, on_host, write_bytes, write_safetensors

RECEIPT_PREFIX = ".written-"
logger = logging.getLogger("ldm.train")


class HostBuffers:
    """Host arrays kept from save to save, one per array a rank writes (named by file and key). `copy=False`: the
    arrays are taken as they are (a save written before training goes on needs no snapshot, nor its memory).

    Fresh host memory is slow to fill the first time (each page faults in: 0.34 GB/s against 2.6 GB/s into memory
    touched before, measured here), so the first save would stall several times longer than the later ones.
    `reserve(nbytes)` allocates and touches a pool of that size on a thread at the start of the run; the buffers are
    carved out of it (64-byte aligned) until it is used up, then allocated as before."""

    ALIGN = 64

    def __init__(self, copy: bool = True):
        self.copy = copy
        self._arrays: dict[tuple[str, str], np.ndarray] = {}
        self._pool: np.ndarray | None = None
        self._used = 0
        self._filling: threading.Thread | None = None

    def reserve(self, nbytes: int) -> None:
        """Fill a pool of `nbytes` in the background (see the class)."""
        if not self.copy or nbytes <= 0:
            return

        def fill() -> None:
            try:
                pool = np.empty(nbytes, np.uint8)
                pool[::4096] = 0  # one write a page: every page is faulted in now, not during the first snapshot
            except MemoryError:  # the snapshot allocates as it goes, as without a reservation
                logger.warning("could not reserve %.2f GiB of host memory for the checkpoint snapshot: the first "
                               "save allocates it", nbytes / 2**30)
                return
            self._pool = pool

        self._filling = threading.Thread(target=fill, name="checkpoint-host-buffers", daemon=True)
        self._filling.start()

    @property
    def reserved(self) -> int:
        if self._filling is not None:
            self._filling.join()
        return 0 if self._pool is None else self._pool.nbytes

    def _new(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.reserved and not dtype.hasobject:
            base = self._pool.ctypes.data  # aligned in memory, not only within the pool
            start = -(-(base + self._used) // self.ALIGN) * self.ALIGN - base
            if start + size <= self._pool.nbytes:
                self._used = start + size
                return self._pool[start:start + size].view(dtype).reshape(shape)
        return np.empty(shape, dtype)

    def taker(self, file: str, dtype: str | None = None) -> Callable[[str, Any], np.ndarray | LiveTensor]:
        """`take(key, value)` for `flatten` (`value` numpy or Paddle): copied into the buffer of (`file`, `key`) (cast
        to `dtype` when given: a buffer of its own); without `copy`, a Paddle tensor is kept as it is (`LiveTensor`:
        brought to the host one at a time as it is written)."""
        label = f"{file}@{dtype}" if dtype else file

        def take(key: str, value) -> np.ndarray | LiveTensor:
            if not self.copy:
                if is_tensor(value):
                    return LiveTensor(value, dtype)
                return np.ascontiguousarray(value, dtype=dtype)
            array = on_host(value)
            buffer = self._arrays.get((label, key))
            if buffer is None or buffer.shape != array.shape or buffer.dtype != (dtype or array.dtype):
                buffer = self._arrays[(label, key)] = self._new(array.shape, dtype or array.dtype)
            np.copyto(buffer, array, casting="same_kind")
            return buffer
        return take

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


@dataclass
class FileJob:
    """One file of a checkpoint to write: arrays (safetensors) or bytes, at `path` relative to the folder."""

    path: str
    arrays: dict[str, np.ndarray | LiveTensor] | None = None
    metadata: dict[str, str] | None = None
    data: bytes | None = None

    def write(self, folder: str) -> Written:
        path = os.path.join(folder, self.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.data is not None:
            return write_bytes(path, self.data)
        return write_safetensors(path, self.arrays or {}, self.metadata)


def receipt_name(rank: int, world_size: int) -> str:
    return f"{RECEIPT_PREFIX}{rank + 1:05d}-of-{world_size:05d}.json"


def write_files(folder: str, jobs: list[FileJob], rank: int, world_size: int) -> dict[str, dict]:
    """Write `jobs` into `folder`, then this rank's receipt (their manifest entries), last and flushed."""
    entries = {job.path: job.write(folder).entry() for job in jobs}
    write_bytes(os.path.join(folder, receipt_name(rank, world_size)), json.dumps(entries).encode())
    return entries


def read_receipts(folder: str, world_size: int) -> dict[str, dict]:
    """Every rank's receipt, merged, then removed; an error naming the ranks whose receipt is missing."""
    entries, missing = {}, []
    for rank in range(world_size):
        path = os.path.join(folder, receipt_name(rank, world_size))
        try:
            with open(path) as f:
                entries.update(json.load(f))
        except FileNotFoundError:
            missing.append(rank)
        except ValueError as e:
            raise OSError(f"the receipt of rank {rank} is damaged ({e})") from None
    if missing:
        raise OSError(f"rank(s) {', '.join(map(str, missing))} did not finish writing their files")
    for rank in range(world_size):
        os.remove(os.path.join(folder, receipt_name(rank, world_size)))
    return entries


@dataclass
class Task:
    """What a writer thread did: its error, if it failed."""

    name: str
    error: BaseException | None = None


class BackgroundWriter:
    """One task at a time on a thread of its own (not a daemon: the interpreter waits for it at exit, so a
    process that ends by an exception still finishes the file it was writing)."""

    def __init__(self):
        self.task: Task | None = None
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, name: str, fn: Callable[[], object]) -> Task:
        """Run `fn` in the background; the previous task must have ended (`wait`)."""
        if self.busy:
            raise RuntimeError(f"{self.task.name} is still running")
        task = self.task = Task(name)

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
                task.error = e

        self._thread = threading.Thread(target=run, name=f"ldm-{name}")
        self._thread.start()
        return task

    def wait(self) -> Task | None:
        """The last task, once it has ended (None if there was none)."""
        if self._thread is not None:
            self._thread.join()
        return self.task
