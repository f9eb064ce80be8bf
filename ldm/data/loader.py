"""Running a Paddle DataLoader over the stream: its workers started safely, watched for stalls, stopped on
every exit. Training (`ldm.train.batches`) and encoding (`ldm.prepare.encode`) both read through it."""

from __future__ import annotations

import gc
import logging
import threading

from ldm.data.watchdog import StallWatchdog, raise_if_error
from ldm.runtime.compat import stop_loader

logger = logging.getLogger("ldm.data")


def warn_if_loader_threads_run() -> None:
    """Workers forked while another loader's reader thread runs can inherit a lock that thread holds (a
    log handler's, stderr's) and hang on their first log line: seen in this project's test suite."""
    others = [t.name for t in threading.enumerate() if "_thread_loop" in t.name]
    if others:
        logger.warning("starting data loader workers while %d other loader thread(s) run (%s): a worker can hang "
                       "on a lock one of them holds; close the other loader first", len(others), ", ".join(others))


def start_workers(loader):
    """`iter(loader)`, which forks the loader workers, with every object of this process frozen out of the
    garbage collector meanwhile: a worker's collector then never destroys what it inherited.

    Seen in this project's suite: a worker hung at its first collection, inside `pthread_cond_destroy`
    of a Paddle object it had inherited as garbage. A condition variable that some thread of the parent
    was waiting on can never be destroyed in the child, where that thread does not exist (glibc waits
    for the waiters). `gc.freeze()` is what CPython offers for fork without exec.
    """
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


def watched(loader, data_timeout: float):
    """The loader's batches, its workers started here and stopped when the generator closes; a data-path
    exception is raised as itself, and a wait longer than `data_timeout` seconds ends the process with
    stacks and what each slot reads (`loader.dataset.board`, `ldm.data.watchdog`)."""
    if loader.num_workers:
        warn_if_loader_threads_run()
    iterator = start_workers(loader)
    watchdog = StallWatchdog(data_timeout, loader.dataset.board)  # its thread starts after the fork
    try:
        while True:
            watchdog.waiting()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                watchdog.received()
            raise_if_error(batch)
            yield batch
    finally:
        watchdog.close()
        stop_loader(iterator)
