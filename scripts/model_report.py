"""Print the parameter count of every part of each preset and the FLOPs of one training sample (builds
them on the CPU; `ldm.models.flops` counts the FLOPs as a run does at its start).

    .venv/bin/python scripts/model_report.py [--resolution 256] [--text_length 77] [preset ...]

The FLOPs are of forward and backward of the UNet and of a trained text encoder (LDMBert; a frozen CLIP's forward
only, left out too on cached text embeddings), and the forward of the autoencoder's encoder (left out on latent
shards), at `--resolution` (default: each preset's own) for one sample.
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
        frozen = not components.family.trained_by_default
        encoder = getattr(components.text_encoder, "model", components.text_encoder)  # LDMBert's, without to_logits
        text = sum(int(p.numel()) for p in encoder.parameters())
        unused = counts["text_encoder"] - text
        head = (f"(+ unused to_logits head {unused / 1e6:.2f}M)" if unused else
                f"({components.family.name}, frozen)" if frozen else "")
        print(f"{preset:12s} unet {counts['unet'] / 1e6:8.2f}M  text encoder {text / 1e6:8.2f}M {head}  "
              f"vae {counts['vae'] / 1e6:7.2f}M", flush=True)
        model = LatentDiffusion(components.unet, components.text_encoder, components.vae,
                                components.noise_scheduler, freeze_text_encoder=frozen)
        resolution = args.resolution or model_resolution(components.unet, components.vae)
        flops = {name: value / 1e9 for name, value in
                 ldm_training_flops(model, resolution=resolution, text_length=args.text_length).items()}
        print(f"{'':12s} GFLOP per training sample at {resolution} px, {args.text_length} tokens: "
              f"{flops['total']:.4g} (unet {flops['unet']:.4g}, text encoder {flops['text_encoder']:.4g}, "
              f"autoencoder encode {flops['vae_encode']:.4g}; {flops['total'] - flops['vae_encode']:.4g} on "
              f"latents" + (f", {flops['unet']:.4g} on latents and cached text embeddings" if frozen else "")
              + f")  [{time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
