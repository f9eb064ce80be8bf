"""Random faults, then one invariant over the whole history: a chaos soak of the training entry points.

    python scripts/soak.py --minutes 30 --seed 1 [--paths loop trainer] [--work_dir DIR] [--model sd]

Run after run (a chain of segments toward one run's last update, in one output folder), it launches the
hand-written loop or the PaddleNLP Trainer path with `--resume_from_checkpoint auto` on a synthetic corpus,
on 1 or 2 processes with 0 to 3 loader workers (the layout changes from segment to segment), and at a random
moment injects one fault:

  sigterm        SIGTERM to the processes (a graceful stop: every rank saves the update it is in)
  kill_all       SIGKILL to every process
  kill_one       SIGKILL to one rank (the launcher ends the other)
  kill_in_save   SIGKILL the moment a checkpoint is begun (its snapshot)
  kill_in_write  SIGKILL while a checkpoint's files are being written in the background
  disk_full      a file-size limit (RLIMIT_FSIZE) below a checkpoint's size: the background write fails and
                 the run ends at the next update with one line
  damage         between two segments, bytes flipped in (or cut off) the newest checkpoint's weights, which
                 the next start must skip (only when an older complete checkpoint is there to fall back on)
  nan            the loss of some of the segment's batches is NaN (the tests-only `LDM_TEST_NAN_BATCHES`
                 hook of `ldm.train.objective`): the guard must skip those updates on every rank
  bad_shard      between two segments, a shard of the corpus cut in half (once a run): its records past the
                 break become unusable and are counted, the rest still read once

Checkpoints are saved at every update, so a save is often due while the previous one is still being written
(counted); a segment waits for each save (`--async_save false`) with probability --sync_save.
A 2-process segment is sharded (`--sharding stage1`: optimizer state, EMA and the checkpoint's files split over
the ranks) with probability --sharding, so runs resume sharded from unsharded checkpoints and back, and on 1
process from sharded ones; every run keeps an EMA.

(a segment gets one of the first five, with probability --clean none, and independently the others, each with
its own probability). Afterwards it checks:

- the consumption ledger (`LDM_DATA_CONSUMED_LOG`: each record of each batch a trainer took, with its rank and
  batch number), cut at the checkpoints the final weights descend from (a segment's records past the
  checkpoint the next segment resumed from are rolled back), holds every usable record of every completed
  pass exactly once and no record of any pass twice;
- no checkpoint holds non-finite weights; every segment ends within --segment_seconds (no hang); after each
  segment no process of it is left and no shared-memory segment is added; the run's exported pipeline loads.

First, a run stopped by SIGTERM only, on one layout (2 processes, sharded), must end with the weights of the same
run uninterrupted, to the bit. Its last line: `soak: <segments> segments, <faults> faults, <records> records audited,
<violations> violations`; it exits 1 when there is a violation. A stalled read is not injected (a shard that
never answers would hang the start's check of the shards, which has no timeout; `--data_timeout` is tested on its
own in the suite).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ldm.checkpoint.run_folder import checkpoint_dirs, checkpoint_problem, checkpoint_step, latest_checkpoint  # noqa: E402
from ldm.data.dataset import CONSUMED_LOG  # noqa: E402
from ldm.train.objective import NAN_FAULT  # noqa: E402

KILLS = ("sigterm", "kill_all", "kill_one", "kill_in_save", "kill_in_write", "disk_full")
FAULTS = (*KILLS, "damage", "nan", "bad_shard")
FILE_SIZE_LIMIT = 2 << 20  # bytes: below a checkpoint's largest file (the tiny UNet's weights are 3.2 MB)
SCRIPTS = {"loop": "train_txt2img_laion400m_no_trainer.py", "trainer": "train_txt2img_laion400m_trainer.py"}


@dataclass
class Segment:
    index: int
    path: str
    processes: int
    workers: int
    start_step: int
    fault: str = "none"
    seconds: float = 0.0
    exit_code: int | None = None
    ledger: str = ""
    fault_time: float | None = None
    buckets: bool = False  # trained in aspect-ratio buckets (`--aspect_buckets auto`)
    sharded: bool = False  # optimizer state, EMA and checkpoint writing sharded over its 2 processes (`--sharding`)
    sync_save: bool = False  # every save waited for (`--async_save false`)


@dataclass
class Report:
    segments: int = 0
    faults: Counter = field(default_factory=Counter)
    records: int = 0
    overlapping_saves: int = 0  # saves due while the previous one was still being written
    violations: list[str] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    healing: list[float] = field(default_factory=list)  # no person: seconds from a kill to the next update

    def violation(self, text: str) -> None:
        self.violations.append(text)
        print(f"VIOLATION: {text}", flush=True)


# -- the corpus ---------------------------------------------------------------------------------------------
def make_corpus(folder: str, records: int, per_shard: int) -> tuple[str, str, set[tuple[str, int]]]:
    """(list of filelists, tokenizer folder, every record as (shard path, line)) of a captioned-shapes corpus."""
    from ldm.data.filelist import read_file_list
    from ldm.data.readers import count_records
    from ldm.prepare.synth import synth_corpus

    # shapes on canvases of random aspect ratios: segments in aspect-ratio buckets have several to fill
    listing = synth_corpus(folder, records, resolution=32, seed=0, records_per_shard=per_shard, max_aspect_ratio=2.0)
    everything = {(shard.path, n) for shard in read_file_list(listing)
                  for n in range(1, count_records(shard.path) + 1)}
    return listing, os.path.join(folder, "tokenizer"), everything


# --model: the preset whose pipeline, with seeded weights, the runs train (its text encoders frozen)
PIPELINES = {"sd": "sd-tiny", "pixart": "pixart-tiny", "pixart-ms": "pixart-ms-tiny", "sd3": "sd3-tiny",
             "sdxl": "sdxl-tiny"}


def model_flags(kind: str, tokenizer: str, folder: str) -> list[str]:
    """The flags that name the model the runs train: ldm-tiny (LDMBert trained with the UNet) from scratch, or a
    pipeline of a frozen-encoder family's tiny architecture (`PIPELINES`: Stable Diffusion's CLIP, PixArt-α's DiT and
    T5, SD3's MMDiT and three encoders, SDXL's UNet and two encoders), written here with seeded weights, its text
    encoders frozen and written once beside the checkpoints."""
    if kind == "ldm-tiny":
        return ["--model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--tokenizer_name", tokenizer]
    from ldm.inference.export import export_pipeline
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components
    from ldm.models.noise import scheduler_config

    parts = build_components(PIPELINES[kind], seed=5)
    export_pipeline(parts.unet, parts.text_encoder, parts.vae, load_tokenizer_of(parts.family, os.path.join(
        parts.source, "tokenizer")), scheduler_config(parts.noise_scheduler), folder)
    return ["--model_name_or_path", folder]


def own_corpus(corpus, out: str):
    """A copy of the corpus for one run (a run may cut one of its shards): (listing, model flags, every record)."""
    listing, model, everything = corpus
    source = os.path.dirname(listing)
    copy = out + "-corpus"
    shutil.copytree(source, copy, dirs_exist_ok=True)
    return (os.path.join(copy, os.path.basename(listing)), model,
            {(os.path.join(copy, os.path.relpath(shard, source)), n) for shard, n in everything})


def cut_a_shard(listing: str, rng: random.Random) -> str:
    from ldm.data.filelist import read_file_list

    path = rng.choice(read_file_list(listing)).path
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return path


def command(path: str, processes: int, workers: int, listing: str, model: list[str], out: str, last_step: int,
            log_dir: str, buckets: bool = False, sharded: bool = False, sync_save: bool = False) -> list[str]:
    common = [*model, "--file_list", listing,
              "--model_max_length", "16", "--resolution", "32", "--seed", "11", "--report_to", "none",
              "--output_dir", out, "--resume_from_checkpoint", "auto", "--shuffle_buffer", "4",
              "--logging_steps", "1", "--progress", "none", "--use_ema"] + \
        (["--aspect_buckets", "auto"] if buckets else []) + (["--sharding", "stage1"] if sharded else []) + \
        (["--async_save", "false"] if sync_save else [])
    if path == "loop":
        args = ["--train_batch_size", "2", "--num_workers",
                str(workers), "--max_train_steps", str(last_step), "--save_steps", "1",
                "--checkpoints_total_limit", "4"]
    else:
        args = ["--do_train", "--per_device_train_batch_size", "2",
                "--dataloader_num_workers", str(workers), "--max_steps", str(last_step), "--save_steps", "1",
                "--save_total_limit", "4"]
    script = os.path.join(ROOT, SCRIPTS[path])
    launch = [] if processes == 1 else ["-m", "paddle.distributed.launch", "--nproc_per_node", str(processes),
                                        "--log_dir", log_dir]
    return [sys.executable, *launch, script, *common, *args]


# -- faults -------------------------------------------------------------------------------------------------
def process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, start time)} of every process (the start time tells a reused pid apart)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), fields[19])
            except (OSError, IndexError, ValueError):
                continue
    return table


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of `root` and every process below it. `paddle.distributed.launch` starts each rank in a
    session of its own, so a process group does not hold them: the tree does (while the launcher lives)."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return found


def alive(seen: dict[int, str]) -> list[int]:
    """Those of `seen` (pid: start time) still running."""
    table = process_table()
    return [pid for pid, started in seen.items() if pid in table and table[pid][1] == started]


def all_gone(seen: dict[int, str], report: Report, what: str) -> None:
    """After a segment: every process of it gone within 15 s (ranks the launcher ended, or a rank whose peer was
    killed, take a few seconds), else a violation and they are killed."""
    left = alive(seen)
    for _ in range(150):
        if not left:
            return
        time.sleep(0.1)
        left = alive(seen)
    report.violation(f"{what}: {len(left)} process(es) left 15 s after it ended")
    kill_all(seen)


def kill_all(seen: dict[int, str]) -> None:
    for pid in alive(seen):
        with _quiet():
            os.kill(pid, signal.SIGKILL)


def rank_pids(root: int) -> list[int]:
    """The training processes below `root`: those running a training script, not the launcher, not loader
    workers (children of a rank)."""
    found = []
    tree = descendants(root)
    for pid in tree:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        launchers = (b"paddle.distributed.launch", b"ldm.launch")
        if any(a.endswith(b".py") and b"train_txt2img" in a for a in argv) and not any(m in argv for m in launchers):
            found.append(pid)
    parents = process_table()
    return [pid for pid in found if parents.get(pid, (0, ""))[0] not in found]  # not a rank's loader worker


def damage_newest(out: str, rng: random.Random) -> str | None:
    """Flip or cut bytes of the newest checkpoint's UNet weights, if an older complete one remains to resume."""
    complete = [c for c in checkpoint_dirs(out) if checkpoint_problem(c, checksums=False) is None]
    if len(complete) < 2:
        return None
    target = os.path.join(complete[-1], "unet", "diffusion_paddle_model.safetensors")
    if not os.path.isfile(target):
        candidates = [os.path.join(r, n) for r, _, names in os.walk(complete[-1]) for n in names
                      if n.endswith(".safetensors")]
        target = candidates[0]
    size = os.path.getsize(target)
    with open(target, "r+b") as f:
        if rng.random() < 0.5:
            f.truncate(size // 2)
        else:
            f.seek(rng.randrange(size))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return complete[-1]


def saved_since(out: str, since: float) -> int:
    """The newest checkpoint written after the wall-clock time `since` (0: none)."""
    steps = [0]
    for folder in checkpoint_dirs(out):
        with _quiet():
            if os.path.getmtime(folder) > since:
                steps.append(checkpoint_step(folder) or 0)
    return max(steps)


def wait_for_progress(out: str, since: float, process: subprocess.Popen, deadline: float,
                      seen: dict[int, str]) -> bool:
    """Until the segment has saved a checkpoint (or ended): True if it did. `seen` collects its processes."""
    while time.monotonic() < deadline and process.poll() is None:
        seen.update(descendants(process.pid))
        if saved_since(out, since):
            return True
        time.sleep(0.05)
    return False


def inject(fault: str, out: str, process: subprocess.Popen, rng: random.Random, deadline: float, since: float,
           seen: dict[int, str]) -> float | None:
    """Carry out a fault on the running segment; the time it happened (None if the segment ended first). `seen`
    collects every process of the segment."""
    root = process.pid
    if fault in ("kill_in_save", "kill_in_write"):
        while time.monotonic() < deadline and process.poll() is None:
            seen.update(descendants(root))
            for name in os.listdir(out):
                with _quiet():
                    temp = os.path.join(out, name)
                    if name.startswith(".tmp-checkpoint-") and os.path.getmtime(temp) > since and (
                            fault == "kill_in_save" or writing(temp)):
                        kill_all({**seen, **descendants(root)})
                        return time.monotonic()
            time.sleep(0.002)
        return None
    time.sleep(rng.uniform(0, 1.5))
    if process.poll() is not None:
        return None
    seen.update(descendants(root))
    if fault == "sigterm":
        for pid in rank_pids(root) or [root]:
            with _quiet():
                os.kill(pid, signal.SIGTERM)
    elif fault == "kill_all":
        kill_all(seen)
    elif fault == "kill_one":
        ranks = rank_pids(root)
        with _quiet():
            os.kill(rng.choice(ranks) if ranks else root, signal.SIGKILL)
    return time.monotonic()


def writing(temp: str) -> bool:
    """Whether a checkpoint's temporary folder holds weights or state being written (and no manifest yet)."""
    names = [n for _, _, files in os.walk(temp) for n in files]
    return any(n.endswith(".safetensors") for n in names) and "manifest.json" not in names


class _quiet:
    """Ignores a process or a file that went away meanwhile."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, ProcessLookupError | FileNotFoundError)


# -- checks -------------------------------------------------------------------------------------------------
def shared_memory() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def check_finite(out: str, report: Report, checked: set[str]) -> None:
    import numpy as np
    from safetensors.numpy import load_file

    for folder in checkpoint_dirs(out):
        if folder in checked or checkpoint_problem(folder, checksums=False) is not None:
            continue
        checked.add(folder)
        for root, _, names in os.walk(folder):
            for name in names:
                if name.endswith(".safetensors"):
                    try:
                        arrays = load_file(os.path.join(root, name))
                    except Exception:  # noqa: BLE001 - a damaged file: the damage fault's, skipped by resuming
                        continue
                    for key, value in arrays.items():
                        if value.dtype.kind == "f" and not np.isfinite(value).all():
                            report.violation(f"{folder}/{name}: {key} holds non-finite values")


def audit(segments: list[Segment], final_step: int, out: str, everything: set[tuple[str, int]],
          report: Report) -> None:
    """The records the final weights were trained on: each segment's, cut where the next one resumed."""
    kept: list[tuple[int, str, str, int]] = []  # (update, pass, shard, line)
    for segment in segments:
        kept = [entry for entry in kept if entry[0] <= segment.start_step]
        if not os.path.exists(segment.ledger):
            continue
        with open(segment.ledger) as f:
            for row in f:
                pass_index, _, shard, line, _, _, batch = row.split()
                kept.append((segment.start_step + int(batch) + 1, pass_index, shard, int(line)))
    kept = [entry for entry in kept if entry[0] <= final_step]
    report.records += len(kept)
    final = latest_checkpoint(out)
    with open(os.path.join(final, "training_state.json")) as f:
        state = json.load(f)
    streams = find_streams(state)
    slots = [slot for rank in streams for slot in rank["slots"].values()]
    complete_below = min(int(slot["pass"]) for slot in slots) if slots else 0
    if len(slots) < sum(max(1, int(rank["num_workers"])) for rank in streams):
        # a slot that took no batch since a layout change is still at the start of the plan it resumed with
        schedule = next((rank["schedule"] for rank in streams if rank.get("schedule")), None)
        first = (schedule["plan"][0]["pass"] if schedule["plan"] else schedule["next_pass"]) if schedule else 0
        complete_below = min(complete_below, int(first))
    by_pass: dict[str, Counter] = {}
    for _, pass_index, shard, line in kept:
        by_pass.setdefault(pass_index, Counter())[(shard, line)] += 1
    usable = usable_records_of(everything)
    for pass_index in map(str, range(complete_below)):  # a complete pass nothing was trained on is a violation too
        by_pass.setdefault(pass_index, Counter())
    for pass_index, records in sorted(by_pass.items(), key=lambda item: int(item[0])):
        twice = [r for r, n in records.items() if n > 1]
        if twice:
            report.violation(f"pass {pass_index}: {len(twice)} record(s) trained on more than once, e.g. {twice[0]}")
        strange = set(records) - everything
        if strange:
            report.violation(f"pass {pass_index}: {len(strange)} record(s) that are not in the corpus")
        if int(pass_index) < complete_below and not usable <= set(records):
            missing = usable - set(records)
            report.violation(f"pass {pass_index} is complete but {len(missing)} usable record(s) were never trained "
                             f"on, e.g. {sorted(missing)[:1]}")
    print(f"  audit: {len(kept)} records up to update {final_step}, passes {sorted(by_pass, key=int)}, "
          f"complete below pass {complete_below}", flush=True)


def usable_records_of(everything: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """The records of the corpus that can still be read (all of them unless a shard was cut)."""
    from ldm.data.readers import iter_records
    from ldm.data.shard import ShardError

    found = set()
    for path in sorted({shard for shard, _ in everything}):
        try:
            for number, _ in iter_records(path):
                found.add((path, number))
        except ShardError:
            continue
    return found


def find_streams(state) -> list[dict]:
    """Every rank's stream state in a training_state.json (its arrays stored apart: only the JSON is read)."""
    if isinstance(state, dict):
        if "stream" in state and isinstance(state["stream"], list):
            return state["stream"]
        for value in state.values():
            found = find_streams(value)
            if found:
                return found
    return []


def pipeline_loads(out: str, report: Report) -> None:
    """The exported pipeline loads in ppdiffusers, in a new process, after its family's `prepare_library` (PixArt's
    transformer cannot be built by ppdiffusers 0.29 as it ships: docs/interop.md)."""
    check = ("import sys\n"
             "from ppdiffusers import DiffusionPipeline\n"
             "from ldm.models.families import folder_family\n"
             "family = folder_family(sys.argv[1])\n"
             "if family is not None:\n"
             "    family.prepare_library()\n"
             "DiffusionPipeline.from_pretrained(sys.argv[1])\n")
    result = subprocess.run([sys.executable, "-c", check, os.path.join(out, "pipeline")], capture_output=True,
                            text=True)
    if result.returncode != 0:
        report.violation(f"the exported pipeline of {out} does not load: {result.stderr.strip()[-300:]}")


# -- the soak -----------------------------------------------------------------------------------------------
def run_chain(chain: int, path: str, work: str, corpus, args, rng: random.Random, report: Report,
              stop_at: float, graceful: tuple[int, int] | None = None, last_step: int | None = None,
              name: str | None = None) -> str:
    """One run through segments until it ends; its folder. `graceful` (processes, workers): every segment on that
    layout, and SIGTERM the only fault."""
    out = os.path.join(work, name or f"run{chain}-{path}")
    listing, model, everything = corpus if graceful else own_corpus(corpus, out)
    ledgers = os.path.join(work, f"ledger-{os.path.basename(out)}")
    os.makedirs(ledgers, exist_ok=True)
    last_step = last_step or rng.randint(*args.run_updates)
    segments: list[Segment] = []
    checked: set[str] = set()
    recovery_from: float | None = None
    shard_cut = None
    print(f"run {chain}: {path}, {last_step} updates, in {out}", flush=True)
    while True:
        # out of time or of segments: the run is finished without faults
        if args.segments:  # a count, whatever the time: the last segment runs to the end
            finishing = len(segments) >= args.segments - 1
        else:
            finishing = len(segments) >= args.max_segments_per_run or (time.monotonic() > stop_at and bool(segments))
        if not finishing and graceful is None and os.path.isdir(out) and rng.random() < args.damage:
            damaged = damage_newest(out, rng)
            if damaged:
                report.faults["damage"] += 1
                print(f"  damaged {damaged}", flush=True)
        if (not finishing and graceful is None and not shard_cut and os.path.isdir(out)
                and rng.random() < args.bad_shard):
            shard_cut = cut_a_shard(listing, rng)
            report.faults["bad_shard"] += 1
            print(f"  cut {shard_cut} in half", flush=True)
        newest = latest_checkpoint(out) if os.path.isdir(out) else None
        start = checkpoint_step(newest) if newest else 0
        processes, workers = graceful or (rng.choice((1, 2)), rng.randint(0, 3))
        fault = "none" if finishing or rng.random() < args.clean else "sigterm" if graceful else rng.choice(KILLS)
        segment = Segment(len(segments), path, processes, workers, start or 0, fault,
                          ledger=os.path.join(ledgers, f"segment{len(segments)}.log"),
                          buckets=True if graceful else rng.random() < args.buckets,
                          sharded=processes == 2 and (graceful is not None or rng.random() < args.sharding),
                          sync_save=graceful is None and rng.random() < args.sync_save)
        log_dir = os.path.join(work, f"logs{chain}-{segment.index}")
        env = {**os.environ, CONSUMED_LOG: segment.ledger, "PYTHONUNBUFFERED": "1"}
        nan_batches = []
        if not finishing and graceful is None and rng.random() < args.nan:
            nan_batches = sorted(rng.sample(range(2, 9), 2))
            env[NAN_FAULT] = ",".join(map(str, nan_batches))
        limit = None
        if fault == "disk_full":
            def limit():
                resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
        before_shm = shared_memory()
        began, began_wall = time.monotonic(), time.time()
        with open(os.path.join(work, f"segment{chain}-{segment.index}.log"), "w") as log:
            process = subprocess.Popen(command(path, processes, workers, listing, model, out, last_step, log_dir,
                                               segment.buckets, segment.sharded, segment.sync_save),
                                       cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)
            deadline = began + args.segment_seconds
            seen: dict[int, str] = {}
            if fault not in ("none", "disk_full") and wait_for_progress(out, began_wall, process, deadline, seen):
                segment.fault_time = inject(fault, out, process, rng, deadline, began_wall, seen)
            while process.poll() is None and time.monotonic() < deadline:
                seen.update(descendants(process.pid))
                time.sleep(0.2)
            if process.poll() is None:
                report.violation(f"run {chain} segment {segment.index} ({fault}, {processes}x{workers}) did not end "
                                 f"within {args.segment_seconds} s: killed")
                kill_all({**seen, **descendants(process.pid)})
            segment.exit_code = process.wait()
        segment.seconds = time.monotonic() - began
        segments.append(segment)
        report.segments += 1
        if fault == "disk_full":
            segment.fault_time = began
        if segment.fault_time is not None:
            report.faults[fault] += 1
        rank0_log = log.name if processes == 1 else os.path.join(log_dir, "workerlog.0")
        with open(rank0_log, errors="replace") as f:
            report.overlapping_saves += f.read().count("still being written")
        if nan_batches:
            report.faults["nan"] += 1
            with open(rank0_log, errors="replace") as f:
                text = f.read()
            trained = saved_since(out, began_wall) - segment.start_step
            if trained >= max(nan_batches) and "non-finite" not in text:
                report.violation(f"run {chain} segment {segment.index}: NaN losses at batches {nan_batches} were not "
                                 "skipped by the guard")
        if fault == "disk_full" and segment.exit_code != 0:
            with open(rank0_log, errors="replace") as f:
                last = [line for line in f.read().splitlines() if line.startswith("error:")]
            if not any("no space to write" in line or "File too large" in line for line in last):
                report.violation(f"run {chain} segment {segment.index}: the full disk did not end the run with one "
                                 f"'no space' line ({last[-1:] or 'no error line'})")
        all_gone(seen, report, f"run {chain} segment {segment.index}")
        added = {n for n in shared_memory() - before_shm if not n.startswith("sem.")}
        if added:
            report.violation(f"run {chain} segment {segment.index}: shared memory left in /dev/shm: {sorted(added)}")
        reached = saved_since(out, began_wall)
        if recovery_from is not None and reached > segment.start_step:
            report.recoveries.append(time.monotonic() - recovery_from)
            recovery_from = None
        if segment.fault_time is not None:
            recovery_from = segment.fault_time
        print(f"  segment {segment.index}: {processes}x{workers}{' in buckets' if segment.buckets else ''}"
              f"{' sharded' if segment.sharded else ''}{' sync saves' if segment.sync_save else ''} "
              f"from update {segment.start_step}, fault {fault}, "
              f"exit {segment.exit_code}, {segment.seconds:.1f} s, saved up to update {reached}", flush=True)
        check_finite(out, report, checked)
        # a SIGTERM before the handlers are set up, or after the run's last write (its final barrier and exit), ends
        # a process as the default action does (-15; a launcher: 15 or 241); a killed process may end in any way
        # but a hang
        expected_exit = {"none": (0,), "sigterm": (0, 1, 15, 143, 241, -15), "disk_full": (1, 2)}.get(fault)
        if expected_exit is not None and segment.exit_code not in expected_exit:
            report.violation(f"run {chain} segment {segment.index} ({fault}) exited {segment.exit_code}: see "
                             f"{log.name}")
            if fault == "none":
                return out
        if segment.exit_code == 0:  # the run reached its end (its last update may differ from last_step when a
            break                   # resume changed the global batch: the schedule is kept in samples)
    pipeline_loads(out, report)
    audit(segments, checkpoint_step(latest_checkpoint(out)), out, everything, report)
    return out


def healing_run(chain: int, path: str, work: str, corpus, args, rng: random.Random, report: Report) -> str:
    """No person: one job under `python -m ldm.launch` on 2 processes, whose ranks are SIGKILLed (one, or both) at
    random moments, up to --max_kills times; it must heal itself to its last update (exit 0), list every restart
    in run.json, and have trained on every record once. The time from each kill to the next update is measured."""
    from ldm.runtime.heartbeat import read_try

    out = os.path.join(work, f"heal{chain}-{path}")
    listing, model, everything = own_corpus(corpus, out)
    last_step, kills = rng.randint(*args.run_updates), rng.randint(1, args.max_kills)
    workers, sharded = rng.randint(0, 2), rng.random() < args.sharding
    logs, ledger = os.path.join(work, f"heal-logs{chain}"), os.path.join(work, f"ledger-heal{chain}-{{restarts}}.log")
    argv = command(path, 2, workers, listing, model, out, last_step, logs, sharded=sharded)
    at = argv.index("paddle.distributed.launch")
    argv[at:at + 1] = ["ldm.launch", "--max_restarts", str(kills), "--restart_pause", "0.5"]
    print(f"run {chain} (no person): {path}, {last_step} updates, 2x{workers}{' sharded' if sharded else ''}, "
          f"up to {kills} kill(s), in {out}", flush=True)
    env = {**os.environ, CONSUMED_LOG: ledger, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    began = time.monotonic()
    deadline = began + args.segment_seconds * (kills + 1)
    seen: dict[int, str] = {}
    killed: list[tuple[str, int]] = []  # (fault, the update the job had finished)
    with open(os.path.join(work, f"heal{chain}.log"), "w") as log:
        process = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        attempt, first_step, target, pending = 0, None, None, None  # pending: when the last kill was, till healed
        while process.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(process.pid))
            steps = [r["step"] for r in read_try(os.path.join(logs, "ldm-launch", f"try-{attempt}")).values()
                     if r["step"] is not None]
            if not steps:
                time.sleep(0.05)
                continue
            first_step = min(steps) if first_step is None else first_step  # the update the try resumed from
            if pending is not None and max(steps) > first_step:
                report.healing.append(time.monotonic() - pending)
                pending = None
            if target is None:  # past the last kill: two at one update would be a crash loop, which is not retried
                target = max([first_step] + [step + 1 for _, step in killed]) + rng.randint(1, 3)
            if len(killed) < kills and target <= max(steps) < last_step - 1:
                ranks = rank_pids(process.pid)
                fault = rng.choice(("kill_one", "kill_all"))
                for pid in ranks if fault == "kill_all" else rng.sample(ranks, min(1, len(ranks))):
                    with _quiet():
                        os.kill(pid, signal.SIGKILL)
                if ranks:
                    pending = time.monotonic()
                    killed.append((fault, max(steps)))
                    report.faults[fault] += 1
                    attempt, first_step, target = attempt + 1, None, None
            time.sleep(0.05)
        if process.poll() is None:
            report.violation(f"run {chain} (no person) did not end within {deadline - began:.0f} s: killed")
            kill_all({**seen, **descendants(process.pid)})
        code = process.wait()
    report.segments += len(killed) + 1
    print(f"  {len(killed)} kill(s) ({', '.join(f'{f} after update {s}' for f, s in killed)}), exit {code}, "
          f"{time.monotonic() - began:.1f} s", flush=True)
    all_gone(seen, report, f"run {chain} (no person)")
    if code != 0:
        report.violation(f"run {chain} (no person) exited {code} after {len(killed)} kill(s): see {log.name}")
        return out
    with open(os.path.join(out, "run.json")) as f:
        restarts = json.load(f).get("restarts", [])
    if len(restarts) != len(killed):
        report.violation(f"run {chain} (no person): {len(killed)} kill(s) but {len(restarts)} restart(s) in run.json")
        return out
    starts = [0] + [r["resumed_from"] or 0 for r in restarts]
    segments = [Segment(t, path, 2, workers, start, ledger=ledger.replace("{restarts}", str(t)), sharded=sharded)
                for t, start in enumerate(starts)]
    check_finite(out, report, set())
    pipeline_loads(out, report)
    audit(segments, checkpoint_step(latest_checkpoint(out)), out, everything, report)
    return out


def graceful_run(work: str, corpus, args, rng: random.Random, report: Report, stop_at: float) -> None:
    """A run stopped only gracefully, on one layout, against the same run uninterrupted: bit-identical weights."""
    layout, last_step = (2, rng.randint(0, 2)), rng.randint(*args.run_updates)
    print(f"graceful: {layout[0]}x{layout[1]} sharded, {last_step} updates, stopped by SIGTERM only, against one "
          "uninterrupted run", flush=True)
    stopped = run_chain(-1, "loop", work, corpus, argparse.Namespace(**{**vars(args), "clean": 0.0,
                                                                         "max_segments_per_run": 4}),
                        rng, report, stop_at, graceful=layout, last_step=last_step, name="graceful-stopped")
    straight = run_chain(-1, "loop", work, corpus, argparse.Namespace(**{**vars(args), "clean": 1.0}), rng, report,
                         stop_at, graceful=layout, last_step=last_step, name="graceful-straight")
    import numpy as np
    from safetensors.numpy import load_file

    def part_weights(folder: str) -> dict:  # one file, or every shard of a sharded save
        out = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    for part in ("unet", "bert"):  # bert/: when the model trains LDMBert
        if not os.path.isdir(os.path.join(latest_checkpoint(stopped), part)):
            continue
        a, b = (part_weights(os.path.join(latest_checkpoint(run), part)) for run in (stopped, straight))
        differing = [k for k in a if not np.array_equal(a[k], b[k])]
        if differing:
            report.violation(f"graceful stops changed the final {part} weights ({len(differing)} tensors, e.g. "
                             f"{differing[0]}): not bit-identical to the uninterrupted run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="start no new run after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", nargs="+", choices=sorted(SCRIPTS), default=["loop", "trainer"])
    parser.add_argument("--work_dir", default=None, help="kept afterwards (default: a temporary folder, removed)")
    parser.add_argument("--records", type=int, default=48, help="records of the synthetic corpus")
    parser.add_argument("--run_updates", type=int, nargs=2, default=(30, 60), metavar=("MIN", "MAX"),
                        help="updates of one run (a pass is 12-24 updates of batch 2 per rank on 48 records)")
    parser.add_argument("--max_segments_per_run", type=int, default=12)
    parser.add_argument("--segments", type=int, default=None, metavar="N",
                        help="every run in exactly N segments, the last one to the end without a fault, however long "
                             "they take (a test's amount of work that does not depend on the machine's speed)")
    parser.add_argument("--max_runs", type=int, default=1000)
    parser.add_argument("--clean", type=float, default=0.15, help="probability of a segment with no fault")
    parser.add_argument("--damage", type=float, default=0.25,
                        help="probability that a segment starts with the newest checkpoint damaged")
    parser.add_argument("--nan", type=float, default=0.2, help="probability of NaN losses in a segment")
    parser.add_argument("--bad_shard", type=float, default=0.1,
                        help="probability that a segment starts with a shard cut in half (once a run)")
    parser.add_argument("--buckets", type=float, default=0.5,
                        help="probability of a segment in aspect-ratio buckets (the graceful pair always is)")
    parser.add_argument("--sharding", type=float, default=0.5,
                        help="probability that a 2-process segment is sharded (--sharding stage1; the graceful pair "
                             "always is)")
    parser.add_argument("--sync_save", type=float, default=0.2,
                        help="probability that a segment waits for each save (--async_save false)")
    parser.add_argument("--segment_seconds", type=float, default=240, help="a segment running longer hangs")
    parser.add_argument("--model", choices=("ldm-tiny", *PIPELINES), default="ldm-tiny",
                        help="ldm-tiny (LDMBert trained), or a pipeline whose text encoders are frozen: sd (Stable "
                             "Diffusion, CLIP), pixart (PixArt-alpha: a DiT, T5), pixart-ms (PixArt-alpha's "
                             "multi-scale DiT: resolution and aspect-ratio conditions), sd3 (SD3: an MMDiT, "
                             "three encoders), sdxl (SDXL: a UNet, two CLIP encoders)")
    parser.add_argument("--no_graceful", dest="graceful", action="store_false",
                        help="leave out the first run (stopped by SIGTERM only, on one layout, whose final weights "
                             "must be bit-identical to the same run uninterrupted)")
    parser.add_argument("--no_person", action="store_true",
                        help="no person restarts anything: each run is one job under python -m ldm.launch whose "
                             "ranks are killed, and it must heal itself (the other faults are left out)")
    parser.add_argument("--max_kills", type=int, default=3, help="kills of one job in --no_person mode")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = args.work_dir or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(work, exist_ok=True)
    listing, tokenizer, everything = make_corpus(os.path.join(work, "corpus"), args.records, max(1, args.records // 8))
    corpus = (listing, model_flags(args.model, tokenizer, os.path.join(work, "model")), everything)
    report = Report()
    began = time.monotonic()
    stop_at = began + args.minutes * 60
    chain = 0
    try:
        if args.graceful and not args.no_person:
            graceful_run(work, corpus, args, rng, report, stop_at)
        while chain < args.max_runs and (chain == 0 or time.monotonic() < stop_at):
            if args.no_person:
                healing_run(chain, args.paths[chain % len(args.paths)], work, corpus, args, rng, report)
            else:
                run_chain(chain, args.paths[chain % len(args.paths)], work, corpus, args, rng, report, stop_at)
            chain += 1
    finally:
        if args.work_dir is None and not report.violations:
            shutil.rmtree(work, ignore_errors=True)
    faults = sum(report.faults.values())
    print(f"runs {chain}, {time.monotonic() - began:.0f} s; faults by kind: "
          f"{', '.join(f'{k} {report.faults[k]}' for k in FAULTS)}; longest recovery "
          f"{max(report.recoveries, default=0):.1f} s; saves due while the previous one was being written: "
          f"{report.overlapping_saves}")
    if args.no_person:
        healed = report.healing
        print(f"kill to the next update: {len(healed)} recoveries, mean {sum(healed) / max(1, len(healed)):.1f} s, "
              f"longest {max(healed, default=0):.1f} s")
    print(f"soak: {report.segments} segments, {faults} faults, {report.records} records audited, "
          f"{len(report.violations)} violations")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
