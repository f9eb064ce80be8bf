"""What a card holds: the per-rank state of a preset under DDP and sharding (`ldm.train.memory`, the numbers a run
records in run.json), and the activations of one training step measured on this CPU.

    .venv/bin/python scripts/bench_memory.py [--presets ldm-32layer ldm-12layer sd-1.5] [--cards 8 64]
    .venv/bin/python scripts/bench_memory.py --activations ldm-12layer --resolution 256 --batch 1

The state table builds each preset once on the CPU (ldm-32layer: 5.5 GB, about a minute) and counts; a preset with
a T5 encoder (T5-XXL: 19 GB of float32 weights) is built with copies of 1 and 2 of its layers, as model_report.py
counts it, and its frozen part grown by the further layers (nothing else depends on them). The
activation measurement builds the model, runs one forward and backward pass of the LDM loss (UNet and LDMBert
trained, or a Stable Diffusion preset's UNet with its CLIP text encoder frozen; the autoencoder encoding), with and
without recompute, each in a fresh process, and reports the peak resident memory (VmHWM) less what was resident
before the step and the gradients the step allocated.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

GIB = 2**30


def layouts(preset: str, cards: list[int], ema: bool) -> list[dict]:
    import os
    import tempfile

    from model_report import few_layers, t5_layers

    layers = t5_layers(preset)
    if layers is None:
        return counted_layouts(preset, preset, cards, ema)
    with tempfile.TemporaryDirectory() as temp:
        one, two = (counted_layouts(preset, few_layers(preset, n, os.path.join(temp, str(n))), cards, ema)
                    for n in (1, 2))
    # the first layer (with the relative position table) and the embedding, plus the further layers, each as the second
    return [{**a, **{k: a[k] + (layers - 1) * (b[k] - a[k]) for k in a if isinstance(a[k], float)}}
            for a, b in zip(one, two, strict=True)]


def counted_layouts(preset: str, source: str, cards: list[int], ema: bool) -> list[dict]:
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion
    from ldm.train.memory import memory_by_rank

    parts = build_components(source, vocab_size=30522, model_max_length=77)
    model = LatentDiffusion(parts.unet, parts.text_encoder, parts.vae, parts.noise_scheduler,
                            freeze_text_encoder=not parts.family.trained_by_default)  # as a run of it trains
    rows = []
    for world in cards:
        for name, degree in (("DDP", 1), ("stage1", world)):
            memory = memory_by_rank(model, world_size=world, sharding_degree=degree, ema=ema)
            largest = max(memory["ranks"], key=lambda rank: sum(rank.values()))
            rows.append({"preset": preset, "cards": world, "layout": name, **{k: v / GIB for k, v in largest.items()},
                         "total": sum(largest.values()) / GIB})
    return rows


STEP = r"""
import json, sys, time
import paddle
from ldm.models.build import build_components
from ldm.models.diffusion import LatentDiffusion
from ldm.runtime.device import use_fast_cpu_kernels

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

preset, resolution, batch, recompute = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
use_fast_cpu_kernels()
parts = build_components(preset, vocab_size=30522, model_max_length=77)
model = LatentDiffusion(parts.unet, parts.text_encoder, parts.vae, parts.noise_scheduler, recompute=recompute,
                        freeze_text_encoder=not parts.family.trained_by_default)
model.train()
batch_data = {"pixel_values": paddle.uniform([batch, 3, resolution, resolution], min=-1, max=1),
              "input_ids": paddle.randint(1, 30000, [batch, 77])}
before = rss("VmRSS")
start = time.perf_counter()
model(**batch_data).backward()
seconds = time.perf_counter() - start
grads = sum(int(p.grad.numel()) * p.grad.element_size() for p in model.parameters() if p.grad is not None)
print(json.dumps({"before": before, "peak": rss("VmHWM"), "gradients": grads, "seconds": seconds}))
"""


def activations(preset: str, resolution: int, batch: int) -> list[dict]:
    rows = []
    for recompute in (False, True):
        done = subprocess.run([sys.executable, "-c", STEP, preset, str(resolution), str(batch), str(int(recompute))],
                              capture_output=True, text=True, check=True)
        found = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"preset": preset, "recompute": recompute, "resolution": resolution, "batch": batch,
                     "activations_gib": (found["peak"] - found["before"] - found["gradients"]) / GIB,
                     "gradients_gib": found["gradients"] / GIB, "step_seconds": found["seconds"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["ldm-32layer", "ldm-12layer"])
    parser.add_argument("--cards", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--no_ema", dest="ema", action="store_false")
    parser.add_argument("--activations", metavar="PRESET", help="measure one training step's activations instead")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    if args.activations:
        for row in activations(args.activations, args.resolution, args.batch):
            print(json.dumps(row))
        return
    print("| preset | cards | layout | weights | gradients | optimizer | EMA | frozen | total (GiB, largest rank) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for row in layouts(preset, args.cards, args.ema):
            print(f"| `{row['preset']}` | {row['cards']} | {row['layout']} | {row['weights']:.2f} | "
                  f"{row['gradients']:.2f} | {row['optimizer']:.2f} | {row['ema']:.2f} | {row['frozen']:.2f} | "
                  f"{row['total']:.2f} |")


if __name__ == "__main__":
    main()
