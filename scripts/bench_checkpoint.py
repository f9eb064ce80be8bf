"""Asynchronous against synchronous checkpoints, in one run of this script, with the peers beside them.

    .venv/bin/python scripts/bench_checkpoint.py [--width 64] [--updates 40] [--save_steps 8] [--work_dir DIR]

Two runs of the hand-written loop on one process, the same but for `--async_save`: the 12-layer preset with the
UNet's channels cut to --width (64: about 120 M trained parameters; with AdamW's two moments and the EMA a
checkpoint of about 1.8 GB), batch 1 at 64 px, saving every --save_steps updates (longer than a save takes to write,
as a real interval is). From each run's metrics.jsonl: every periodic save's stall (`checkpoint/stall_seconds`: how
long the updates waited; the final save, which the end of a run waits for, is left out), its write time and bytes;
and the run's wall time.

Then, on the state of the last checkpoint (weights, moments and EMA as Paddle tensors, in this process): the time
of `paddle.save` (what PaddleNLP's Trainer writes: one pickle; also followed by an fsync, as every checkpoint file
here is before it counts) and of `paddle.distributed.save_state_dict` (synchronous; neither hashes nor flushes),
the copy speeds behind the snapshot, and the time to fork this process (what a forked writer would cost the loop
before it wrote anything). Ratios are against the synchronous save's median stall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_sharding import bench_args  # noqa: E402

GB = 1e9


def train(work: str, common: list[str], name: str, extra: list[str]) -> dict:
    out = os.path.join(work, name)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_txt2img_laion400m_no_trainer.py"), *common,
                             *extra, "--output_dir", out], cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(result.stderr[-4000:])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        saves = [line for line in map(json.loads, f) if "checkpoint/stall_seconds" in line]
    periodic = saves[:-1]  # the last is the final save, waited for by the end of the run in either mode
    return {"wall_seconds": wall, "out": out, "stalls": [s["checkpoint/stall_seconds"] for s in periodic],
            "writes": [s["checkpoint/write_seconds"] for s in periodic], "bytes": saves[-1]["checkpoint/bytes"]}


def state_of(checkpoint: str) -> dict:
    """Weights, optimizer moments and EMA of a checkpoint as one flat dict of Paddle tensors."""
    import paddle
    from safetensors.numpy import load_file

    from ldm.checkpoint.serialization import load_state

    state = {}
    for part, file in (("unet", "diffusion_paddle_model.safetensors"), ("bert", "model.safetensors")):
        for key, value in load_file(os.path.join(checkpoint, part, file)).items():
            state[f"{part}.{key}"] = paddle.to_tensor(value)
    for name in ("optimizer", "ema"):
        def walk(tree, prefix):
            if isinstance(tree, dict):
                for key, value in tree.items():
                    walk(value, f"{prefix}.{key}")
            elif hasattr(tree, "dtype") and getattr(tree, "ndim", 0) > 0:
                state[prefix] = paddle.to_tensor(tree)
        walk(load_state(checkpoint, name), name)
    return state


def timed(fn, repeat: int = 2) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def peers(state: dict, work: str) -> dict:
    import numpy as np
    import paddle
    import paddle.distributed as pdist

    nbytes = sum(int(t.numel()) * t.element_size() for t in state.values())
    target = os.path.join(work, "peers")
    os.makedirs(target, exist_ok=True)
    figures = {"state_gb": nbytes / GB}
    def paddle_save(flush: bool) -> None:
        path = os.path.join(target, "state.pdparams")
        paddle.save(state, path)
        if flush:  # as every file of a checkpoint here is, before it counts
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    figures["paddle_save_seconds"] = timed(lambda: paddle_save(False))
    figures["paddle_save_fsync_seconds"] = timed(lambda: paddle_save(True))
    try:
        figures["save_state_dict_seconds"] = timed(lambda: pdist.save_state_dict(state, os.path.join(target, "dcp")))
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the other figures stand
        figures["save_state_dict_seconds"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    tensors = list(state.values())
    buffers = [np.empty(t.shape, "float32") for t in tensors]
    figures["numpy_gb_s"] = nbytes / GB / timed(lambda: [t.numpy() for t in tensors])
    figures["copy_into_reused_gb_s"] = nbytes / GB / timed(
        lambda: [np.copyto(b, np.from_dlpack(t)) for b, t in zip(buffers, tensors, strict=True)])

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    figures["fork_seconds"] = timed(fork, repeat=3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--save_steps", type=int, default=8)
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-checkpoint-")
    os.makedirs(work, exist_ok=True)
    common = bench_args(work, args.width) + [
        "--max_train_steps", str(args.updates), "--save_steps", str(args.save_steps), "--logging_steps", "1",
        "--seed", "1", "--checkpoints_total_limit", "2"]
    runs = {name: train(work, common, name, extra)
            for name, extra in (("sync", ["--async_save", "false"]), ("async", []))}
    baseline = statistics.median(runs["sync"]["stalls"])
    for name, run in runs.items():
        median = statistics.median(run["stalls"])
        stalls = ", ".join(f"{s:.2f}" for s in run["stalls"])
        print(f"{name:5s}: checkpoint {run['bytes'] / GB:.2f} GB; stall per save {stalls} s (median {median:.2f} s, "
              f"{median / baseline:.3f}x sync); write to seal median "
              f"{statistics.median(run['writes']):.2f} s; run {run['wall_seconds']:.1f} s end to end "
              f"({run['wall_seconds'] / runs['sync']['wall_seconds']:.3f}x sync)", flush=True)
    checkpoint = os.path.join(runs["async"]["out"], f"checkpoint-{args.updates}")
    figures = peers(state_of(checkpoint), work)
    for key in ("paddle_save_seconds", "paddle_save_fsync_seconds", "save_state_dict_seconds"):
        value = figures[key]
        ratio = f" ({value / baseline:.2f}x our sync save's stall)" if isinstance(value, float) else ""
        print(f"{key}: {value if isinstance(value, str) else f'{value:.2f}'}{ratio}")
    print(f"state {figures['state_gb']:.2f} GB as tensors; Tensor.numpy() {figures['numpy_gb_s']:.2f} GB/s, "
          f"copy into reused buffers {figures['copy_into_reused_gb_s']:.2f} GB/s; fork of this process "
          f"{figures['fork_seconds'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
