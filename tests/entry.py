"""Running the training entry points as users do, and reading what they wrote (shared by the train tests)."""

import os
import subprocess
import sys

import numpy as np
import paddle
from conftest import ROOT
from safetensors.numpy import load_file


def run_entry(script: str, args, launch: bool = False, cwd=None):
    """`python SCRIPT ARGS`, or under `paddle.distributed.launch` with 2 processes (logs in cwd/launch_logs)."""
    prefix = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
              "--log_dir", str(cwd / "launch_logs")] if launch else [sys.executable]
    env = {**os.environ, "LIBC_FATAL_STDERR_": "1"}  # glibc's abort messages to stderr, not to a terminal
    return subprocess.run(prefix + [str(ROOT / script), *args], capture_output=True, text=True, cwd=cwd or ROOT,
                          env=env)


def subprocess_result(code: int, output: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], code, output, "")


def launch_report(result, cwd, tail: int = 2500) -> str:
    """The end of the launcher's output and of each rank's log: what a failed two-process run prints."""
    folder = cwd / "launch_logs"
    parts = [f"--- launcher (exit {result.returncode}) ---\n{result.stdout[-tail:]}{result.stderr[-tail:]}"]
    for name in sorted(f for f in os.listdir(folder) if f.startswith("workerlog")):
        parts.append(f"--- {name} ---\n{(folder / name).read_text()[-tail:]}")
    return "\n".join(parts)


def weights(checkpoint):
    """Every UNet, LDMBert and EMA weight of a checkpoint by name, and the EMA update counter."""
    out = {f"unet.{k}": v for k, v in load_file(os.path.join(checkpoint, "unet",
                                                             "diffusion_paddle_model.safetensors")).items()}
    out.update({f"bert.{k}": v.numpy() for k, v in paddle.load(os.path.join(checkpoint, "bert",
                                                                           "model_state.pdparams")).items()})
    ema = paddle.load(os.path.join(checkpoint, "ema.pdparams"))
    out.update({k: np.asarray(v) for k, v in ema.items() if k.startswith("shadow.")})
    return out, ema["num_updates"]


def run_until(script: str, args, pattern: str, signum: int, launch: bool = False, cwd=None, delay: float = 0.0,
              timeout: float = 240, act=None):
    """Start an entry point in its own process group, and signal the whole group (as Ctrl-C, a scheduler or
    the launcher would) `delay` seconds after `pattern` first appears in its output; `act(process)` replaces
    that signal when given. Returns (exit code, output)."""
    import signal
    import threading
    import time

    prefix = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
              "--log_dir", str(cwd / "launch_logs")] if launch else [sys.executable]
    proc = subprocess.Popen(prefix + [str(ROOT / script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=cwd or ROOT, start_new_session=True,
                            env={**os.environ, "LIBC_FATAL_STDERR_": "1"})
    lines: list[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if pattern in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if seen.wait(timeout) and proc.poll() is None:
            time.sleep(delay)
            if act is not None:
                act(proc)
            else:
                os.killpg(proc.pid, signum)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
    return code, "".join(lines)


def launched_rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of one rank that `paddle.distributed.launch` runs (its child with that PADDLE_TRAINER_ID)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                parent = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            if parent != launcher_pid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (OSError, StopIteration):
            continue
        if f"PADDLE_TRAINER_ID={rank}".encode() in environ:
            return int(name)
    raise LookupError(f"rank {rank} of launcher {launcher_pid} not found")
