"""Keeping the data path from failing silently: errors cross to the consumer, stalls end the run.

- `error_batch` / `raise_if_error`: an exception raised while a loader slot makes batches travels
  to the training loop as a batch and is raised there as the same exception type. Paddle's
  DataLoader loses it otherwise: with `num_workers=0` its reader thread dies and the consumer
  waits forever; with workers the exception is re-raised inside that thread, not in the loop.
- `ReadingBoard`: what each loader slot is reading (slot, shard, line, pid), in shared memory
  written by the workers, so that a stalled run can say where it stalled.
- `StallWatchdog`: when the consumer has waited `timeout` seconds for one batch, it prints what
  every slot is reading and the Python stacks of the training process and of the loader workers
  (faulthandler), then ends the process with `STALL_EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

from ldm.runtime.distributed import PR_SET_PDEATHSIG, prctl

DATA_ERROR = "data_error"
STALL_EXIT_CODE = 124  # as coreutils `timeout`
# faulthandler's own timer, armed while waiting, ends the process even when a C call holds the GIL
# and the watchdog thread cannot run; it fires this much later than the watchdog.
BACKSTOP_SECONDS = 60
STACK_SIGNAL = signal.SIGUSR1


def error_batch(error: BaseException) -> dict:
    """A batch that carries `error` (type, message, traceback) to the consumer."""
    import numpy as np

    kind = type(error)
    carried = {"type": f"{kind.__module__}:{kind.__qualname__}", "message": str(error),
               "traceback": traceback.format_exc()}
    # Paddle's DataLoader ends the iteration on a batch without any array: give it one
    return {DATA_ERROR: json.dumps(carried), "error_marker": np.zeros([1], np.uint8)}


def raise_if_error(batch: dict) -> None:
    """Raise the exception an `error_batch` carries, as its own type when that can be rebuilt."""
    if DATA_ERROR not in batch:
        return
    carried = json.loads(batch[DATA_ERROR])
    module, _, name = carried["type"].partition(":")
    try:
        kind = getattr(importlib.import_module(module), name)
        error = kind(carried["message"])
    except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from a message keeps its name in the text
        error = RuntimeError(f"{carried['type']}: {carried['message']}")
    error.add_note("raised in the data loader:\n" + carried["traceback"].rstrip())
    raise error


class ReadingBoard:
    """One fixed-size text entry and one pid per loader worker, in memory shared with the workers.

    Created before the DataLoader forks its workers, so every worker writes into the same memory;
    written once per opened shard and once per batch, so it costs nothing measurable.
    """

    ENTRY = 400

    def __init__(self, workers: int):
        self.workers = workers
        self.text = multiprocessing.RawArray(ctypes.c_char, self.ENTRY * workers)
        self.pids = multiprocessing.RawArray(ctypes.c_int, workers)

    def post(self, worker: int, message: str) -> None:
        data = message.encode("utf-8", "replace")[: self.ENTRY - 1]
        self.text[worker * self.ENTRY:(worker + 1) * self.ENTRY] = data.ljust(self.ENTRY, b"\0")
        self.pids[worker] = os.getpid()

    def entries(self) -> list[str]:
        raw = bytes(self.text)
        return [raw[w * self.ENTRY:(w + 1) * self.ENTRY].split(b"\0", 1)[0].decode("utf-8", "replace") or
                f"worker {w}: not started" for w in range(self.workers)]

    def worker_pids(self) -> list[int]:
        return sorted({pid for pid in self.pids if pid and pid != os.getpid()})


def in_worker_process() -> None:
    """Set-up of a forked loader worker: the training process decides when it ends.

    SIGINT (Ctrl-C reaches the whole process group) and SIGTERM (the launcher signals process groups)
    are ignored, so a graceful stop of the training process can still read the batch it waits for;
    the worker ends when the loader closes or its parent dies. `STACK_SIGNAL` prints its stacks.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    die_with_parent()


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the training process dies, even in the middle of a hung
    read (Paddle's own parent check runs only between batches, so a stuck worker outlived a killed run)."""
    if not sys.platform.startswith("linux"):
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the request took effect
        os._exit(1)


class StallWatchdog:
    """Ends the process when one wait for a batch lasts longer than `timeout` seconds (0: off)."""

    def __init__(self, timeout: float, board: ReadingBoard | None = None):
        self.timeout, self.board = timeout, board
        self._since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def waiting(self) -> None:
        if not self.timeout:
            return
        if self._thread is None:  # started after the loader forked its workers
            self._thread = threading.Thread(target=self._watch, name="ldm-data-watchdog", daemon=True)
            self._thread.start()
        self._since = time.monotonic()
        faulthandler.dump_traceback_later(self.timeout + BACKSTOP_SECONDS, exit=True)

    def received(self) -> None:
        if self.timeout:
            self._since = None
            faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        self.received()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._stop.wait(poll):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                self._fire()

    def _fire(self) -> None:
        where = self.board.entries() if self.board else []
        pids = self.board.worker_pids() if self.board else []
        lines = [f"error: no data batch for {self.timeout:g} s (--data_timeout); the loader slots are reading:"]
        lines += [f"  {entry}" for entry in where]
        lines.append("Python stacks of the training process, then of each loader worker, follow.")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        for pid in pids:
            _signal(pid, STACK_SIGNAL)
            time.sleep(0.5)  # one worker's stacks at a time: they share the terminal
        time.sleep(0.5)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        sys.stderr.write(f"error: stopped after a data stall of {self.timeout:g} s (exit {STALL_EXIT_CODE})\n")
        sys.stderr.flush()
        os._exit(STALL_EXIT_CODE)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
