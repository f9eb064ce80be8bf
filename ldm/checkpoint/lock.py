"""One run per output folder: a lock held by rank 0 for the life of the run.

A scheduler that starts a job twice, or a user who repeats a command in another terminal, would otherwise have
two runs write the same checkpoints (or one empty the folder under the other). The lock is the file
`<output_dir>/.run.lock`, created exclusively (`O_CREAT | O_EXCL`, atomic on local filesystems and NFS alike),
holding who owns it: host, pid, the pid's start time, and when the lease was last renewed. A thread renews
the lease every `RENEW_SECONDS`.

A lock is taken over, with a warning, when its holder is gone:
- on this host, when the pid is not running (or is another process that reused the pid: its start time differs);
- on another host, when the lease was not renewed for `LEASE_SECONDS` (flock does not reach across hosts on
  many shared filesystems; the lease does, given clocks kept within a minute of each other by NTP).
A process never holds two runs at once, so a lock of this very process (an earlier run in the same Python
process that ended by an exception before releasing it) is taken back too.

Taking over is read, judge, remove, create: two starters doing it at once could each remove the other's fresh
lock and both go on. So a takeover runs under `flock` on the folder itself (released by the kernel when its holder
dies, so it never goes stale; where a filesystem refuses `flock` on a folder, on the file `.run.lock.takeover`):
the second starter waits, then finds the first one's lock alive and is refused.

Hand-written rather than `filelock`: that package has no notion of a holder that died on another host, and its
soft locks do not record who holds them.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import math
import os
import socket
import threading
import time

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.train")

LOCK_NAME = ".run.lock"
RENEW_SECONDS = 30.0
LEASE_SECONDS = 120.0
TAKEOVER_SECONDS = 30.0


class LockError(UserError, RuntimeError):
    """The output folder's lock cannot be taken (the message says why and what to do)."""


class FolderInUse(LockError):
    """Another live run holds the output folder."""


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None where it cannot be read; a
    zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _alive(pid: int, started: str | None) -> bool:
    if os.path.isdir("/proc"):
        now = _start_time(pid)
        return now is not None and (started is None or now == started)
    try:  # no /proc (macOS): a signal 0 tells whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_time(holder: dict) -> float | None:
    """When the holder last renewed its lease (its host's clock), or None when the lock holds no usable time."""
    renewed = holder.get("renewed")
    if isinstance(renewed, bool) or not isinstance(renewed, int | float) or not math.isfinite(renewed) or renewed <= 0:
        return None
    return float(renewed)


def describe(holder: dict) -> str:
    renewed = lease_time(holder)
    if renewed is None:
        lease = f", no usable lease time ({holder.get('renewed')!r})" if "renewed" in holder else ""
    elif renewed > time.time() + 1:
        lease = (f", lease renewed {renewed - time.time():.0f} s ahead of this host's clock (the clock of "
                 f"{holder.get('host', '?')} runs ahead)")
    else:
        lease = f", lease renewed {time.time() - renewed:.0f} s ago"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}{lease}"


class RunLock:
    """The lock of one output folder. `acquire()` creates the folder if needed (and `release()` removes it again
    when it is left empty, so a refused start leaves nothing behind)."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.made_folder = False
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: dict = {}

    def acquire(self) -> None:
        """Take the lock, or raise LockError saying why not (FolderInUse: naming its holder)."""
        if self.held:
            return
        pid = os.getpid()
        self._record = {"host": socket.gethostname(), "pid": pid, "pid_started": _start_time(pid),
                        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "renewed": time.time()}
        try:
            if not os.path.isdir(self.output_dir):
                os.makedirs(self.output_dir, exist_ok=True)
                self.made_folder = True
            if os.path.isdir(self.path):
                raise LockError(f"output_dir {self.output_dir}: {LOCK_NAME} is a folder, not a lock this project "
                                "wrote: remove it, then start again")
            if not self._create():
                with self._takeover_guard():
                    self._take_over()
        except OSError as e:  # a read-only or full filesystem, a folder without write permission
            self._undo_folder()
            raise LockError(f"output_dir {self.output_dir} cannot be written ({e.strerror or e}): make it writable "
                            "or choose another --output_dir") from None
        except LockError:
            self._undo_folder()
            raise
        self.held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="run-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def release(self) -> None:
        """Give the lock up (idempotent); the folder goes too when this lock made it and nothing else is in it."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._read().get("pid") == os.getpid():  # never remove a lock another run took over
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self._undo_folder()
        atexit.unregister(self.release)

    # -- internals ----------------------------------------------------------------------------------
    def _take_over(self) -> None:
        """Under the takeover guard: the lock is taken over when its holder is gone, else FolderInUse."""
        for _ in range(3):  # a holder that releases meanwhile: its lock is gone, the create wins
            holder = self._read()
            problem = self._stale(holder)
            if problem is None:
                self._undo_folder()
                elsewhere = holder.get("host") not in (None, socket.gethostname())
                way_out = (f"; if no run on {holder.get('host')} uses this folder any more, remove {self.path} and "
                           "start again" if elsewhere else "")
                raise FolderInUse(f"output_dir {self.output_dir} is in use by another run ({describe(holder)}): "
                                  f"wait for it to end, stop it, or choose another --output_dir{way_out}")
            if problem != "removed meanwhile":
                logger.warning("%s: taking over the lock of a run that is gone (%s; %s)", self.output_dir, problem,
                               describe(holder))
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            if self._create():
                return
        self._undo_folder()
        raise FolderInUse(f"output_dir {self.output_dir}: could not take {LOCK_NAME} (other starts are taking it "
                          "at the same moment)")

    @contextlib.contextmanager
    def _takeover_guard(self):
        """One takeover at a time in this folder: an exclusive `flock`, tried for up to TAKEOVER_SECONDS (a takeover
        holds it for milliseconds; something else holding a lock on the folder must not hang the start)."""
        fd = None
        for path, flags in ((self.output_dir, os.O_RDONLY), (self.path + ".takeover", os.O_RDWR | os.O_CREAT)):
            try:
                fd = os.open(path, flags, 0o644)
            except OSError:
                continue
            deadline = time.monotonic() + TAKEOVER_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        os.close(fd)
                        raise FolderInUse(f"output_dir {self.output_dir}: another start has been taking over its "
                                          f"stale {LOCK_NAME} for {TAKEOVER_SECONDS:.0f} s (or something else locks "
                                          "the folder): try again") from None
                    time.sleep(0.05)
                except OSError:  # NFS locks a folder opened read-only for nobody: the file next
                    os.close(fd)
                    fd = None
                    break
            if fd is not None:
                break
        if fd is None:
            logger.warning("%s: no file lock can be taken here (the filesystem refuses flock): two starters taking "
                           "over a stale lock at the same instant are not told apart", self.output_dir)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self._record, f)
        except BaseException:  # a full disk: no empty lock left to block the retry
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise
        return True

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict) -> str | None:
        """Why the lock's holder is gone, or None when it may still be running."""
        if not holder:
            try:  # unreadable: a holder killed while writing it, or one writing it right now
                age = time.time() - os.path.getmtime(self.path)
            except FileNotFoundError:
                return "removed meanwhile"
            return "an unreadable lock file" if age > 5 else None
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int):
            if pid == os.getpid():
                return "left by an earlier run of this process"
            return None if _alive(pid, holder.get("pid_started")) else "its process is not running"
        renewed = lease_time(holder)  # a time it cannot be judged by holds: the message says how to remove it
        if renewed is not None and time.time() - renewed > LEASE_SECONDS:
            return f"its lease was not renewed for {LEASE_SECONDS:.0f} s"
        return None

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            self._record["renewed"] = time.time()
            partial = f"{self.path}.{os.getpid()}.partial"
            try:
                with open(partial, "w") as f:
                    json.dump(self._record, f)
                os.replace(partial, self.path)
            except OSError as e:  # a full disk or a removed folder: the run finds out at its next save
                logger.warning("could not renew %s: %s", self.path, e)

    def _undo_folder(self) -> None:
        if self.made_folder:
            try:
                os.rmdir(self.output_dir)  # only when empty
                self.made_folder = False
            except OSError:
                pass
