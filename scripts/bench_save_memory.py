"""Peak host memory through a synchronous save and an export, against the state held, in one run of this script.

    .venv/bin/python scripts/bench_save_memory.py [--width 64] [--baseline a794575] [--limit_gib 5.5] [--work_dir DIR]

One run of the hand-written loop on one process (`--async_save false`, EMA on, LDMBert trained: the flags of
`scripts/bench_checkpoint.py`, the 12-layer preset with the UNet's channels cut to --width; `--width 0` keeps the
preset's), 2 updates saved at update 2, then the export at the end of the run; then `python -m ldm.export` of that
checkpoint in a process of its own. Around the final save (`CheckpointManager.save`), the end-of-run export and the
standalone export (`ldm.inference.export.export_checkpoint`: loading the checkpoint, applying its EMA, writing the
pipeline; and the writing alone, `export_pipeline`) the process's peak resident memory is reset
(`/proc/self/clear_refs`) and read back (VmHWM) afterwards, against what was resident before:

  peak/before   how many times the memory the process held before the step it held at the step's peak (a save that
                doubles host memory: 2.0)
  added         peak less before, in GiB and as a share of `state`: the state the step writes (the save: the
                checkpoint's bytes; an export: the pipeline's weights); streaming, it stays near the largest tensor

`--baseline REV` measures the tree of that commit too (extracted with `git archive` into the work folder), in the same
run, so that before and after stand side by side. A process whose resident memory passes --limit_gib is killed (the
machine is shared): its row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_sharding import bench_args  # noqa: E402

GIB = 2**30

# Runs in the measured process, with the tree measured first on sys.path: each measured call is wrapped so that
# the peak resident memory is reset before it and read after it (both trees have these names).
PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
tree, report, what, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

active = []  # the measured calls under way, outermost first: a call inside another resets the peak it also needs

def measured(name, fn, size):
    def call(*args, **kwargs):
        for frame in active:
            frame["peak"] = max(frame["peak"], status("VmHWM"))
        frame = {"peak": 0, "before": status("VmRSS")}
        active.append(frame)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on
        result = fn(*args, **kwargs)
        active.pop()
        row = {"step": name, "before": frame["before"], "peak": max(frame["peak"], status("VmHWM")),
               "state": size(result)}
        with open(report, "a") as f:
            f.write(json.dumps(row) + "\n")
        return result
    return call

def folder_bytes(path, suffix=".safetensors"):
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names
               if n.endswith(suffix))

import ldm.inference.export as export
export.export_pipeline = measured("the pipeline's writing alone (within the next row)", export.export_pipeline,
                                  folder_bytes)
export.export_checkpoint = measured("export at the end of the run" if what == "train" else "python -m ldm.export",
                                    export.export_checkpoint, lambda result: folder_bytes(result[0]))
if what == "train":
    from ldm.checkpoint.manager import CheckpointManager
    CheckpointManager.save = measured("synchronous save", CheckpointManager.save, folder_bytes)
    sys.argv = ["train_txt2img_laion400m_no_trainer.py", *argv]
    import runpy
    runpy.run_path(os.path.join(tree, "train_txt2img_laion400m_no_trainer.py"), run_name="__main__")
else:
    from ldm.export import main
    sys.exit(main(argv))
"""


def watched(command: list[str], limit: int, cwd: str) -> tuple[int, str]:
    """Run `command`, killing it when its resident memory passes `limit` bytes (0: no limit); (exit code, stderr)."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = []

    def guard() -> None:
        while process.poll() is None:
            try:
                with open(f"/proc/{process.pid}/status") as f:
                    rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
            except (OSError, StopIteration):
                rss = 0
            if limit and rss > limit:
                killed.append(rss)
                process.kill()
            time.sleep(0.02)

    thread = threading.Thread(target=guard, daemon=True)
    thread.start()
    _, stderr = process.communicate()
    thread.join()
    if killed:
        return -9, f"killed at {killed[0] / GIB:.2f} GiB resident (--limit_gib)"
    return process.returncode, stderr


def measure(tree: str, work: str, common: list[str], limit: int) -> list[dict]:
    """The rows of one tree: its run's save and export, then the standalone export of its checkpoint."""
    report, out = os.path.join(work, "report.jsonl"), os.path.join(work, "run")
    open(report, "w").close()
    code, stderr = watched([sys.executable, "-c", PROBE, tree, report, "train", *common, "--output_dir", out],
                           limit, tree)
    failures = [] if code == 0 else [f"training run: exit {code}: {stderr.strip().splitlines()[-1:]}"]
    if code == 0:
        code, stderr = watched([sys.executable, "-c", PROBE, tree, report, "export", "--checkpoint",
                                os.path.join(out, "checkpoint-2"), "--output", os.path.join(work, "exported")],
                               limit, tree)
        if code != 0:
            failures.append(f"python -m ldm.export: exit {code}: {stderr.strip().splitlines()[-1:]}")
    with open(report) as f:
        rows = [json.loads(line) for line in f]
    return rows, failures


def baseline_tree(rev: str, work: str) -> str:
    target = os.path.join(work, f"tree-{rev}")
    os.makedirs(target, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--baseline", metavar="REV", help="also measure the tree of this commit (before and after)")
    parser.add_argument("--limit_gib", type=float, default=5.5,
                        help="kill a process past this resident memory; 0: no limit")
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-save-memory-")
    os.makedirs(work, exist_ok=True)
    common = bench_args(work, args.width) if args.width else bench_args(work, 320)
    common += ["--max_train_steps", "2", "--save_steps", "2", "--async_save", "false", "--seed", "1"]
    trees = ([(f"before ({args.baseline})", baseline_tree(args.baseline, work))] if args.baseline else []) + \
        [("this tree", ROOT)]
    print("| tree | step | state (GiB) | resident before | peak | peak/before | added (GiB) | added/state |")
    print("|---|---|---|---|---|---|---|---|")
    for label, tree in trees:
        folder = os.path.join(work, label.split()[0])
        os.makedirs(folder, exist_ok=True)
        rows, failures = measure(tree, folder, common, int(args.limit_gib * GIB))
        for row in rows:
            added = row["peak"] - row["before"]
            print(f"| {label} | {row['step']} | {row['state'] / GIB:.2f} | {row['before'] / GIB:.2f} | "
                  f"{row['peak'] / GIB:.2f} | {row['peak'] / row['before']:.2f} | {added / GIB:.2f} | "
                  f"{added / row['state']:.2f} |", flush=True)
        for failure in failures:
            print(f"| {label} | {failure} | | | | | | |", flush=True)


if __name__ == "__main__":
    main()
