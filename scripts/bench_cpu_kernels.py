"""MKL's kernel choice on this CPU: the demo's training steps with `ldm.cpu`'s choice and without it.

    .venv/bin/python scripts/bench_cpu_kernels.py [--rounds 3] [--updates 10]

Each round starts two fresh processes one after the other (MKL reads its variable once, at its first
call): one as `import ldm` leaves MKL_DEBUG_CPU_TYPE (5 on an AMD CPU with AVX2, unset elsewhere),
one with it empty (MKL's own choice, the baseline). Each times a 512x512 float32 matmul, a bare
update of the demo autoencoder (x4, batch 4 of 32 px: the demo's autoencoder stage per process) and
a bare update of the demo LDM on images (batch 16, autoencoder included). The last line is the
LDM update's speed-up (baseline time / time); on a CPU where the choice changes nothing it is ~1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import paddle
from bench_train import bare_step_seconds

from ldm.args import DataArguments, ModelArguments, SamplingArguments
from ldm.cpu import choose_mkl_kernels, cpu_identity
from ldm.data.synth import synth_corpus
from ldm.models.autoencoder import AutoencoderTraining
from ldm.train import setup
from ldm.train.autoencoder import build_autoencoder
from ldm.train.loop import TextToImage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(updates: int) -> dict:
    """One process's figures: matmul GFLOP/s, autoencoder and LDM update in ms (MKL_DEBUG_CPU_TYPE was
    decided when `ldm` was imported above, before any tensor work)."""
    setup.quiet_libraries()
    a, b = paddle.randn([512, 512]), paddle.randn([512, 512])
    paddle.matmul(a, b)
    start = time.perf_counter()
    for _ in range(50):
        paddle.matmul(a, b)
    gflops = 2 * 512**3 * 50 / (time.perf_counter() - start) / 1e9

    vae, _ = build_autoencoder("ldm-demo", seed=0)
    model = AutoencoderTraining(vae, 1e-6)
    optimizer = paddle.optimizer.AdamW(2e-3, parameters=model.parameters(), weight_decay=0.0)
    pixels = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8))

    def autoencoder_step() -> None:
        model(pixels)[0].backward()
        optimizer.step()
        optimizer.clear_grad()

    for _ in range(updates):
        autoencoder_step()
    start = time.perf_counter()
    for _ in range(updates):
        autoencoder_step()
    autoencoder_ms = (time.perf_counter() - start) / updates * 1e3

    with tempfile.TemporaryDirectory(prefix="bench_cpu_kernels_") as folder:
        listing = synth_corpus(os.path.join(folder, "corpus"), num_records=64, resolution=32, records_per_shard=64)
        data = DataArguments(file_list=listing, tokenizer_name=os.path.join(folder, "corpus", "tokenizer"),
                             model_max_length=16, resolution=32, center_crop=True)
        objective = TextToImage(ModelArguments(model_name_or_path="ldm-demo", allow_untrained_vae=True), data,
                                SamplingArguments(), recompute=False, seed=0)
        ldm_ms = bare_step_seconds(objective, 16, 32, updates, 1e-4) * 1e3
    return {"matmul_gflops": gflops, "autoencoder_ms": autoencoder_ms, "ldm_ms": ldm_ms}


def run_child(updates: int, baseline: bool) -> dict:
    env = dict(os.environ)
    env.pop("MKL_DEBUG_CPU_TYPE", None)
    if baseline:
        env["MKL_DEBUG_CPU_TYPE"] = ""  # set, so ldm.cpu leaves it; empty, so MKL chooses by itself
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--updates", str(updates)],
                         env=env, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.updates)))
        return

    vendor, _ = cpu_identity()
    chosen = {}
    print(f"CPU vendor {vendor or 'unknown'}; ldm.cpu sets MKL_DEBUG_CPU_TYPE here: {choose_mkl_kernels(chosen)}")
    results = {"baseline": [], "ldm.cpu": []}
    for round_index in range(args.rounds):
        for name in results:
            results[name].append(run_child(args.updates, baseline=name == "baseline"))
            r = results[name][-1]
            print(f"round {round_index + 1} {name:>8}: matmul {r['matmul_gflops']:.1f} GFLOP/s, autoencoder "
                  f"update {r['autoencoder_ms']:.1f} ms, LDM update {r['ldm_ms']:.1f} ms")
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in results.items()}
    base, ours = medians["baseline"], medians["ldm.cpu"]
    print(f"medians of {args.rounds}: matmul {base['matmul_gflops']:.1f} -> {ours['matmul_gflops']:.1f} GFLOP/s, "
          f"autoencoder update {base['autoencoder_ms']:.1f} -> {ours['autoencoder_ms']:.1f} ms "
          f"({base['autoencoder_ms'] / ours['autoencoder_ms']:.2f}x)")
    print(f"LDM update speed-up: {base['ldm_ms'] / ours['ldm_ms']:.2f}")


if __name__ == "__main__":
    main()
