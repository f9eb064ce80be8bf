"""Running the training entry points as users do, and reading what they wrote (shared by the train tests)."""

import os
import re
import subprocess
import sys

import numpy as np
from conftest import ROOT
from safetensors.numpy import load_file

from ldm.checkpoint.serialization import load_state

# What every training run and tool imports: the fork server imports it once, and each run starts as a fork
# of that process instead of a new interpreter that spends 6-10 s importing Paddle, PaddleNLP and ppdiffusers.
PRELOAD = ["paddle", "paddle.distributed", "paddlenlp.trainer", "ppdiffusers", "visualdl",
           "ldm.train.loop", "ldm.train.trainer", "ldm.train.autoencoder", "ldm.prepare.tools"]
_forkserver = None

# `python -c FILE_SIZE_LIMIT BYTES SCRIPT ARGS...`: SCRIPT run with no file allowed past BYTES, a real failed write
FILE_SIZE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run_in_child(argv: list[str], cwd: str, env: dict, out_path: str, err_path: str, new_session: bool) -> None:
    """In the forked child: become `python ARGV` run in `cwd` with `env` and its output in files."""
    import multiprocessing
    import runpy

    if new_session:
        os.setsid()
    multiprocessing.set_start_method("fork", force=True)  # a new interpreter's default (loader workers use it)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "PADDLE_TRAINER_ID" in env:  # a rank of `launch_ranks`: the server's import of PaddleNLP made Paddle read
        import paddle.distributed.parallel as parallel  # its rank variables (none) once; read them again

        parallel._global_parallel_env = None
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        import atexit

        atexit._run_exitfuncs()  # as the interpreter would; multiprocessing ends the child with os._exit


def start_python(argv, cwd, out_path: str, err_path: str, new_session: bool = False, env: dict | None = None):
    """Start `python ARGV` (a script, `-m module` or `-c code`) as a fork of a server that has imported the stack, so
    the run pays none of the import; its stdout and stderr are appended to the two files (they may be one).
    What the server's imports read of the environment (Paddle's FLAGS_*, ppdiffusers' cache folder) is
    fixed when the server starts; the child gets the caller's environment for everything else.
    Returns the multiprocessing.Process: its exit code is the command's (multiprocessing reports a
    `sys.exit("message")` and an uncaught exception as the interpreter does, and -N for signal N)."""
    import multiprocessing

    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(PRELOAD)
    for path in (out_path, err_path):
        open(path, "a").close()  # readable before the child writes
    env = {**os.environ, **(env or {}), "LIBC_FATAL_STDERR_": "1"}  # glibc's aborts to stderr, not to a terminal
    child = _forkserver.Process(target=_run_in_child, args=([str(a) for a in argv], str(cwd or ROOT), env,
                                                            out_path, err_path, new_session))
    child.start()
    return child


def run_python(argv, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python ARGV` run to its end (see `start_python`): exit code, stdout and stderr."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        child = start_python(argv, cwd, out, err, new_session=True)
        child.join(timeout)
        if child.exitcode is None:  # the whole session: loader workers too
            import signal

            os.killpg(child.pid, signal.SIGKILL)
            child.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(argv, child.exitcode, o.read(), e.read())


def run_entry(script: str, args, launch: bool = False, cwd=None, launcher: bool = False):
    """`python SCRIPT ARGS` (a fork of the preloaded server), or 2 ranks over gloo (logs in
    cwd/launch_logs/workerlog.N): forks of the server given the variables `paddle.distributed.launch` gives its
    ranks (`launch_ranks`), or, with `launcher`, under the launcher itself (what its own behaviour is tested with:
    signals, a rank that dies, several nodes)."""
    if not launch:
        return run_python([ROOT / script, *args], cwd)
    if not launcher:
        return launch_ranks([ROOT / script, *args], cwd)
    prefix = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
              "--log_dir", str(cwd / "launch_logs")]
    env = {**os.environ, "LIBC_FATAL_STDERR_": "1"}
    return subprocess.run(prefix + [str(ROOT / script), *args], capture_output=True, text=True, cwd=cwd or ROOT,
                          env=env)


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch_ranks(argv, cwd, world: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python ARGV` as `world` ranks over gloo, each a fork of the preloaded server with the variables that
    `paddle.distributed.launch --nproc_per_node 2` sets (read off its ranks, Paddle 3.3), so a two-process test pays
    no interpreter start and no import of the stack (about 10 CPU-seconds a run). As the launcher does, a rank that
    fails ends the others (after 30 s, time for them to notice and exit themselves), and the exit code is the first
    failure's. Each rank's output goes to cwd/launch_logs/workerlog.N; rank 0's is the result's stdout too, as the
    launcher echoes it."""
    import signal
    import time

    logs = os.path.join(str(cwd), "launch_logs")
    os.makedirs(logs, exist_ok=True)
    master, *endpoints = _free_ports(world + 1)
    common = {"PADDLE_AUTO_CLUSTER": "0", "PADDLE_DISTRI_BACKEND": "gloo", "PADDLE_GLOBAL_SIZE": str(world),
              "PADDLE_LOCAL_SIZE": str(world), "PADDLE_LOG_DIR": logs, "PADDLE_MASTER": f"127.0.0.1:{master}",
              "PADDLE_NNODES": "1", "PADDLE_TRAINERS_NUM": str(world),
              "PADDLE_TRAINER_ENDPOINTS": ",".join(f"127.0.0.1:{p}" for p in endpoints)}
    ranks = []
    for rank in range(world):
        env = {**common, "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{endpoints[rank]}", "PADDLE_GLOBAL_RANK": str(rank),
               "PADDLE_LOCAL_RANK": str(rank), "PADDLE_RANK_IN_NODE": str(rank), "PADDLE_TRAINER_ID": str(rank)}
        log = os.path.join(logs, f"workerlog.{rank}")
        ranks.append(start_python(argv, cwd, log, log, new_session=True, env=env))
    deadline, failed_at, code = time.monotonic() + timeout, None, 0
    try:
        while any(r.exitcode is None for r in ranks):
            codes = [r.exitcode for r in ranks if r.exitcode not in (None, 0)]
            if codes and failed_at is None:
                failed_at, code = time.monotonic(), codes[0]
            if time.monotonic() > deadline or failed_at is not None and time.monotonic() > failed_at + 30:
                break
            time.sleep(0.05)
    finally:
        for r in ranks:
            if r.exitcode is None:
                os.killpg(r.pid, signal.SIGKILL)
                r.join()
    if time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(argv, timeout)
    code = code or next((r.exitcode for r in ranks if r.exitcode), 0)
    with open(os.path.join(logs, "workerlog.0")) as f:  # the launcher echoes rank 0's output
        return subprocess.CompletedProcess(argv, code, f.read(), "")


def subprocess_result(code: int, output: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], code, output, "")


def launch_report(result, cwd, tail: int = 2500) -> str:
    """The end of the launcher's output and of each rank's log: what a failed two-process run prints."""
    folder = cwd / "launch_logs"
    parts = [f"--- launcher (exit {result.returncode}) ---\n{result.stdout[-tail:]}{result.stderr[-tail:]}"]
    for name in sorted(f for f in os.listdir(folder) if f.startswith("workerlog")):
        parts.append(f"--- {name} ---\n{(folder / name).read_text()[-tail:]}")
    return "\n".join(parts)


def part_weights(folder, stem):
    """A model part's weights: one safetensors file, or the shards its index names."""
    import json

    index = os.path.join(folder, f"{stem}.safetensors.index.json")
    if not os.path.isfile(index):
        return load_file(os.path.join(folder, f"{stem}.safetensors"))
    with open(index) as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for name in sorted(files):
        out.update(load_file(os.path.join(folder, name)))
    return out


def weights(checkpoint):
    """Every UNet, LDMBert (when it trains) and EMA weight of a checkpoint by name, and the EMA update counter."""
    out = {f"unet.{k}": v for k, v in part_weights(os.path.join(checkpoint, "unet"), "diffusion_paddle_model").items()}
    if os.path.isdir(os.path.join(checkpoint, "bert")):
        out.update({f"bert.{k}": v for k, v in part_weights(os.path.join(checkpoint, "bert"), "model").items()})
    ema = load_state(str(checkpoint), "ema")
    out.update({k: np.asarray(v) for k, v in ema.items() if k.startswith("shadow.")})
    return out, ema["num_updates"]


def checkpoint_state(checkpoint) -> dict:
    """`weights` and every array of the checkpoint's EMA and optimizer state (`ema/...`, `optimizer/...`)."""
    found, _ = weights(checkpoint)
    for part in ("ema", "optimizer"):
        found.update({f"{part}/{k}": v for k, v in load_state(str(checkpoint), part).items()
                      if isinstance(v, np.ndarray)})
    return found


def run_until(script: str, args, pattern: str, signum: int, launch: bool = False, cwd=None, delay: float = 0.0,
              timeout: float = 240, act=None):
    """Start an entry point in its own process group, and signal the whole group (as Ctrl-C, a scheduler or
    the launcher would) `delay` seconds after `pattern` first appears in its output; `act(process)` replaces
    that signal when given (a launched run only). Returns (exit code, combined output)."""
    if launch:
        return _launch_until(script, args, pattern, signum, cwd, delay, timeout, act)
    import signal
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "log")
        child = start_python([ROOT / script, *args], cwd, log, log, new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while child.exitcode is None and time.monotonic() < deadline:
                with open(log) as f:
                    if pattern in f.read():
                        time.sleep(delay)
                        os.killpg(child.pid, signum)
                        break
                time.sleep(0.05)
            child.join(timeout)
        finally:
            if child.exitcode is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.join()
        with open(log) as f:
            return child.exitcode, f.read()


def _launch_until(script, args, pattern, signum, cwd, delay, timeout, act):
    import signal
    import threading
    import time

    prefix = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
              "--log_dir", str(cwd / "launch_logs")]
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


def rank_pid(status: str, rank: int) -> int | None:
    """The pid of the training process of `rank` that reports to the report folder `status` (a try of
    `python -m ldm.launch`)."""
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"LDM_LAUNCH_STATUS={status}".encode() in environ and f"PADDLE_TRAINER_ID={rank}".encode() in environ:
            return int(name)
    return None


def guard_stop_errors(result, tmp_path, launch: bool) -> list[str]:
    """The `error:` lines of a run the non-finite guard stopped after updates 2, 3 and 4 were skipped (every
    rank's log when launched), once checked that it ended non-zero, without a traceback, skipping on every rank."""
    logs = [(tmp_path / "launch_logs" / f"workerlog.{r}").read_text() for r in (0, 1)] if launch else [result.stderr]
    # launched: each rank exits 2, or is ended by the launcher once the other has
    assert result.returncode == 2 or launch and result.returncode != 0, \
        launch_report(result, tmp_path) if launch else result.stderr[-3000:]
    errors = []
    for log in logs:
        assert "Traceback" not in log
        assert [int(n) for n in re.findall(r"update (\d+) skipped", log)] == [2, 3, 4], log[-3000:]  # every rank
        errors += [line for line in log.splitlines() if line.startswith("error: ")]
    return errors


def modes_not_as_umask_says(folder) -> list[str]:
    """Files and folders under `folder` whose mode is not what `mkdir`/`open` give under this process's umask."""
    from ldm.runtime.files import umask

    mask, wrong = umask(), []
    for root, dirs, files in os.walk(folder):
        for name, want in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            path = os.path.join(root, name)
            mode = os.stat(path).st_mode & 0o777
            if mode & ~0o111 != want & ~mask & ~0o111:  # an executable bit is the writer's choice
                wrong.append(f"{os.path.relpath(path, folder)} {oct(mode)}")
    return wrong


def refused_at_start(args: list[str], tmp_path) -> str:
    """The one line a training run (the hand-written loop's entry point, the model's parts untrained allowed) refuses
    `args` with, at start: exit 2, no traceback, no run folder."""
    from corpus import write_corpus

    listing = write_corpus(str(tmp_path / "corpus"), num_records=4, records_per_shard=4)
    run = tmp_path / "refused"
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        *args, "--file_list", listing, "--train_batch_size", "2", "--max_train_steps", "1", "--num_workers", "0",
        "--report_to", "none", "--model_max_length", "16", "--allow_untrained_vae", "--allow_untrained_text_encoder",
        "--output_dir", str(run)])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not run.exists()
    return result.stderr.strip().splitlines()[-1]


def said(capsys, main, argv: list[str]) -> str:
    """The one line a command's `main` ended on with exit status 2 (returned, or its parser's exit)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and "Traceback" not in "\n".join(err), err
    return err[-1]
