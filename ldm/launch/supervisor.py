"""The loop of tries (`ldm.launch`): run Paddle's launcher, read how the try ended, restart it or end the job."""

from __future__ import annotations

import os
import signal
import sys

from ldm.launch import diagnosis
from ldm.launch.command import LaunchError, flag_value, lock_log_dir, log_dir_of, parse, with_flag
from ldm.launch.ledger import RestartLedger
from ldm.launch.processes import Processes
from ldm.runtime.errors import UserError
from ldm.runtime.heartbeat import RESTARTS_ENV, STATUS_ENV, read_try
from ldm.runtime.home import writable_caches

MAX_PAUSE_SECONDS = 300

# Paddle's launcher where HOME cannot hold Paddle's cache: `import paddle` would fail in it (`ldm.runtime.home`)
PADDLE_LAUNCHER_ASIDE = ("import runpy; from ldm.runtime.home import writable_caches; writable_caches(); "
                         "runpy.run_module('paddle.distributed.launch', run_name='__main__', alter_sys=True)")


def say(line: str) -> None:
    print(f"ldm.launch: {line}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, args, launcher_flags: list[str], script: str, script_args: list[str]):
        self.args, self.launcher_flags, self.script, self.script_args = args, launcher_flags, script, script_args
        self.log_dir = log_dir_of(launcher_flags)
        nnodes = flag_value(launcher_flags, "--nnodes", os.environ.get("PADDLE_NNODES", "1"))
        ips = flag_value(launcher_flags, "--ips", os.environ.get("PADDLE_IPS", ""))
        self.several_nodes = nnodes.split(":")[-1] not in ("", "1") or "," in ips  # N, or MIN:MAX (elastic)
        self.ledger = RestartLedger(flag_value(script_args, "--output_dir"))
        self.processes = Processes(args.stop_grace)
        # where HOME cannot hold the caches, the ranks inherit PaddleNLP's and the kernels' (and move Paddle's)
        self.caches = writable_caches(import_now=False)

    def command(self, attempt: int) -> list[str]:
        script_args = self.script_args if attempt == 0 else \
            with_flag(self.script_args, "--resume_from_checkpoint", "auto")
        launcher = ["-m", "paddle.distributed.launch"] if self.caches is None else ["-c", PADDLE_LAUNCHER_ASIDE]
        return [sys.executable, *launcher, *self.launcher_flags, self.script, *script_args]

    def run(self) -> int:
        self.processes.adopt()
        attempt = 0
        while True:
            code, failed, reports = self.try_once(attempt)
            exit_code, why = diagnosis.verdict(code, reports, signalled=self.processes.signalled is not None,
                                               several_nodes=self.several_nodes)
            if exit_code is not None:
                if why:
                    say(why)
                self.record(reports)
                return exit_code
            failure = diagnosis.failure(code, failed, reports)
            why, exit_code = diagnosis.give_up(failure, self.ledger.previous(), len(self.ledger.restarts),
                                               self.args.max_restarts)
            if why:
                self.record(reports)
                print(f"error: ldm.launch: {why}", file=sys.stderr)
                return exit_code
            pause = min(self.args.restart_pause * 2 ** len(self.ledger.restarts), MAX_PAUSE_SECONDS)
            self.ledger.add(failure)
            self.record(reports)
            say(f"{diagnosis.who(failure)} failed at {diagnosis.where(failure)} ({failure['cause']}); restart "
                f"{len(self.ledger.restarts)} of {self.args.max_restarts} in {pause:g} s, from the newest complete "
                "checkpoint")
            if self.processes.pause(pause):
                say(f"restart {len(self.ledger.restarts)} cancelled by {signal.Signals(self.processes.signalled).name}")
                return 128 + self.processes.signalled
            attempt += 1

    def try_once(self, attempt: int) -> tuple[int, dict[int, int], dict[int, dict]]:
        """Paddle's launcher run once: its exit code, the ranks it named as failed, and the ranks' reports, read
        once every process of the try has ended."""
        status = os.path.abspath(os.path.join(self.log_dir, "ldm-launch", f"try-{attempt}"))
        os.makedirs(status, exist_ok=True)
        for name in os.listdir(status):  # a folder of an earlier job's try (this job holds the log folder's lock)
            os.remove(os.path.join(status, name))
        env = {**os.environ, STATUS_ENV: status, RESTARTS_ENV: str(self.ledger.count())}
        tried, code = self.processes.run(self.command(attempt), env, status, self.ledger.start_step(), attempt)
        reports = read_try(status)
        self.ledger.looked()
        resumed = self.ledger.resumed(reports, tried.first_update_at)
        if resumed:
            say(resumed)
        return code, tried.failed, reports

    def record(self, reports: dict[int, dict]) -> None:
        """The restarts into run.json, by one node: the one whose ranks include rank 0."""
        if not self.several_nodes or 0 in reports:
            self.ledger.write()


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
