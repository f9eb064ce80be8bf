"""Paddle's launcher, run again from the newest sealed checkpoint when a rank dies: a job that heals itself.

    python -m ldm.launch --max_restarts 3 [--restart_pause 10] [paddle.distributed.launch's flags] SCRIPT [flags]

It runs `python -m paddle.distributed.launch [its flags] SCRIPT [flags]` (never a copy of its job: rendezvous,
ranks, logs and the stop of every rank when one fails stay Paddle's) and reads how each rank ended from the
reports the ranks leave in `<log_dir>/ldm-launch/try-<n>/` (`ldm.runtime.supervisor`). Paddle's own
`--max_restart` restarts ranks only in its elastic mode, which needs an etcd server (given `--master etcd://...`,
it is used as it is); in collective mode its launcher exits at the first rank that dies.

- The run ended (every rank 0), or stopped on purpose: a user error or the non-finite guard (exit 2), a stop every
  rank agreed on after SIGTERM/SIGINT (128 + the signal), or this process was signalled (a scheduler's stop: the
  signal goes to the ranks, which save the update they are in and exit): not restarted, its exit code is this
  one's.
- Anything else (a rank killed: out of memory, a segfault, a lost peer; an exception; a data stall the watchdog
  ended, 124) is a failure: after a pause that doubles each time (`--restart_pause`, at most 5 minutes) the same
  command runs again with `--resume_from_checkpoint auto`, up to `--max_restarts` times.
- A failure at the same update and of the same cause as the one before (a crash loop: a record that kills a
  decoder, a kernel that always faults there, the out-of-memory killer) stops after the second time, in one line
  naming the update and the cause.

Each restart goes into the run's `run.json` as `restarts`: the update, the rank, its exit code and the cause, the
checkpoint resumed and the updates lost, the seconds from that checkpoint's save to the failure and from the
failure to the restarted job's first update, and their sum, `seconds_lost`. The ranks log the count as the metric
`restarts`; trackers continue the same run, as after any resume. On several nodes each node runs its own
`ldm.launch` (the same command with its `--rank`); the one whose ranks include rank 0 writes `run.json`.
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
    if code < 0 or 128 < code < 160:
        return f"killed by {signal_name(code)}" if code < 0 or code != 143 else "stopped by SIGTERM"
    if code == 124:
        return "stopped by the data watchdog (no batch for --data_timeout seconds)"
    return f"exit {code}"


class Try:
    """One run of Paddle's launcher: its output passed through, the failed ranks it names, the first new update."""

    def __init__(self, command: list[str], env: dict, status: str, start_step: int | None):
        self.status, self.start_step = status, start_step
        self.failed: dict[int, int] = {}  # rank -> exit code, as the launcher reports them
        self.first_update_at: float | None = None
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, preexec_fn=_die_with_parent)
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
        steps = [r["step"] for r in read_try(self.status).values() if r["step"] is not None]
        if steps and (self.start_step is None or max(steps) > self.start_step):
            self.first_update_at = time.time()


def _die_with_parent() -> None:
    """In the launcher's process: SIGTERM when `ldm.launch` dies (a scheduler's SIGKILL), as its ranks get from it."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


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


class Supervisor:
    def __init__(self, args, launcher_flags: list[str], script: str, script_args: list[str]):
        self.args, self.launcher_flags, self.script, self.script_args = args, launcher_flags, script, script_args
        self.output_dir = flag_value(script_args, "--output_dir")
        # as Paddle's launcher reads them: its flag, else its environment variable (a PaddleJob's operator sets them)
        self.log_dir = flag_value(launcher_flags, "--log_dir", os.environ.get("PADDLE_LOG_DIR", "log"))
        nnodes = flag_value(launcher_flags, "--nnodes", os.environ.get("PADDLE_NNODES", "1"))
        self.several_nodes = nnodes.split(":")[-1] not in ("", "1")  # N, or MIN:MAX for an elastic job
        self.restarts: list[dict] = []
        self.signalled: int | None = None

    def command(self, attempt: int) -> list[str]:
        script_args = self.script_args if attempt == 0 else \
            with_flag(self.script_args, "--resume_from_checkpoint", "auto")
        return [sys.executable, "-m", "paddle.distributed.launch", *self.launcher_flags, self.script, *script_args]

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        attempt = 0
        while True:
            status = os.path.abspath(os.path.join(self.log_dir, "ldm-launch", f"try-{attempt}"))
            os.makedirs(status, exist_ok=True)
            for name in os.listdir(status):  # a folder of an earlier job's try
                os.remove(os.path.join(status, name))
            env = {**os.environ, STATUS_ENV: status, RESTARTS_ENV: str(len(self.restarts))}
            start_step = self.restarts[-1]["resumed_from"] if self.restarts else None
            self.current = Try(self.command(attempt), env, status, start_step)
            code = self.current.wait()
            ended = time.time()
            if self.restarts and self.current.first_update_at is not None:
                last = self.restarts[-1]
                last["seconds_to_next_update"] = round(self.current.first_update_at - last["failed_at"], 1)
                # the updates since the checkpoint are done again, in about the time they took
                redone = last["seconds_since_checkpoint"] or 0
                last["seconds_lost"] = round(last["seconds_to_next_update"] + redone, 1)
            reports = read_try(status)
            verdict = self.verdict(code, reports)
            if verdict is not None:
                self.record()
                return verdict
            failure = self.failure(code, reports)
            previous = self.restarts[-1] if self.restarts else None
            same = previous is not None and (previous["update"], previous["cause"]) == (failure["update"],
                                                                                         failure["cause"])
            if same:
                self.record()
                where = f"update {failure['update']}" if failure["update"] is not None else "its start"
                print(f"error: ldm.launch: the run failed twice at {where} (rank {failure['rank']}: "
                      f"{failure['cause']}): not restarted again (a crash loop: the same failure would repeat)",
                      file=sys.stderr)
                return code or 1
            if len(self.restarts) >= self.args.max_restarts:
                self.record()
                print(f"error: ldm.launch: rank {failure['rank']} failed at update {failure['update']} "
                      f"({failure['cause']}) after {len(self.restarts)} restart(s), the --max_restarts given",
                      file=sys.stderr)
                return code or 1
            pause = min(self.args.restart_pause * 2 ** len(self.restarts), MAX_PAUSE_SECONDS)
            resumed, sealed_at = newest_checkpoint_step(self.output_dir)
            lost = None if failure["update"] is None else failure["update"] - 1 - (resumed or 0)
            self.restarts.append({
                "restart": len(self.restarts) + 1, "update": failure["update"], "rank": failure["rank"],
                "exit_code": failure["exit_code"], "cause": failure["cause"], "failed_at": round(ended, 1),
                "time": datetime.datetime.fromtimestamp(ended).astimezone().isoformat(timespec="seconds"),
                "resumed_from": resumed, "updates_lost": lost,
                "seconds_since_checkpoint": round(ended - sealed_at, 1) if sealed_at else None,
                "seconds_to_next_update": None, "seconds_lost": None})
            self.record()
            origin = f"checkpoint-{resumed}" if resumed is not None else "the start"
            print(f"ldm.launch: rank {failure['rank']} failed at update {failure['update']} ({failure['cause']}); "
                  f"restart {len(self.restarts)} of {self.args.max_restarts} in {pause:g} s from {origin}",
                  file=sys.stderr, flush=True)
            if self._sleep(pause):
                return 128 + self.signalled
            attempt += 1

    def verdict(self, code: int, reports: dict[int, dict]) -> int | None:
        """The exit code when the job is not restarted, else None."""
        if self.signalled is not None:
            return code or 128 + self.signalled
        if code == 0:
            return 0
        codes = {rank: r["exit_code"] for rank, r in reports.items()}
        on_purpose = [rank for rank, c in codes.items() if c == STOPPED_ON_PURPOSE]
        if on_purpose:
            cause = reports[on_purpose[0]]["cause"] or "a user error"
            print(f"ldm.launch: rank {on_purpose[0]} stopped the run on purpose ({cause}): not restarted",
                  file=sys.stderr)
            return STOPPED_ON_PURPOSE
        signals = set(codes.values())
        if codes and not self.several_nodes and len(signals) == 1 and all(c in (130, 143) for c in signals) \
                and not self.current.failed.keys() - codes.keys():
            return signals.pop()  # every rank stopped together on SIGTERM/SIGINT sent to them, not to this process
        return None

    def failure(self, code: int, reports: dict[int, dict]) -> dict:
        """The rank that failed, its exit code, the cause and the update it was in (None: before its first)."""
        steps = [r["step"] for r in reports.values() if r["step"] is not None]
        update = max(steps) + 1 if steps else None
        crashed = [rank for rank, r in reports.items() if r["exit_code"] not in (None, 0, 130, 143)]
        silent = [rank for rank, r in reports.items() if r["exit_code"] is None]
        if self.current.failed:  # the first rank the launcher saw fail: the others may be its victims (a peer's
            rank = next(iter(self.current.failed))  # collective broken by its death raises in them)
        elif crashed or silent:
            rank = min(crashed or silent)
        else:
            return {"rank": None, "exit_code": code, "cause": f"the launcher exited {code}", "update": update}
        report = reports.get(rank, {})
        exit_code = report.get("exit_code")
        if exit_code is None:
            exit_code = self.current.failed.get(rank)
        cause = report.get("cause") or describe_exit(exit_code)
        return {"rank": rank, "exit_code": exit_code, "cause": cause, "update": update}

    def record(self) -> None:
        """`restarts` in run.json: written between tries only (no rank writes it then), by the node of rank 0."""
        if not self.restarts or not self.output_dir:
            return
        marker = os.path.join(self.output_dir, "run.json")
        if not os.path.isfile(marker) or (self.several_nodes and 0 not in read_try(self.current.status)):
            return
        from ldm.checkpoint.run_folder import write_json

        try:
            with open(marker) as f:
                run = json.load(f)
            run["restarts"] = [{k: v for k, v in r.items() if k != "failed_at"} for r in self.restarts]
            write_json(marker, run)
        except (OSError, ValueError) as e:
            print(f"ldm.launch: could not record the restarts in {marker}: {e}", file=sys.stderr)

    def _on_signal(self, sig, frame) -> None:
        """A scheduler's stop, and no restart after it. The first goes to the ranks themselves: they agree to stop,
        save the update they are in and exit, and the launcher then ends; Paddle's launcher given a SIGTERM kills
        its ranks 30 s later, whatever they are writing. A second one goes to the launcher."""
        again, self.signalled = self.signalled is not None, sig
        process = getattr(getattr(self, "current", None), "process", None)
        if process is None or process.poll() is not None:
            return
        ranks = [] if again else children(process.pid)
        for pid in ranks or [process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _sleep(self, seconds: float) -> bool:
        """The pause before a restart; True when a signal ended it."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.signalled is None:
            time.sleep(min(0.5, end - time.monotonic()))
        return self.signalled is not None


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], str, list[str]]:
    launcher, script, script_args = split_command(argv)
    parser = argparse.ArgumentParser(prog="python -m ldm.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_restarts", type=int, default=3,
                        help="restarts after a failure before the job gives up (default 3)")
    parser.add_argument("--restart_pause", type=float, default=10.0,
                        help="seconds before the first restart, doubled each time (at most 300; default 10)")
    args, launcher_flags = parser.parse_known_args(launcher)
    if args.max_restarts < 0 or args.restart_pause < 0:
        raise LaunchError("--max_restarts and --restart_pause must be >= 0")
    if args.max_restarts and flag_value(script_args, "--output_dir") is None:
        raise LaunchError(f"{script} needs --output_dir among its flags under ldm.launch: a restart resumes "
                          "the newest checkpoint there")
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
