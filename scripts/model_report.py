"""Print the parameter count of every part of each preset and the FLOPs of one training sample (builds
them on the CPU; `ldm.models.flops` counts the FLOPs as a run does at its start).

    .venv/bin/python scripts/model_report.py [--resolution 256] [--text_length 77] [preset ...]

The FLOPs are of forward and backward of the UNet and LDMBert and the forward of the autoencoder's
encoder (left out on latent shards), at `--resolution` (default: each preset's own) for one sample.
"""

import argparse
import logging
import time

from ldm.models.build import PRESETS, build_components, model_resolution
from ldm.models.diffusion import LatentDiffusion
from ldm.models.flops import ldm_training_flops
from ldm.runtime.device import use_fast_cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--resolution", type=int, default=None, help="image size (default: the preset's)")
    parser.add_argument("--text_length", type=int, default=77)
    args = parser.parse_args()
    use_fast_cpu_kernels()
    logging.getLogger("ldm.models").setLevel(logging.ERROR)
    for preset in args.presets:
        start = time.perf_counter()
        components = build_components(preset, vocab_size=30522, model_max_length=args.text_length)
        counts = components.parameter_counts()
        trained = sum(int(p.numel()) for p in components.text_encoder.model.parameters())
        print(f"{preset:12s} unet {counts['unet'] / 1e6:8.2f}M  text encoder {trained / 1e6:8.2f}M "
              f"(+ unused to_logits head {(counts['text_encoder'] - trained) / 1e6:.2f}M)  "
              f"vae {counts['vae'] / 1e6:7.2f}M", flush=True)
        model = LatentDiffusion(components.unet, components.text_encoder, components.vae,
                                components.noise_scheduler)
        resolution = args.resolution or model_resolution(components.unet, components.vae)
        flops = {name: value / 1e9 for name, value in
                 ldm_training_flops(model, resolution=resolution, text_length=args.text_length).items()}
        print(f"{'':12s} GFLOP per training sample at {resolution} px, {args.text_length} tokens: "
              f"{flops['total']:.4g} (unet {flops['unet']:.4g}, text encoder {flops['text_encoder']:.4g}, "
              f"autoencoder encode {flops['vae_encode']:.4g}; {flops['total'] - flops['vae_encode']:.4g} on "
              f"latents)  [{time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
