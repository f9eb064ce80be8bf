"""A try's processes: Paddle's launcher run once with its output passed through, the ranks that outlive a launcher
that was killed (adopted by this process, Linux's child subreaper, and waited for, at most a grace before they are
killed), and the signals of a scheduler's stop, passed to the ranks themselves."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

from ldm.launch.diagnosis import resumed_from
from ldm.runtime.distributed import PR_SET_CHILD_SUBREAPER, prctl, terminate_with_parent
from ldm.runtime.heartbeat import read_try

# "Container rank 1 status failed cmd [...] code -9 log ...": how Paddle's launcher names the rank that failed
FAILED_CONTAINER = re.compile(r"Container rank (\d+) status failed .* code (-?\d+) ")


class Try:
    """One run of Paddle's launcher: its output passed through, the failed ranks it names, the first new update."""

    def __init__(self, command: list[str], env: dict, status: str, start_step: int):
        self.status, self.start_step = status, start_step
        self.failed: dict[int, int] = {}  # the rank within the node -> exit code, as the launcher names them
        self.first_update_at: float | None = None
        # a session of its own: a terminal's Ctrl-C reaches this process only, which passes it to the ranks
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, start_new_session=True,
                                        preexec_fn=terminate_with_parent)
        self.reader = threading.Thread(target=self._pass_through, daemon=True)
        self.reader.start()

    def _pass_through(self) -> None:
        for line in self.process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            match = FAILED_CONTAINER.search(line)
            if match:
                self.failed.setdefault(int(match.group(1)), int(match.group(2)))

    def wait(self) -> int:
        while True:
            try:
                code = self.process.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                self.watch_first_update()
        self.reader.join(timeout=10)
        self.watch_first_update()
        return code

    def watch_first_update(self) -> None:
        if self.first_update_at is not None:
            return
        reports = read_try(self.status)
        started = resumed_from(reports)
        start = started if started is not None else self.start_step
        if max((r["step"] for r in reports.values() if r["step"] is not None), default=-1) > start:
            self.first_update_at = time.time()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; none elsewhere)."""
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:  # after "pid (comm) state": the parent's pid
            found.append(int(name))
    return found


def reap() -> None:
    """Collect the exit status of every child that has ended (adopted ranks left as zombies otherwise)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Processes:
    """The job's processes: the try running, the ranks it leaves, and the signal that stops the job (`signalled`)."""

    def __init__(self, stop_grace: float):
        self.stop_grace = stop_grace
        self.current: Try | None = None
        self.signalled: int | None = None

    def adopt(self) -> None:
        """Pass a scheduler's stop on to the ranks, and adopt this process's orphaned descendants (Linux
        PR_SET_CHILD_SUBREAPER, where it can): the ranks of a launcher that was killed become children of this one,
        which can then wait for them."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        prctl(PR_SET_CHILD_SUBREAPER, 1)

    def run(self, command: list[str], env: dict, status: str, start_step: int, attempt: int) -> tuple[Try, int]:
        """The try and Paddle's launcher's exit code, once every process of the try has ended."""
        self.current = Try(command, env, status, start_step)
        if self.signalled is not None:  # a signal that came while the try was being started
            self._on_signal(self.signalled, None)
        code = self.current.wait()
        self.wait_for_ranks(attempt)
        self.current.watch_first_update()
        return self.current, code

    def wait_for_ranks(self, attempt: int) -> None:
        """Wait until every process of the try has ended (ranks outlive a launcher that was killed, and stop by
        saving the update they are in); after `--stop_grace` seconds, kill what is left."""
        deadline, said = time.monotonic() + self.stop_grace, False
        while True:
            reap()
            left = children(os.getpid())
            if not left:
                return
            if not said:
                print(f"ldm.launch: waiting for {len(left)} process(es) of try {attempt} to end (pids "
                      f"{' '.join(map(str, left))}; at most {self.stop_grace:g} s)", file=sys.stderr, flush=True)
                said = True
            if time.monotonic() > deadline:
                print(f"ldm.launch: killing {len(left)} process(es) of try {attempt} still running after "
                      f"{self.stop_grace:g} s", file=sys.stderr, flush=True)
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = math.inf
            time.sleep(0.2)

    def _on_signal(self, sig, frame) -> None:
        """A scheduler's stop, and no restart after it. The first goes to the ranks themselves: they agree to stop,
        save the update they are in and exit, and the launcher then ends; Paddle's launcher given a SIGTERM kills
        its ranks 30 s later, whatever they are writing. A second one goes to the launcher. Ranks this process
        adopted (their launcher gone) get it directly."""
        again, self.signalled = self.signalled is not None and frame is not None, sig
        process = self.current.process if self.current is not None else None
        if process is None:
            return
        if process.poll() is not None:
            targets = children(os.getpid())
        else:
            targets = ([] if again else children(process.pid)) or [process.pid]
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def pause(self, seconds: float) -> bool:
        """The pause before a restart; True when a signal ended it."""
        end = time.monotonic() + seconds
        while self.signalled is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.5, left))
        return self.signalled is not None
