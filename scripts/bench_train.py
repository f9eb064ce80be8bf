"""How close the hand-written loop comes to a bare training step on the same model.

    .venv/bin/python scripts/bench_train.py [--preset ldm-demo] [--batch 32] [--updates 10] [--rounds 3]

Baseline: a bare forward/backward/AdamW step of the model the loop trains (`LatentDiffusion` from the
same flags), on random pixels and token ids already in memory. Measured: the real loop
(`ldm.train.loop.train_objective`, one process) on synthetic shards, with everything it does per update: data,
loss window, gradient sync, clipping, the non-finite guard, logging, FLOPs, the metrics file, the progress
bar. Its data comes from one loader process, as a run's does (a run starts 6 per card; one here, where 2
cores are shared): with `--num_workers 0` the data path runs in a thread of the training process, whose
Python (the tokenizer) then competes with the step's op dispatch for the interpreter lock. Each round times
`--updates` steps of each after as many warm-up steps, interleaved; the loop's time is its logged
samples/s over the second logging window (the first holds the start-up). The last line is the loop's
speed as a fraction of the bare step's.

`--against latents` compares instead the loop on image shards (the baseline) with the loop on the same
corpus encoded once into latent shards (`python -m ldm.prepare encode`, with the preset's autoencoder), and
prints as its last line how many times faster an update on latents is.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import numpy as np
import paddle

from ldm.config.args import DataArguments, LoopArguments, ModelArguments, SamplingArguments
from ldm.prepare.synth import synth_corpus
from ldm.runtime.cli import ToolParser
from ldm.runtime.device import use_fast_cpu_kernels
from ldm.runtime.tracking import read_scalars
from ldm.train import setup
from ldm.train.loop import train_objective
from ldm.train.objective import TextToImage


def bare_step_seconds(objective: TextToImage, batch: int, resolution: int, updates: int, lr: float) -> float:
    """Seconds per bare update: forward, backward, AdamW step, clear, on tensors already in memory."""
    model = objective.model
    trained = [p for p in model.parameters() if not p.stop_gradient]
    optimizer = paddle.optimizer.AdamW(lr, parameters=trained, weight_decay=0.01)
    pixels = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (batch, 3, resolution, resolution),
                                                                dtype=np.uint8))
    ids = paddle.randint(1, objective.tokenizer.vocab_size, [batch, objective.data.model_max_length])
    model.train()

    def step() -> None:
        model(pixels, ids).backward()
        optimizer.step()
        optimizer.clear_grad()

    return seconds_per_call(step, updates, lambda: float(trained[0].sum()))


def seconds_per_call(call, times: int, wait=lambda: None) -> float:
    """Seconds per `call()` over `times` calls, after as many warm-up calls; `wait()` waits for the device."""
    for _ in range(times):
        call()
    wait()
    start = time.perf_counter()
    for _ in range(times):
        call()
    wait()
    return (time.perf_counter() - start) / times


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ldm-demo")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num_workers", type=int, default=1,
                        help="the loop's loader processes (0: a thread of the training process)")
    parser.add_argument("--against", choices=("bare", "latents"), default="bare",
                        help="bare: the loop against a bare step; latents: the loop on latents against on images")
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="bench_train_")
    listing = synth_corpus(os.path.join(folder, "corpus"), num_records=max(2000, 4 * args.batch * args.updates),
                           resolution=args.resolution, records_per_shard=1000)
    model_args = ModelArguments(model_name_or_path=args.preset, allow_untrained_vae=True)
    data = DataArguments(file_list=listing, tokenizer_name=os.path.join(folder, "corpus", "tokenizer"),
                         model_max_length=16, resolution=args.resolution, center_crop=True)
    sampling = SamplingArguments()
    use_fast_cpu_kernels()  # as the entry points start
    setup.quiet_libraries()

    def loop_update_seconds(run_data: DataArguments, name: str) -> float:
        out = os.path.join(folder, name)
        loop_args = LoopArguments(output_dir=out, train_batch_size=args.batch, max_train_steps=2 * args.updates,
                                  logging_steps=args.updates, save_steps=10 * args.updates, learning_rate=1e-4,
                                  adam_weight_decay=0.01, num_workers=args.num_workers, seed=0,
                                  report_to=["visualdl"])
        train_objective(loop_args, run_data,
            lambda dist, resume, resolved: TextToImage(model_args, run_data, sampling, recompute=False, seed=0))
        steps, rates = read_scalars(os.path.join(out, "visualdl"), "train/global_samples_per_second")
        return args.batch / rates[steps.index(2 * args.updates)]

    if args.against == "latents":
        # one autoencoder with saved weights for the encode and both runs (an untrained preset's is drawn anew)
        vae = os.path.join(folder, "vae")
        TextToImage(model_args, data, sampling, recompute=False, seed=0).components.vae.save_pretrained(vae)
        model_args = dataclasses.replace(model_args, vae_name_or_path=vae)
        latent_data = dataclasses.replace(data, file_list=encode(listing, vae, args.resolution, folder))
        images, latents = [], []
        for round_index in range(args.rounds):
            images.append(loop_update_seconds(data, f"images{round_index}"))
            latents.append(loop_update_seconds(latent_data, f"latents{round_index}"))
            print(f"round {round_index + 1}: update on images {images[-1] * 1e3:.1f} ms, on latents "
                  f"{latents[-1] * 1e3:.1f} ms")
        images_ms, latents_ms = statistics.median(images) * 1e3, statistics.median(latents) * 1e3
        print(f"loop update on images {images_ms:.1f} ms, on latents {latents_ms:.1f} ms (medians of {args.rounds} "
              f"rounds, {args.preset}, batch {args.batch}, {args.resolution} px)")
        print(f"speed-up of an update on latents: {images_ms / latents_ms:.2f}")
        return

    bare, loop = [], []
    for round_index in range(args.rounds):
        objective = TextToImage(model_args, data, sampling, recompute=False, seed=0)
        bare.append(bare_step_seconds(objective, args.batch, args.resolution, args.updates, 1e-4))
        loop.append(loop_update_seconds(data, f"run{round_index}"))
        print(f"round {round_index + 1}: bare step {bare[-1] * 1e3:.1f} ms, loop update {loop[-1] * 1e3:.1f} ms "
              f"({bare[-1] / loop[-1]:.3f})")
    bare_ms, loop_ms = statistics.median(bare) * 1e3, statistics.median(loop) * 1e3
    # the ratio of each round (its two measurements taken back to back), then their median: the machine's
    # drift over a run moves both of a round alike
    ratio = statistics.median(b_s / l_s for b_s, l_s in zip(bare, loop, strict=True))
    print(f"bare step {bare_ms:.1f} ms, loop update {loop_ms:.1f} ms (medians of {args.rounds} rounds, "
          f"{args.preset}, batch {args.batch}, loader processes: {args.num_workers})")
    print(f"loop speed as a fraction of the bare step (median of the rounds' ratios): {ratio:.3f}")


def encode(listing: str, vae: str, resolution: int, folder: str) -> str:
    """The corpus encoded by the autoencoder `vae` (`python -m ldm.prepare encode`); returns its file list."""
    from ldm.prepare.tools import main as data_tool

    out = os.path.join(folder, "latents")
    code = data_tool(["encode", "--file_list", listing, "--vae_name_or_path", vae, "--output_dir", out,
                      "--resolution", str(resolution), "--center_crop", "--num_workers", "0"])
    if code:
        raise SystemExit(f"encode failed ({code})")
    return os.path.join(out, "latents.filelist.list")


if __name__ == "__main__":
    main()
