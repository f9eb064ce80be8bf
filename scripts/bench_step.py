"""Benchmark the per-update gradient clipping of the training loop against Paddle's.

    .venv/bin/python scripts/bench_step.py [--preset ldm-demo] [--batch 16] [--rounds 30]

Builds the preset's UNet and LDMBert, takes one real backward pass, then times
`paddle.nn.utils.clip_grad_norm_` (the baseline) and the training loop's clipping (`ldm.train.loop`) on the same
gradients, interleaved, and prints the medians and their ratio. Both clip to `max_norm` 1.0 and
must agree on the norm. For small models on a CPU the per-op cost of the clipping (a few ops per
weight tensor) is a visible share of an optimizer update.
"""

import argparse
import os
import statistics
import time

import paddle

from ldm.models.build import load_part, load_text_encoder, resolve_source
from ldm.runtime.cli import ToolParser
from ldm.train.gradients import TensorGradients, clip_factor


def build_parts(preset: str):
    """The preset's UNet and LDMBert (a 64-token vocabulary, 16 positions), seeded: the benchmarks' model."""
    from ppdiffusers import UNet2DConditionModel

    paddle.seed(0)
    source = resolve_source(preset)
    unet, _ = load_part(UNet2DConditionModel, os.path.join(source, "unet"))
    text_encoder, _ = load_text_encoder(os.path.join(source, "bert"), vocab_size=64, max_length=16)
    return unet, text_encoder


def loop_clip(parameters, max_norm: float):
    """The loop's clipping: the global norm, the factor, and one rescaling pass when the factor is below 1 (the loop
    reads the factor with its guard's vote, one host read)."""
    gradients = TensorGradients(parameters)
    norm = gradients.norm()
    factor = float(clip_factor(norm, max_norm))
    if factor < 1:
        gradients.scale(factor)
    return norm


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ldm-demo")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    unet, text_encoder = build_parts(args.preset)
    size = unet.config.sample_size
    ids = paddle.randint(1, 64, [args.batch, 16])
    states = text_encoder(ids)[0]
    latents = paddle.randn([args.batch, unet.config.in_channels, size, size])
    timesteps = paddle.randint(0, 1000, [args.batch])
    (unet(latents, timesteps, encoder_hidden_states=states).sample ** 2).mean().backward()
    parameters = [p for layer in (unet, text_encoder) for p in layer.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in parameters]

    def restore() -> None:
        for p, g in zip(parameters, saved, strict=True):
            p.grad.set_value(g)

    timings: dict[str, list[float]] = {"paddle.nn.utils.clip_grad_norm_": [], "ldm (the loop's)": []}
    norms: dict[str, float] = {}
    functions = {"paddle.nn.utils.clip_grad_norm_": paddle.nn.utils.clip_grad_norm_,
                 "ldm (the loop's)": loop_clip}
    for _ in range(args.rounds):
        for name, clip in functions.items():
            restore()
            start = time.perf_counter()
            norms[name] = float(clip(parameters, 1.0))
            timings[name].append(time.perf_counter() - start)
    baseline, ours = (statistics.median(timings[name]) for name in functions)
    print(f"{len(parameters)} gradient tensors, {sum(p.size for p in parameters) / 1e6:.2f}M weights "
          f"({args.preset}, batch {args.batch}), median of {args.rounds} interleaved rounds")
    for name in functions:
        print(f"  {name:34s} {statistics.median(timings[name]) * 1000:7.2f} ms   norm {norms[name]:.6f}")
    print(f"  speed-up: x{baseline / ours:.2f}")
    a, b = norms.values()
    if abs(a - b) > 1e-5 * max(abs(a), 1e-12):
        raise SystemExit(f"error: the norms differ ({a} vs {b})")


if __name__ == "__main__":
    main()
