"""`ldm.launch`'s command line: its own flags, Paddle's launcher's, the training script and the script's flags."""

from __future__ import annotations

import argparse
import fcntl
import math
import os

import ldm.launch


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


def log_dir_of(launcher_flags: list[str]) -> str:
    """Paddle's launcher's log folder, as it reads it: its flag, else its environment variable."""
    return flag_value(launcher_flags, "--log_dir", os.environ.get("PADDLE_LOG_DIR", "log"))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], str, list[str]]:
    launcher, script, script_args = split_command(argv)
    parser = argparse.ArgumentParser(prog="python -m ldm.launch", description=ldm.launch.__doc__.split("\n\n")[0],
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
    log_dir = os.path.realpath(log_dir_of(launcher_flags))
    if output_dir and (log_dir + os.sep).startswith(os.path.realpath(output_dir) + os.sep):
        raise LaunchError(f"--log_dir {log_dir} is inside --output_dir {output_dir}: the run folder holds only what "
                          "the run writes (a start over empties it); put the logs beside it")
    return args, launcher_flags, script, script_args


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
