"""Paddle's launcher, run again from the newest sealed checkpoint when a rank dies: a job that heals itself.

    python -m ldm.launch --max_restarts 3 [--restart_pause 10] [paddle.distributed.launch's flags] SCRIPT [flags]

It runs `python -m paddle.distributed.launch [its flags] SCRIPT [flags]` (never a copy of its job: rendezvous,
ranks, logs and the stop of every rank when one fails stay Paddle's) and reads how each rank ended from the
reports the ranks leave in `<log_dir>/ldm-launch/try-<n>/` (`ldm.runtime.supervisor`). Paddle's own
`--max_restart` restarts ranks only in its elastic mode, which needs an etcd server (given `--master etcd://...`,
it is used as it is); in collective mode its launcher exits at the first rank that dies.

- The run ended (every rank 0), or stopped on purpose: a user error or the non-finite guard (exit 2), a stop every
  rank agreed on after SIGTERM/SIGINT (128 + the signal), or this process was signalled (a scheduler's stop: the
  signal goes to the ranks, which save the update they are in and exit; the launcher runs in a session of its
  own, so a terminal's Ctrl-C takes the same way): not restarted, its exit code is this one's.
- Anything else (a rank killed: out of memory, a segfault, a lost peer; an exception; a data stall the watchdog
  ended, 124) is a failure: after a pause that doubles each time (`--restart_pause`, at most 5 minutes) the same
  command runs again with `--resume_from_checkpoint auto`, up to `--max_restarts` times.
- A failure at the same update and of the same cause as the one before (a crash loop: a record that kills a
  decoder, a kernel that always faults there, the out-of-memory killer) stops after the second time, in one line
  naming the update and the cause.

Before it reads how a try ended, every process of that try is gone: the ranks run in sessions of their own and
outlive a launcher that was killed (they stop, saving the update they are in), so this process adopts them
(Linux's child subreaper) and waits for them, at most `--stop_grace` seconds before it kills what is left. Only
then is the next try started: it never meets the run lock of the try before it. One job per `--log_dir`: a second
job given the same folder is refused before it writes anything there.

Exit codes: 0 the run ended; 2 stopped on purpose (a user error, the non-finite guard); 3 the restarts given were
spent; 4 a crash loop; 128 + N stopped by signal N (a stop asked for, the update saved); any other code is
Paddle's launcher's, when no rank's report explains it.

Each restart goes into the run's `run.json` as `restarts`: the update, the rank, its exit code and the cause, the
checkpoint resumed and the updates lost, the seconds from that checkpoint's save to the failure and from the
failure to the restarted job's first update, and their sum, `seconds_lost`; the checkpoint is the one the restarted
ranks report they resumed (a damaged newer one is set aside by them). The ranks log the count as the metric
`restarts`; trackers continue the same run, as after any resume. A job its scheduler requeues continues the list.
On several nodes each node runs its own `ldm.launch` (the same command with its `--rank`); the one whose ranks
include rank 0 writes `run.json`. Paddle's launcher names a failed rank by its place in the node; the ranks'
heartbeats give the global rank.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

from ldm.runtime.distributed import PR_SET_CHILD_SUBREAPER, prctl, terminate_with_parent
from ldm.runtime.errors import UserError
from ldm.runtime.home import writable_caches
from ldm.runtime.supervisor import PEER_LOST, RESTARTS_ENV, STATUS_ENV, read_try

MAX_PAUSE_SECONDS = 300
STOPPED_ON_PURPOSE = 2  # a user error, the non-finite guard (`ldm.runtime.errors`)
GAVE_UP = 3  # the restarts given were spent
CRASH_LOOP = 4  # the same failure twice in a row
# "Container rank 1 status failed cmd [...] code -9 log ...": how Paddle's launcher names the rank that failed
FAILED_CONTAINER = re.compile(r"Container rank (\d+) status failed .* code (-?\d+) ")


# Paddle's launcher where HOME cannot hold Paddle's cache: `import paddle` would fail in it (`ldm.runtime.home`)
PADDLE_LAUNCHER_ASIDE = ("import runpy; from ldm.runtime.home import writable_caches; writable_caches(); "
                         "runpy.run_module('paddle.distributed.launch', run_name='__main__', alter_sys=True)")


class LaunchError(Exception):
    """A command `ldm.launch` cannot run: one line, exit 2."""


def split_command(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(the launcher's flags, SCRIPT, SCRIPT's flags): SCRIPT is the first argument that names a .py file."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not arg.startswith("-"):
            return argv[:i], arg, argv[i + 1:]
    if "-h" in argv or "--help" in argv:
        return argv, "", []
    raise LaunchError("no training script: name it after the launcher's flags, as for paddle.distributed.launch "
                      "(python -m ldm.launch --max_restarts 3 --nproc_per_node 8 train_txt2img_laion400m_no_trainer.py "
                      "--output_dir ...)")


def flag_value(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `--name V` or `--name=V` (the last one given), as argparse reads it."""
    value = default
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def with_flag(args: list[str], name: str, value: str) -> list[str]:
    """`args` with `--name value` in place of every `--name V` or `--name=V` given."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == name:
            skip = i + 1 < len(args)
        elif not arg.startswith(name + "="):
            out.append(arg)
    return [*out, name, value]


def signal_name(code: int) -> str:
    number = -code if code < 0 else code - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "ended without a report (killed, or its node lost)"
    if code == 143:
        return "stopped by SIGTERM"
    if code < 0 or 128 < code < 160:
        return f"killed by {signal_name(code)}"
    if code == 124:
        return "stopped by the data watchdog (no batch for --data_timeout seconds)"
    return f"exit {code}"


def own_update(report: dict) -> int | None:
    """The update a rank was in when it ended: the one after the last it finished (None: before its first)."""
    return report["step"] + 1 if report.get("step") is not None else None


def who(failure: dict) -> str:
    return f"rank {failure['rank']}" if failure["rank"] is not None else "a rank"


def where(failure: dict) -> str:
    return f"update {failure['update']}" if failure["update"] is not None else "its start"


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
                self._watch_first_update()
        self.reader.join(timeout=10)
        self._watch_first_update()
        return code

    def _watch_first_update(self) -> None:
        if self.first_update_at is not None:
            return
        reports = read_try(self.status)
        started = self.resumed_from(reports)
        start = started if started is not None else self.start_step
        if max((r["step"] for r in reports.values() if r["step"] is not None), default=-1) > start:
            self.first_update_at = time.time()

    @staticmethod
    def resumed_from(reports: dict[int, dict]) -> int | None:
        """The update the try's ranks started at, as they report it (rank 0's, else the lowest one's)."""
        started = {rank: r["started"] for rank, r in reports.items() if r["started"] is not None}
        return started.get(0, min(started.values(), default=None))

    def global_rank(self, local: int, reports: dict[int, dict]) -> int | None:
        """The global rank of the node's `local`-th rank, from the ranks' own heartbeats."""
        return next((rank for rank, r in reports.items() if r["local_rank"] == local), None)


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


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux PR_SET_CHILD_SUBREAPER): the ranks of a launcher that was
    killed become children of this one, which can then wait for them. False where it cannot."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def reap() -> None:
    """Collect the exit status of every child that has ended (adopted ranks left as zombies otherwise)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def newest_checkpoint_step(output_dir: str | None) -> tuple[int | None, float | None]:
    """(step, time sealed) of the newest complete checkpoint of the run folder, as `auto` would resume it."""
    if not output_dir or not os.path.isdir(output_dir):
        return None, None
    from ldm.checkpoint.run_folder import checkpoint_dirs, checkpoint_problem, checkpoint_step

    for folder in reversed(checkpoint_dirs(output_dir)):  # the run verifies the checksums; a look is enough here
        if checkpoint_problem(folder, checksums=False) is None:
            return checkpoint_step(folder), os.path.getmtime(folder)
    return None, None


def checkpoint_sealed_at(output_dir: str | None, step: int | None) -> float | None:
    """When checkpoint-`step` of the run folder was sealed (its folder's time), or None."""
    if not output_dir or step is None:
        return None
    try:
        return os.path.getmtime(os.path.join(output_dir, f"checkpoint-{step}"))
    except OSError:
        return None


def lock_log_dir(log_dir: str):
    """An open file holding an exclusive lock on `<log_dir>/ldm-launch.lock` for this job's life (the kernel drops
    it when the job dies, so it never goes stale); LaunchError when another live job holds it. Taken before Paddle's
    launcher truncates `workerlog.N` and before any report folder is emptied: a second job given the same folder
    must not touch the first one's files."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "ldm-launch.lock")
    handle = open(path, "a+")  # noqa: SIM115 (held open on purpose: the lock lives as long as the file is open)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise LaunchError(f"--log_dir {log_dir} is in use by another job ({holder}): give each job a --log_dir of "
                          "its own (the SLURM script names it after the job and its requeue)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    return handle


def run_record(output_dir: str | None) -> dict | None:
    """The run folder's `run.json`, or None."""
    try:
        with open(os.path.join(output_dir or "", "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Supervisor:
    def __init__(self, args, launcher_flags: list[str], script: str, script_args: list[str]):
        self.args, self.launcher_flags, self.script, self.script_args = args, launcher_flags, script, script_args
        self.output_dir = flag_value(script_args, "--output_dir")
        # as Paddle's launcher reads them: its flag, else its environment variable
        self.log_dir = flag_value(launcher_flags, "--log_dir", os.environ.get("PADDLE_LOG_DIR", "log"))
        nnodes = flag_value(launcher_flags, "--nnodes", os.environ.get("PADDLE_NNODES", "1"))
        ips = flag_value(launcher_flags, "--ips", os.environ.get("PADDLE_IPS", ""))
        self.several_nodes = nnodes.split(":")[-1] not in ("", "1") or "," in ips  # N, or MIN:MAX (elastic)
        # a job requeued by its scheduler continues the list of the run's restarts (of that run: `created`)
        record = run_record(self.output_dir) or {}
        self.earlier, self.created = record.get("restarts", []), record.get("created")
        self.restarts: list[dict] = []
        self.signalled: int | None = None
        self.current: Try | None = None
        # where HOME cannot hold the caches, the ranks inherit PaddleNLP's and the kernels' (and move Paddle's)
        self.caches = writable_caches(import_now=False)

    def command(self, attempt: int) -> list[str]:
        script_args = self.script_args if attempt == 0 else \
            with_flag(self.script_args, "--resume_from_checkpoint", "auto")
        launcher = ["-m", "paddle.distributed.launch"] if self.caches is None else ["-c", PADDLE_LAUNCHER_ASIDE]
        return [sys.executable, *launcher, *self.launcher_flags, self.script, *script_args]

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        become_subreaper()
        attempt = 0
        while True:
            code, reports = self.try_once(attempt)
            verdict = self.verdict(code, reports)
            if verdict is not None:
                self.record()
                return verdict
            failure = self.failure(code, reports)
            given_up, exit_code = self.give_up(failure)
            if given_up:
                self.record()
                print(f"error: ldm.launch: {given_up}", file=sys.stderr)
                return exit_code
            pause = min(self.args.restart_pause * 2 ** len(self.restarts), MAX_PAUSE_SECONDS)
            self.restarts.append(self.restart_entry(failure))
            self.record()
            print(f"ldm.launch: {who(failure)} failed at {where(failure)} ({failure['cause']}); "
                  f"restart {len(self.restarts)} of {self.args.max_restarts} in {pause:g} s, from the newest "
                  "complete checkpoint", file=sys.stderr, flush=True)
            if self._sleep(pause):
                print(f"ldm.launch: restart {len(self.restarts)} cancelled by {signal.Signals(self.signalled).name}",
                      file=sys.stderr, flush=True)
                return 128 + self.signalled
            attempt += 1

    def try_once(self, attempt: int) -> tuple[int, dict[int, dict]]:
        """Paddle's launcher run once: its exit code and the ranks' reports, read once every process of the try
        has ended."""
        status = os.path.abspath(os.path.join(self.log_dir, "ldm-launch", f"try-{attempt}"))
        os.makedirs(status, exist_ok=True)
        for name in os.listdir(status):  # a folder of an earlier job's try (this job holds the log folder's lock)
            os.remove(os.path.join(status, name))
        restarts = len(self.earlier_of(run_record(self.output_dir))) + len(self.restarts)
        env = {**os.environ, STATUS_ENV: status, RESTARTS_ENV: str(restarts)}
        start = (self.restarts[-1]["resumed_from"] or 0) if self.restarts else 0
        self.current = Try(self.command(attempt), env, status, start)
        if self.signalled is not None:  # a signal that came while the try was being started
            self._on_signal(self.signalled, None)
        code = self.current.wait()
        self.wait_for_ranks(attempt)
        self.current._watch_first_update()
        reports = read_try(status)
        if self.restarts:
            self.resumed(self.restarts[-1], reports)
        return code, reports

    def wait_for_ranks(self, attempt: int) -> None:
        """Wait until every process of the try has ended (ranks outlive a launcher that was killed, and stop by
        saving the update they are in); after `--stop_grace` seconds, kill what is left."""
        deadline, said = time.monotonic() + self.args.stop_grace, False
        while True:
            reap()
            left = children(os.getpid())
            if not left:
                return
            if not said:
                print(f"ldm.launch: waiting for {len(left)} process(es) of try {attempt} to end (pids "
                      f"{' '.join(map(str, left))}; at most {self.args.stop_grace:g} s)", file=sys.stderr, flush=True)
                said = True
            if time.monotonic() > deadline:
                print(f"ldm.launch: killing {len(left)} process(es) of try {attempt} still running after "
                      f"{self.args.stop_grace:g} s", file=sys.stderr, flush=True)
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = math.inf
            time.sleep(0.2)

    def resumed(self, entry: dict, reports: dict[int, dict]) -> None:
        """The restart's checkpoint as the restarted ranks report it, and what follows from it."""
        started = Try.resumed_from(reports)
        if started is None:
            return
        resumed = started or None  # 0: from the start
        entry["resumed_from"] = resumed
        entry["updates_lost"] = None if entry["update"] is None else entry["update"] - 1 - (resumed or 0)
        sealed_at = checkpoint_sealed_at(self.output_dir, resumed)
        entry["seconds_since_checkpoint"] = round(entry["failed_at"] - sealed_at, 1) if sealed_at else None
        if self.current.first_update_at is not None:
            entry["seconds_to_next_update"] = round(self.current.first_update_at - entry["failed_at"], 1)
            # the updates since the checkpoint are done again, in about the time they took
            entry["seconds_lost"] = round(entry["seconds_to_next_update"] + (entry["seconds_since_checkpoint"] or 0),
                                          1)
        if not entry.get("said"):
            entry["said"] = True
            lost = f", {entry['updates_lost']} update(s) done again" if entry["updates_lost"] is not None else ""
            print(f"ldm.launch: restart {len(self.restarts)} resumed from "
                  f"{'the start' if resumed is None else f'checkpoint-{resumed}'}{lost}", file=sys.stderr, flush=True)

    def verdict(self, code: int, reports: dict[int, dict]) -> int | None:
        """The exit code when the job is not restarted, else None."""
        if self.signalled is not None:
            return code
        if code == 0:
            return 0
        codes = {rank: r["exit_code"] for rank, r in reports.items()}
        on_purpose = [rank for rank, c in codes.items() if c == STOPPED_ON_PURPOSE]
        if on_purpose:
            cause = reports[on_purpose[0]]["cause"] or "a user error"
            print(f"ldm.launch: rank {on_purpose[0]} stopped the run on purpose ({cause}): not restarted",
                  file=sys.stderr)
            return STOPPED_ON_PURPOSE
        stops = set(codes.values())
        # every rank stopped together on SIGTERM/SIGINT sent to them, not to this process; a launcher that was killed
        # (a negative code) stops its ranks the same way, and that is a failure
        if codes and code > 0 and not self.several_nodes and stops <= {130, 143}:
            return max(stops)
        return None

    def failure(self, code: int, reports: dict[int, dict]) -> dict:
        """The rank that failed, its exit code, the cause and the update it was in (its own last update + 1; None:
        before its first). A rank whose collective failed because a peer was gone (`PEER_LOST`) is a victim: the
        rank that stopped answering is named instead."""
        steps = [r["step"] for r in reports.values() if r["step"] is not None]
        update = max(steps) + 1 if steps else None  # no rank to name: the furthest any rank went
        crashed = [rank for rank, r in reports.items() if r["exit_code"] not in (None, 0, 130, 143)]
        silent = [rank for rank, r in reports.items() if r["exit_code"] is None]
        named = [self.current.global_rank(local, reports) for local in self.current.failed]
        if named and named[0] is not None:  # the first rank the launcher saw fail: the others may be its victims
            rank, launcher_code = named[0], next(iter(self.current.failed.values()))  # (a broken collective)
        elif crashed or silent:
            rank, launcher_code = min(crashed or silent), None
        elif self.current.failed:  # named before any heartbeat of its own (it never started): its exit code only
            local, launcher_code = next(iter(self.current.failed.items()))
            return {"rank": None, "exit_code": launcher_code, "update": update,
                    "cause": f"the node's rank {local}, before its first update: {describe_exit(launcher_code)}"}
        elif code < 0:
            return {"rank": None, "exit_code": code, "update": update,
                    "cause": f"paddle.distributed.launch was {describe_exit(code)} (its ranks stopped with it)"}
        else:
            return {"rank": None, "exit_code": code, "cause": f"the launcher exited {code}", "update": update}
        report = reports.get(rank, {})
        if (report.get("cause") or "").startswith(PEER_LOST):  # (the launcher names the first in rank order)
            culprit = self.unresponsive(reports)
            if culprit is not None and culprit != rank:
                return self.culprit(culprit, rank, reports)
        exit_code = report.get("exit_code") if report.get("exit_code") is not None else launcher_code
        return {"rank": rank, "exit_code": exit_code, "cause": report.get("cause") or describe_exit(exit_code),
                "update": own_update(report)}

    @staticmethod
    def culprit(rank: int, victim: int, reports: dict[int, dict]) -> dict:
        """The failure of `rank`, which `victim`'s collective lost. Its own report first; else what its peers saw
        of it then: ended (its exit code, a signal's, when Linux still held it), or alive, so it stopped answering;
        only a peer on another node, which no rank here could see, is judged by gloo's words."""
        other, said = reports[rank], reports[victim]["cause"]
        seen = [r["peers"][str(rank)] for r in reports.values() if str(rank) in (r.get("peers") or {})]
        ended = [s["exit_code"] for s in seen if not s["alive"]]
        timed_out = re.search(r"timeout|timed out", said, re.IGNORECASE)
        exit_code = other["exit_code"]
        if other["cause"]:
            cause = other["cause"]
        elif ended:
            exit_code = next((code for code in ended if code is not None), None)
            cause = describe_exit(exit_code)
        elif seen or timed_out:
            cause = (f"stopped answering after update {other['step']}: rank {victim}'s collective "
                     f"{'waited for it and timed out' if timed_out else 'lost it'}")
        else:  # its peers saw its connections close: it died without a word
            cause = describe_exit(exit_code)
        return {"rank": rank, "exit_code": exit_code, "cause": cause, "update": own_update(other)}

    @staticmethod
    def unresponsive(reports: dict[int, dict]) -> int | None:
        """The rank that stopped advancing first among those that are not victims of a lost peer: the fewest
        updates, then the oldest heartbeat."""
        suspects = [(r["step"] if r["step"] is not None else -1, r["beat_at"] or 0.0, rank)
                    for rank, r in reports.items()
                    if r["exit_code"] not in (0, 130, 143) and not (r["cause"] or "").startswith(PEER_LOST)]
        return min(suspects)[2] if suspects else None

    def give_up(self, failure: dict) -> tuple[str | None, int]:
        """Why the job is not restarted after `failure` (a crash loop, the restarts spent) and its exit code, or
        (None, 0)."""
        previous = self.restarts[-1] if self.restarts else None
        if previous is not None and (previous["update"], previous["cause"]) == (failure["update"], failure["cause"]):
            return (f"the run failed twice at {where(failure)} ({who(failure)}: {failure['cause']}): not restarted "
                    "again (a crash loop: the same failure would repeat)"), CRASH_LOOP
        if len(self.restarts) >= self.args.max_restarts:
            return (f"{who(failure)} failed at {where(failure)} ({failure['cause']}) after "
                    f"{len(self.restarts)} restart(s), the --max_restarts given"), GAVE_UP
        return None, 0

    def restart_entry(self, failure: dict) -> dict:
        """The restart's record in `run.json` (`failed_at` and `said` stay in memory). The checkpoint is, until the
        restarted ranks say which one they resumed, the newest that looks complete."""
        now = time.time()
        resumed, sealed_at = newest_checkpoint_step(self.output_dir)
        return {"restart": len(self.earlier_of(run_record(self.output_dir))) + len(self.restarts) + 1,
                "update": failure["update"],
                "rank": failure["rank"], "exit_code": failure["exit_code"], "cause": failure["cause"],
                "time": datetime.datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
                "resumed_from": resumed,
                "updates_lost": None if failure["update"] is None else failure["update"] - 1 - (resumed or 0),
                "seconds_since_checkpoint": round(now - sealed_at, 1) if sealed_at else None,
                "seconds_to_next_update": None, "seconds_lost": None, "failed_at": now}

    def record(self) -> None:
        """`restarts` in run.json: written between tries only (no rank writes it then), by the node of rank 0."""
        if not self.restarts or self.current is None:
            return
        run = run_record(self.output_dir)
        if run is None or (self.several_nodes and 0 not in read_try(self.current.status)):
            return
        from ldm.checkpoint.run_folder import write_json

        mine = [{k: v for k, v in r.items() if k not in ("failed_at", "said")} for r in self.restarts]
        marker = os.path.join(self.output_dir, "run.json")
        try:
            write_json(marker, {**run, "restarts": self.earlier_of(run) + mine})
        except OSError as e:
            print(f"ldm.launch: could not record the restarts in {marker}: {e}", file=sys.stderr)

    def earlier_of(self, run: dict | None) -> list[dict]:
        """The restarts of earlier jobs of the same run (none when the folder now holds another run)."""
        return self.earlier if run is not None and run.get("created") == self.created else []

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

    def _sleep(self, seconds: float) -> bool:
        """The pause before a restart; True when a signal ended it."""
        end = time.monotonic() + seconds
        while self.signalled is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.5, left))
        return self.signalled is not None


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], str, list[str]]:
    launcher, script, script_args = split_command(argv)
    parser = argparse.ArgumentParser(prog="python -m ldm.launch", description=__doc__.split("\n\n")[0],
                                     usage="python -m ldm.launch [--max_restarts N] [--restart_pause S] "
                                           "[--stop_grace S] [paddle.distributed.launch's flags] SCRIPT [flags]",
                                     epilog="Exit codes: 0 done; 2 stopped on purpose (a user error, the non-finite "
                                            "guard); 3 restarts spent; 4 a crash loop; 128+N stopped by signal N.",
                                     allow_abbrev=False)  # Paddle's own --max_restart passes through
    parser.add_argument("--max_restarts", type=int, default=3,
                        help="restarts after a failure before the job gives up (default 3)")
    parser.add_argument("--restart_pause", type=float, default=10.0,
                        help="seconds before the first restart, doubled each time (at most 300; default 10)")
    parser.add_argument("--stop_grace", type=float, default=300.0,
                        help="seconds a try's ranks may take to stop (saving the update they are in) once their "
                             "launcher has ended, before they are killed (default 300)")
    args, launcher_flags = parser.parse_known_args(launcher)
    if args.max_restarts < 0 or not (0 <= args.restart_pause < math.inf) or not (0 <= args.stop_grace < math.inf):
        raise LaunchError("--max_restarts, --restart_pause and --stop_grace must be finite numbers >= 0")
    output_dir = flag_value(script_args, "--output_dir")
    if args.max_restarts and output_dir is None:
        raise LaunchError(f"{script} needs --output_dir among its flags under ldm.launch: a restart resumes "
                          "the newest checkpoint there")
    log_dir = os.path.realpath(flag_value(launcher_flags, "--log_dir", os.environ.get("PADDLE_LOG_DIR", "log")))
    if output_dir and (log_dir + os.sep).startswith(os.path.realpath(output_dir) + os.sep):
        raise LaunchError(f"--log_dir {log_dir} is inside --output_dir {output_dir}: the run folder holds only what "
                          "the run writes (a start over empties it); put the logs beside it")
    return args, launcher_flags, script, script_args


def main(argv: list[str] | None = None) -> int:
    try:
        args, launcher_flags, script, script_args = parse(sys.argv[1:] if argv is None else argv)
        if not os.path.isfile(script):  # else a pause, a second try and a crash loop's message
            raise LaunchError(f"{script}: no such training script (relative to {os.getcwd()})")
        supervisor = Supervisor(args, launcher_flags, script, script_args)
        lock = lock_log_dir(supervisor.log_dir)
    except (LaunchError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with lock:
        return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
