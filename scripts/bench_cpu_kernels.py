"""The CPU fixes of `ldm.runtime.cpu` and `ldm.runtime.compat.fast_conv_bias`: the demo's training steps with and
without.

    .venv/bin/python scripts/bench_cpu_kernels.py [--rounds 3] [--updates 10]

Each round starts three fresh processes one after the other (MKL reads its variable once, at its first
call): "paddle", as Paddle runs by itself (MKL_DEBUG_CPU_TYPE empty: MKL's own kernel choice; Paddle's
conv2d bias add); "mkl", MKL_DEBUG_CPU_TYPE as the entry points' start-up sets it (5 on an AMD CPU with AVX2,
unset elsewhere); "mkl+bias", that and the [C, 1, 1] bias add, as the project runs. Each times a
512x512 float32 matmul, a bare update of the demo autoencoder (x4, batch 4 of 32 px: the demo's
autoencoder stage per process) and a bare update of the demo LDM on images (batch 16, autoencoder
included). The last line is the LDM update's speed-up of "mkl+bias" over "paddle".
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import paddle
import paddle.nn.functional as F
import paddle.nn.functional.conv as conv
from bench_train import bare_step_seconds, seconds_per_call

from ldm.config.args import DataArguments, ModelArguments, SamplingArguments
from ldm.models.autoencoder import AutoencoderTraining
from ldm.prepare.synth import synth_corpus
from ldm.runtime.cpu import choose_mkl_kernels, cpu_identity
from ldm.runtime.device import use_fast_cpu_kernels
from ldm.train import setup
from ldm.train.autoencoder import build_autoencoder
from ldm.train.objective import TextToImage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(updates: int, fast_bias: bool) -> dict:
    """One process's figures: matmul GFLOP/s, autoencoder and LDM update in ms (MKL_DEBUG_CPU_TYPE was
    decided here, before any tensor work, as an entry point's start-up does)."""
    use_fast_cpu_kernels()
    setup.quiet_libraries()
    vae, _ = build_autoencoder("ldm-demo", seed=0)
    folder = tempfile.mkdtemp(prefix="bench_cpu_kernels_")
    listing = synth_corpus(os.path.join(folder, "corpus"), num_records=64, resolution=32, records_per_shard=64)
    data = DataArguments(file_list=listing, tokenizer_name=os.path.join(folder, "corpus", "tokenizer"),
                         model_max_length=16, resolution=32, center_crop=True)
    objective = TextToImage(ModelArguments(model_name_or_path="ldm-demo", allow_untrained_vae=True), data,
                            SamplingArguments(), recompute=False, seed=0)
    shutil.rmtree(folder)
    if not fast_bias:
        F.conv2d, conv._conv_nd = F.conv2d.original, conv._conv_nd.original

    a, b = paddle.randn([512, 512]), paddle.randn([512, 512])
    gflops = 2 * 512**3 / seconds_per_call(lambda: paddle.matmul(a, b), 50) / 1e9

    model = AutoencoderTraining(vae, 1e-6)
    optimizer = paddle.optimizer.AdamW(2e-3, parameters=model.parameters(), weight_decay=0.0)
    pixels = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8))

    def autoencoder_step() -> None:
        model(pixels)[0].backward()
        optimizer.step()
        optimizer.clear_grad()

    autoencoder_ms = seconds_per_call(autoencoder_step, updates) * 1e3

    ldm_ms = bare_step_seconds(objective, 16, 32, updates, 1e-4) * 1e3
    return {"matmul_gflops": gflops, "autoencoder_ms": autoencoder_ms, "ldm_ms": ldm_ms}


ARMS = {"paddle": (False, False), "mkl": (True, False), "mkl+bias": (True, True)}  # (MKL choice, bias add)


def run_child(updates: int, arm: str) -> dict:
    mkl, fast_bias = ARMS[arm]
    env = dict(os.environ)
    env.pop("MKL_DEBUG_CPU_TYPE", None)
    if not mkl:
        env["MKL_DEBUG_CPU_TYPE"] = ""  # set, so ldm.runtime.cpu leaves it; empty, so MKL chooses by itself
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    command = [sys.executable, os.path.abspath(__file__), "--child", "--updates", str(updates)]
    out = subprocess.run(command + (["--fast_bias"] if fast_bias else []), env=env, cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fast_bias", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.updates, args.fast_bias)))
        return

    vendor, _ = cpu_identity()
    print(f"CPU vendor {vendor or 'unknown'}; ldm.runtime.cpu sets MKL_DEBUG_CPU_TYPE here: {choose_mkl_kernels({})}")
    results = {name: [] for name in ARMS}
    for round_index in range(args.rounds):
        for name in results:
            results[name].append(run_child(args.updates, name))
            r = results[name][-1]
            print(f"round {round_index + 1} {name:>8}: matmul {r['matmul_gflops']:.1f} GFLOP/s, autoencoder "
                  f"update {r['autoencoder_ms']:.1f} ms, LDM update {r['ldm_ms']:.1f} ms")
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in results.items()}
    base = medians["paddle"]
    for name in ("mkl", "mkl+bias"):
        ours = medians[name]
        print(f"medians of {args.rounds}, {name} against paddle: matmul {base['matmul_gflops']:.1f} -> "
              f"{ours['matmul_gflops']:.1f} GFLOP/s, autoencoder update {base['autoencoder_ms']:.1f} -> "
              f"{ours['autoencoder_ms']:.1f} ms ({base['autoencoder_ms'] / ours['autoencoder_ms']:.2f}x), LDM update "
              f"{base['ldm_ms']:.1f} -> {ours['ldm_ms']:.1f} ms")
    print(f"LDM update speed-up: {base['ldm_ms'] / medians['mkl+bias']['ldm_ms']:.2f}")


if __name__ == "__main__":
    main()
