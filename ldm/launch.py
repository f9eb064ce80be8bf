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

Each restart goes into the run's `run.json` as `restarts`: the update, the rank, its exit code and the cause, the
checkpoint resumed and the updates lost, the seconds from that checkpoint's save to the failure and from the
failure to the restarted job's first update, and their sum, `seconds_lost`. The ranks log the count as the metric
`restarts`; trackers continue the same run, as after any resume. A job its scheduler requeues continues the list.
On several nodes each node runs its own `ldm.launch` (the same command with its `--rank`); the one whose ranks
include rank 0 writes `run.json`. Paddle's launcher names a failed rank by its place in the node; the ranks'
heartbeats give the global rank.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from ldm.runtime.distributed import terminate_with_parent
from ldm.runtime.supervisor import RESTARTS_ENV, STATUS_ENV, read_try

MAX_PAUSE_SECONDS = 300
STOPPED_ON_PURPOSE = 2  # a user error, the non-finite guard (`ldm.runtime.errors`)
# "Container rank 1 status failed cmd [...] code -9 log ...": how Paddle's launcher names the rank that failed
FAILED_CONTAINER = re.compile(r"Container rank (\d+) status failed .* code (-?\d+) ")


class LaunchError(Exception):
    """A command `ldm.launch` cannot run: one line, exit 2."""


def split_command(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(the launcher's flags, SCRIPT, SCRIPT's flags): SCRIPT is the first argument that names a .py file."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not arg.startswith("-"):
            return argv[:i], arg, argv[i + 1:]
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
        if self.first_update_at is None and max(self.steps(), default=-1) > self.start_step:
            self.first_update_at = time.time()

    def steps(self) -> list[int]:
        return [r["step"] for r in read_try(self.status).values() if r["step"] is not None]

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


def newest_checkpoint_step(output_dir: str | None) -> tuple[int | None, float | None]:
    """(step, time sealed) of the newest complete checkpoint of the run folder, as `auto` would resume it."""
    if not output_dir or not os.path.isdir(output_dir):
        return None, None
    from ldm.checkpoint.run_folder import checkpoint_dirs, checkpoint_problem, checkpoint_step

    for folder in reversed(checkpoint_dirs(output_dir)):  # the run verifies the checksums; a look is enough here
        if checkpoint_problem(folder, checksums=False) is None:
            return checkpoint_step(folder), os.path.getmtime(folder)
    return None, None


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

    def command(self, attempt: int) -> list[str]:
        script_args = self.script_args if attempt == 0 else \
            with_flag(self.script_args, "--resume_from_checkpoint", "auto")
        return [sys.executable, "-m", "paddle.distributed.launch", *self.launcher_flags, self.script, *script_args]

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        attempt = 0
        while True:
            code, reports = self.try_once(attempt)
            verdict = self.verdict(code, reports)
            if verdict is not None:
                self.record()
                return verdict
            failure = self.failure(code, reports)
            given_up = self.give_up(failure)
            if given_up:
                self.record()
                print(f"error: ldm.launch: {given_up}", file=sys.stderr)
                return code or 1
            pause = min(self.args.restart_pause * 2 ** len(self.restarts), MAX_PAUSE_SECONDS)
            self.restarts.append(self.restart_entry(failure))
            self.record()
            resumed = self.restarts[-1]["resumed_from"]
            print(f"ldm.launch: {who(failure)} failed at {where(failure)} ({failure['cause']}); "
                  f"restart {len(self.restarts)} of {self.args.max_restarts} in {pause:g} s from "
                  f"{'the start' if resumed is None else f'checkpoint-{resumed}'}", file=sys.stderr, flush=True)
            if self._sleep(pause):
                return 128 + self.signalled
            attempt += 1

    def try_once(self, attempt: int) -> tuple[int, dict[int, dict]]:
        """Paddle's launcher run once: its exit code and the ranks' reports."""
        status = os.path.abspath(os.path.join(self.log_dir, "ldm-launch", f"try-{attempt}"))
        os.makedirs(status, exist_ok=True)
        for name in os.listdir(status):  # a folder of an earlier job's try
            os.remove(os.path.join(status, name))
        restarts = len(self.earlier_of(run_record(self.output_dir))) + len(self.restarts)
        env = {**os.environ, STATUS_ENV: status, RESTARTS_ENV: str(restarts)}
        start = (self.restarts[-1]["resumed_from"] or 0) if self.restarts else 0
        self.current = Try(self.command(attempt), env, status, start)
        if self.signalled is not None:  # a signal that came while the try was being started
            self._on_signal(self.signalled, None)
        code = self.current.wait()
        if self.restarts and self.current.first_update_at is not None:
            last = self.restarts[-1]
            last["seconds_to_next_update"] = round(self.current.first_update_at - last["failed_at"], 1)
            # the updates since the checkpoint are done again, in about the time they took
            last["seconds_lost"] = round(last["seconds_to_next_update"] + (last["seconds_since_checkpoint"] or 0), 1)
        return code, read_try(status)

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
        if codes and not self.several_nodes and stops <= {130, 143}:
            return max(stops)  # every rank stopped together on SIGTERM/SIGINT sent to them, not to this process
        return None

    def failure(self, code: int, reports: dict[int, dict]) -> dict:
        """The rank that failed, its exit code, the cause and the update it was in (None: before its first)."""
        steps = [r["step"] for r in reports.values() if r["step"] is not None]
        update = max(steps) + 1 if steps else None
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
        else:
            return {"rank": None, "exit_code": code, "cause": f"the launcher exited {code}", "update": update}
        report = reports.get(rank, {})
        exit_code = report.get("exit_code") if report.get("exit_code") is not None else launcher_code
        return {"rank": rank, "exit_code": exit_code, "cause": report.get("cause") or describe_exit(exit_code),
                "update": update}

    def give_up(self, failure: dict) -> str | None:
        """Why the job is not restarted after `failure` (a crash loop, the restarts spent), or None."""
        previous = self.restarts[-1] if self.restarts else None
        if previous is not None and (previous["update"], previous["cause"]) == (failure["update"], failure["cause"]):
            return (f"the run failed twice at {where(failure)} ({who(failure)}: {failure['cause']}): not restarted "
                    "again (a crash loop: the same failure would repeat)")
        if len(self.restarts) >= self.args.max_restarts:
            return (f"{who(failure)} failed at {where(failure)} ({failure['cause']}) after "
                    f"{len(self.restarts)} restart(s), the --max_restarts given")
        return None

    def restart_entry(self, failure: dict) -> dict:
        """The restart's record in `run.json` (`failed_at` stays in memory)."""
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

        mine = [{k: v for k, v in r.items() if k != "failed_at"} for r in self.restarts]
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
        its ranks 30 s later, whatever they are writing. A second one goes to the launcher."""
        again, self.signalled = self.signalled is not None and frame is not None, sig
        process = self.current.process if self.current is not None else None
        if process is None or process.poll() is not None:
            return
        ranks = [] if again else children(process.pid)
        for pid in ranks or [process.pid]:
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
                                     allow_abbrev=False)  # Paddle's own --max_restart passes through
    parser.add_argument("--max_restarts", type=int, default=3,
                        help="restarts after a failure before the job gives up (default 3)")
    parser.add_argument("--restart_pause", type=float, default=10.0,
                        help="seconds before the first restart, doubled each time (at most 300; default 10)")
    args, launcher_flags = parser.parse_known_args(launcher)
    if args.max_restarts < 0 or args.restart_pause < 0:
        raise LaunchError("--max_restarts and --restart_pause must be >= 0")
    output_dir = flag_value(script_args, "--output_dir")
    if args.max_restarts and output_dir is None:
        raise LaunchError(f"{script} needs --output_dir among its flags under ldm.launch: a restart resumes "
                          "the newest checkpoint there")
    log_dir = os.path.abspath(flag_value(launcher_flags, "--log_dir", os.environ.get("PADDLE_LOG_DIR", "log")))
    if output_dir and (log_dir + os.sep).startswith(os.path.abspath(output_dir) + os.sep):
        raise LaunchError(f"--log_dir {log_dir} is inside --output_dir {output_dir}: the run folder holds only what "
                          "the run writes (a start over empties it); put the logs beside it")
    return args, launcher_flags, script, script_args


def main(argv: list[str] | None = None) -> int:
    try:
        args, launcher_flags, script, script_args = parse(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return Supervisor(args, launcher_flags, script, script_args).run()


if __name__ == "__main__":
    sys.exit(main())
