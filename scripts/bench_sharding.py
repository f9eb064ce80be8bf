"""Unsharded against `--sharding stage1` on 2 processes, in one run of this script: each rank's optimizer and EMA
bytes (run.json's `memory`), its peak resident memory, the save's wall time (snapshot to seal) and each rank's
bytes written (every rank writes a share either way), and the time to read the sharded checkpoint back on 1 process.

    .venv/bin/python scripts/bench_sharding.py [--width 128] [--work_dir DIR]

The model is the 12-layer preset with the UNet's channels cut to --width (128: about 250 M trained parameters, so
that AdamW and the EMA weigh gigabytes and both layouts fit a 24 GiB machine side by side), trained for 2 updates
of batch 1 at 64 px on a synthetic corpus, with EMA, saving at update 2. Peak memory is each rank's VmHWM, polled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GIB = 2**30


def model_folder(work: str, width: int) -> str:
    folder = os.path.join(work, "model")
    shutil.copytree(os.path.join(ROOT, "ldm", "models", "presets", "ldm-12layer"), folder)
    path = os.path.join(folder, "unet", "config.json")
    with open(path) as f:
        config = json.load(f)
    config["block_out_channels"] = [width, 2 * width, 4 * width, 4 * width]
    with open(path, "w") as f:
        json.dump(config, f)
    return folder


def bench_args(work: str, width: int) -> list[str]:
    """The training flags the checkpoint benchmarks share: the cut-down 12-layer model (`model_folder`) on a
    synthetic corpus of 64 records made in `work`, batch 1 at 64 px, EMA on, no trackers."""
    from ldm.prepare.synth import synth_corpus

    listing = synth_corpus(os.path.join(work, "corpus"), 64, resolution=64, seed=0, records_per_shard=16)
    return ["--pretrained_model_name_or_path", model_folder(work, width), "--allow_untrained_vae", "--file_list",
            listing, "--tokenizer_name", os.path.join(work, "corpus", "tokenizer"), "--model_max_length", "16",
            "--resolution", "64", "--train_batch_size", "1", "--num_workers", "0", "--use_ema", "--report_to", "none",
            "--progress", "none"]


def peak_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return 0


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def run(command: list[str], cwd: str) -> tuple[str, dict[int, int]]:
    """(output, {pid: peak bytes}) of `command` and its processes' children (the ranks)."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    while process.poll() is None:
        for pid in [process.pid, *children(process.pid)]:
            peaks[pid] = max(peaks.get(pid, 0), peak_of(pid))
        time.sleep(0.2)
    reader.join()
    if process.returncode != 0:
        raise SystemExit("".join(lines)[-4000:])
    return "".join(lines), peaks


def logs(folder: str) -> str:
    text = ""
    for name in sorted(os.listdir(folder)):
        if name.startswith("workerlog"):
            with open(os.path.join(folder, name)) as f:
                text += f.read()
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-sharding-")
    os.makedirs(work, exist_ok=True)
    common = bench_args(work, args.width) + ["--max_train_steps", "2", "--save_steps", "2"]
    script = os.path.join(ROOT, "train_txt2img_laion400m_no_trainer.py")
    results = {}
    for name, extra in (("unsharded", []), ("stage1", ["--sharding", "stage1"])):
        out, log_dir = os.path.join(work, name), os.path.join(work, f"logs-{name}")
        _, peaks = run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
                        log_dir, script, *common, *extra, "--output_dir", out], work)
        with open(os.path.join(out, "run.json")) as f:
            memory = json.load(f)["memory"]["ranks"]
        text = logs(log_dir)
        saved = re.search(r"saved \S+checkpoint-2 \([\d.]+ GiB\): snapshot ([\d.]+) s, written and sealed ([\d.]+) s",
                          text)
        ranks = sorted(peaks.values(), reverse=True)[:2]  # the two ranks (the launcher is small)
        written = [sum(os.path.getsize(os.path.join(root, n)) for root, _, names in
                       os.walk(os.path.join(out, "checkpoint-2")) for n in names if f"-{r:05d}-of-00002." in n) / GIB
                   for r in (1, 2)]
        results[name] = {"optimizer_gib": [r["optimizer"] / GIB for r in memory], "ema_gib": [r["ema"] / GIB
                         for r in memory], "peak_rss_gib": [p / GIB for p in ranks],
                         "save_seconds": float(saved.group(1)) + float(saved.group(2)),
                         "written_gib_by_rank": written}
        print(name, json.dumps(results[name]), flush=True)
    out = os.path.join(work, "one")
    os.makedirs(out)
    for name in ("checkpoint-2", "run.json", "vqvae"):
        source = os.path.join(work, "stage1", name)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(out, name))
    text, _ = run([sys.executable, script, *common, "--max_train_steps", "3", "--output_dir", out,
                   "--resume_from_checkpoint", "latest"], work)
    read = re.search(r"resumed from \S+ at update 2 \(read in ([\d.]+) s\)", text)
    print("resume 2 sharded -> 1:", read.group(1) if read else "?", "s")


if __name__ == "__main__":
    main()
