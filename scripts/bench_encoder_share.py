"""The frozen encoder's share of a training step of a preset, from forward passes timed on this machine.

    .venv/bin/python scripts/bench_encoder_share.py [--preset ldm-32layer] [--batch 2] [--resolution 256]

Times (median of `--rounds`, after one warm-up) the autoencoder's encode, the UNet and LDMBert forward
passes on random inputs at initialisation (weights do not change the cost). A training step runs the
encoder forward only and the trained parts forward and backward (about 3x a forward pass): the last line
is the encoder's share of a step and the speed-up of a step on precomputed latents. `ldm-32layer` needs
about 8 GB of memory and a few minutes on a CPU.
"""

import argparse
import statistics
import time

import paddle

from ldm.models.build import build_components
from ldm.runtime.cli import ToolParser


def seconds(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ldm-32layer")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    parts = build_components(args.preset, seed=0)
    pixels = paddle.randn([args.batch, 3, args.resolution, args.resolution])
    ids = paddle.randint(1, parts.text_encoder.config.vocab_size, [args.batch, 77])
    timesteps = paddle.full([args.batch], 500, dtype="int64")
    with paddle.no_grad():
        latents = parts.vae.encode(pixels).latent_dist.sample()
        text = parts.text_encoder(ids)[0]
        encoder = seconds(lambda: parts.vae.encode(pixels).latent_dist.parameters.numpy(), args.rounds)
        unet = seconds(lambda: parts.unet(latents, timesteps, encoder_hidden_states=text).sample.numpy(), args.rounds)
        bert = seconds(lambda: parts.text_encoder(ids)[0].numpy(), args.rounds)
    print(f"forward seconds, {args.preset}, batch {args.batch}, {args.resolution} px: encoder {encoder:.2f}, "
          f"UNet {unet:.2f}, LDMBert {bert:.2f}")
    step = encoder + 3 * (unet + bert)
    print(f"encoder share of a step: {encoder / step:.1%}; a step on latents is {step / (step - encoder):.2f}x faster")


if __name__ == "__main__":
    main()
