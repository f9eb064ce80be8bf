"""Print the parameter count of every part of each preset and the FLOPs of one training sample (builds
them on the CPU; `ldm.models.flops` counts the FLOPs as a run does at its start).

    .venv/bin/python scripts/model_report.py [--resolution 256] [--text_length 77] [preset ...]

The FLOPs are of forward and backward of the backbone (UNet or DiT) and of a trained text encoder (LDMBert; a frozen
CLIP's or T5's forward only, or SD3's three, left out too on cached text embeddings; T5 counted from copies of 1 and 2
layers), and
the forward of the autoencoder's encoder (left out on latent shards), at `--resolution` (default: each preset's
own) for one sample.
"""

import argparse
import json
import logging
import os
import shutil
import tempfile
import time

from ldm.models.build import (
    PRESETS,
    build_components,
    load_frozen_text_encoder,
    model_resolution,
    read_config,
    resolve_source,
)
from ldm.models.diffusion import LatentDiffusion
from ldm.models.flops import forward_flops
from ldm.models.text import text_family
from ldm.runtime.device import use_fast_cpu_kernels


def t5_part(source: str) -> str:
    """The folder of a model's T5 encoder: its `text_encoder/`, or SD3's third, `text_encoder_3/`."""
    return "text_encoder_3" if os.path.isdir(os.path.join(source, "text_encoder_3")) else "text_encoder"


def t5_layers(preset: str) -> int | None:
    """The number of layers of a preset's T5 encoder; None when it has none."""
    part = os.path.join(resolve_source(preset), t5_part(resolve_source(preset)))
    if not os.path.isfile(os.path.join(part, "config.json")) or read_config(part).get("model_type") != "t5":
        return None
    return read_config(part)["num_layers"]


def few_layers(preset: str, layers: int, folder: str) -> str:
    """A copy of a preset's configs whose T5 text encoder has `layers` layers: T5-XXL (4.8 B parameters, 19 GB in
    float32) does not fit beside the rest on a small host, and its layers after the first are alike."""
    source = resolve_source(preset)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    part = t5_part(folder)
    config = read_config(os.path.join(folder, part))
    config["num_layers"] = layers
    with open(os.path.join(folder, part, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def t5_scaled(preset: str, text_length: int, temp: str) -> tuple[int, int]:
    """(parameters, forward FLOPs) of a preset's whole T5 encoder, from copies of 1 and 2 layers: the first layer
    (with the relative position table) and the embedding, plus the number of further layers times one of them."""
    import paddle

    counted = []
    for layers in (1, 2):
        folder = few_layers(preset, layers, os.path.join(temp, str(layers)))
        family = text_family(folder)  # the text encoder alone: the backbone may be billions of parameters too
        encoder, _ = load_frozen_text_encoder(family, os.path.join(folder, family.folder))
        ids = paddle.ones([1, text_length * getattr(encoder, "id_groups", 1)], dtype="int64")
        flops = sum(forward_flops(encoder, lambda encoder=encoder, ids=ids: encoder(ids)).values())
        counted.append((sum(int(p.numel()) for p in encoder.parameters()), flops))
    total = t5_layers(preset)
    (p1, f1), (p2, f2) = counted
    return p1 + (total - 1) * (p2 - p1), f1 + (total - 1) * (f2 - f1)


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
        with tempfile.TemporaryDirectory() as temp:
            t5 = t5_layers(preset) is not None  # counted from copies of 1 and 2 layers
            source = few_layers(preset, 1, os.path.join(temp, "1")) if t5 else preset
            components = build_components(source, vocab_size=30522, model_max_length=args.text_length)
            scaled = t5_scaled(preset, args.text_length, temp) if t5 else None
        counts = components.parameter_counts()
        frozen = not components.family.trained_by_default
        encoder = getattr(components.text_encoder, "model", components.text_encoder)  # LDMBert's, without to_logits
        text = scaled[0] if scaled else sum(int(p.numel()) for p in encoder.parameters())
        unused = counts["text_encoder"] - sum(int(p.numel()) for p in encoder.parameters())
        head = (f"(+ unused to_logits head {unused / 1e6:.2f}M)" if unused else
                f"({components.family.name}, frozen)" if frozen else "")
        backbone = components.model_family.backbone_folder
        print(f"{preset:16s} {backbone} {counts['unet'] / 1e6:8.2f}M  text encoder {text / 1e6:8.2f}M {head}  "
              f"vae {counts['vae'] / 1e6:7.2f}M", flush=True)
        model = LatentDiffusion(components.unet, components.text_encoder, components.vae,
                                components.noise_scheduler, freeze_text_encoder=frozen)
        resolution = args.resolution or model_resolution(components.unet, components.vae)
        counted = components.model_family.training_flops(model, resolution=resolution, text_length=args.text_length)
        if scaled:
            counted["total"] += scaled[1] - counted["text_encoder"]
            counted["text_encoder"] = scaled[1]
        flops = {name: value / 1e9 for name, value in counted.items()}
        print(f"{'':16s} GFLOP per training sample at {resolution} px, {args.text_length} tokens: "
              f"{flops['total']:.4g} ({backbone} {flops['unet']:.4g}, text encoder {flops['text_encoder']:.4g}, "
              f"autoencoder encode {flops['vae_encode']:.4g}; {flops['total'] - flops['vae_encode']:.4g} on "
              f"latents" + (f", {flops['unet']:.4g} on latents and cached text embeddings" if frozen else "")
              + f")  [{time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
