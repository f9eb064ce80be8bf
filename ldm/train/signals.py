"""Stopping on SIGTERM or SIGINT without losing work: finish the update, save it, exit.

Cluster schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some time before they kill.
The first SIGTERM or SIGINT only sets a flag; every rank casts it once per optimizer update in the
update's one vote (`ldm.runtime.vote`; `requested()` alone where there is no such vote), all ranks
agree, save a checkpoint of that update and exit with
128 + the signal number (143 for SIGTERM), the shell's convention for "ended by a signal".

A rank that has not stopped `STOP_GRACE_SECONDS` after the first signal (stuck in a collective with
a dead peer, where Python signal handlers never run) prints its stacks and exits.

A second signal ends the process at once, without a checkpoint. Repeats within `REPEAT_SECONDS`
of the first count as the same request: `paddle.distributed.launch` passes a signal on to its
ranks' process groups and repeats SIGTERM up to three times, 0.2 s apart; Ctrl-C reaches the
launcher and the ranks together. The launcher kills ranks 30 s after its own SIGTERM, so a
checkpoint that takes longer than that is lost there; signal the training processes directly
(for example `scancel --signal=TERM --full`) to give them the scheduler's whole grace period.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time

logger = logging.getLogger("ldm.train")

REPEAT_SECONDS = 2.0
STOP_GRACE_SECONDS = 600
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """A context that turns SIGTERM/SIGINT into a stop request the loop acts on between updates."""

    def __init__(self, dist):
        self.dist = dist
        self.signum: int | None = None
        self.agreed = False  # every rank knows it stops after this update
        self._first = 0.0  # when the stop was requested, here or on another rank
        self._received: float | None = None  # when this process got its first signal
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers there only
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            # started here, not in the handler: a handler must not take locks the main thread may hold
            self._watcher = threading.Thread(target=self._watch, name="ldm-stop-deadline", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join()

    def _handle(self, signum, frame) -> None:
        # only flags here: logging or printing from a handler can re-enter a write the main thread is in
        now = time.monotonic()
        if self._received is None:  # this process's first signal (the request may have come from another rank)
            self._received = now
            if self.signum is None:
                self._first, self.signum = now, signum  # _first before signum: the watcher reads them unlocked
        elif now - self._received > REPEAT_SECONDS:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint\n".encode())
            os._exit(128 + signum)

    def _watch(self) -> None:
        while not self._closed.wait(1.0):
            if self.signum is not None and time.monotonic() - self._first > STOP_GRACE_SECONDS:
                self._expire()

    def _expire(self) -> None:
        os.write(2, f"\nnot stopped {STOP_GRACE_SECONDS} s after {self.name}: stacks follow, then exit\n".encode())
        faulthandler.dump_traceback(all_threads=True)
        os._exit(128 + (self.signum or signal.SIGTERM))

    def requested(self) -> bool:
        """Whether any rank was signalled; every rank calls this after the same update."""
        flag = self.signalled()
        if self.dist.world_size > 1:
            import paddle
            import paddle.distributed as pdist

            votes = paddle.to_tensor([int(flag)], dtype="int32")
            pdist.all_reduce(votes, op=pdist.ReduceOp.MAX)
            flag = bool(votes.item())
        return self.settle(flag)

    def signalled(self) -> bool:
        """This rank's own vote: whether it got a signal."""
        return self.signum is not None

    def settle(self, flag: bool) -> bool:
        """Act on the outcome of a vote that every rank took together (`requested`, or the update's one vote,
        `ldm.runtime.vote`, which carries this rank's `signalled`)."""
        if flag and self.signum is None:  # another rank was signalled: stop the same way, from now
            self._first, self.signum = time.monotonic(), signal.SIGTERM  # _first before signum: read unlocked
        self.agreed = self.agreed or flag
        return flag

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0

    def announce(self, step: int, checkpoint: str | None, save=None) -> None:
        """The stop's last line; `save` (`ldm.checkpoint.manager.PendingSave`): the stop save, timed from the signal's
        update to its seal."""
        took = f" in {save.seconds:.1f} s" if save is not None else ""
        logger.warning("%s: stopped after update %d and saved %s%s; continue with --resume_from_checkpoint latest",
                       self.name, step, checkpoint, took)
