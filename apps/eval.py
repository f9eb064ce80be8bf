"""Prompt-following evaluation on the captioned-shapes corpus.

    python -m apps.eval shapes --model outputs/demo/pipeline [--num_images_per_prompt 4] [--json]

Generates images for prompts covering every colour, background and shape, reads each image back
with a deterministic pixel-statistics classifier and reports object-colour, background-colour and
shape accuracy. As a reference it runs the same classifier on real corpus images: if the
classifier is wrong there, the model's numbers mean nothing.

The classifier: the background is the palette colour nearest the median border pixel; the object
colour is the palette colour (other than the background) nearest the median of the pixels far
from the background; the object is the largest connected region of pixels closer to the object
colour than to the background, and its shape follows from how much of its bounding box it fills
(square 1, circle pi/4, triangle 1/2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ldm.prepare.synth import COLOURS, SHAPES, caption
from ldm.runtime.cli import ToolParser
from ldm.runtime.errors import UserError

NAMES = tuple(COLOURS)
PALETTE = np.array([COLOURS[name] for name in NAMES], dtype=np.float32)
# fill ratio of the bounding box: square 1, circle 0.785, triangle 0.5; thresholds halfway between
SQUARE_FILL, CIRCLE_FILL = 0.89, 0.64
FAR_FROM_BACKGROUND = 60.0  # RGB distance; the closest two palette colours are 114 apart
MIN_OBJECT_PIXELS = 4


@dataclass(frozen=True)
class Reading:
    colour: str | None
    shape: str | None
    background: str

    @property
    def caption(self) -> str:
        return caption(self.colour or "?", self.shape or "?", self.background)


def nearest(rgb: np.ndarray, exclude: int | None = None) -> int:
    distances = np.linalg.norm(PALETTE - rgb, axis=1)
    if exclude is not None:
        distances[exclude] = np.inf
    return int(np.argmin(distances))


def largest_region(mask: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    labels, count = ndimage.label(mask)
    if count <= 1:
        return mask
    sizes = np.bincount(labels.ravel())[1:]
    return labels == 1 + int(np.argmax(sizes))


def classify(pixels: np.ndarray) -> Reading:
    """Read (object colour, shape, background) from an [H, W, 3] uint8 image."""
    image = pixels.astype(np.float32)
    border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
    background = nearest(np.median(border, axis=0))
    background_rgb = PALETTE[background]
    far = np.linalg.norm(image - background_rgb, axis=-1) > FAR_FROM_BACKGROUND
    if far.sum() < MIN_OBJECT_PIXELS:
        return Reading(None, None, NAMES[background])
    colour = nearest(np.median(image[far], axis=0), exclude=background)
    # closer to the object colour than to the background: halfway along the line between them,
    # which keeps the area of a blurred edge unbiased
    direction = PALETTE[colour] - background_rgb
    progress = (image - background_rgb) @ direction / float(direction @ direction)
    region = largest_region(progress > 0.5)
    ys, xs = np.nonzero(region)
    if len(ys) < MIN_OBJECT_PIXELS:
        return Reading(NAMES[colour], None, NAMES[background])
    fill = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    shape = "square" if fill > SQUARE_FILL else "circle" if fill > CIRCLE_FILL else "triangle"
    return Reading(NAMES[colour], shape, NAMES[background])


def parse_caption(text: str) -> tuple[str, str, str]:
    """(colour, shape, background) of a corpus caption."""
    words = text.split()
    if (len(words) != 7 or words[0] not in ("a", "an") or words[3] != "on" or words[4] not in ("a", "an")
            or words[6] != "background"):
        raise ValueError(f"not a shapes caption: {text!r}")
    return words[1], words[2], words[5]


def score(readings: list[Reading], captions: list[str]) -> dict:
    """Accuracy of each attribute (and of all three together) against the captions."""
    truth = [parse_caption(c) for c in captions]
    n = len(truth)
    colour = sum(r.colour == t[0] for r, t in zip(readings, truth, strict=True)) / n
    shape = sum(r.shape == t[1] for r, t in zip(readings, truth, strict=True)) / n
    background = sum(r.background == t[2] for r, t in zip(readings, truth, strict=True)) / n
    exact = sum((r.colour, r.shape, r.background) == t for r, t in zip(readings, truth, strict=True)) / n
    # where shape is lost: e.g. a blurred small triangle's point fills its box like a circle
    misread = Counter(f"{t[1]} as {r.shape or 'nothing'}" for r, t in zip(readings, truth, strict=True)
                      if r.shape != t[1])
    return {"object_colour": colour, "background": background, "shape": shape, "all_three": exact, "images": n,
            "shape_misread": dict(misread.most_common())}


def eval_prompts() -> list[str]:
    """24 prompts: every colour three times (once per shape), every shape eight times, every
    colour as background three times, never the same colour twice in one prompt."""
    prompts = []
    for i, colour in enumerate(NAMES):
        for j, shape in enumerate(SHAPES):
            background = NAMES[(i + 1 + 2 * j) % len(NAMES)]  # offsets 1, 3, 5: never the object colour
            prompts.append(caption(colour, shape, background))
    return prompts


def corpus_reference(num_images: int, resolution: int, seed: int = 12345) -> dict:
    """The classifier on real corpus images (records the demo never trained on)."""
    from ldm.prepare.synth import record

    captions, readings = [], []
    for i in range(num_images):
        text, image = record(i, seed, resolution)
        captions.append(text)
        readings.append(classify(np.asarray(image)))
    return score(readings, captions)


def evaluate_model(model: str, *, num_images_per_prompt: int = 4, guidance_scale: float = 5.0,
                   num_inference_steps: int = 50, seed: int = 0, reference_images: int = 1000,
                   grid: str | None = None, reconstructions: str | None = None) -> dict:
    """Generate for `eval_prompts()`, classify, score; plus the classifier on real corpus images and on
    the model's own autoencoder reconstructions (what the LDM can at best reach)."""
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, image_grid, sampling_scheduler
    from ldm.models.build import model_resolution
    from ldm.models.text import prompt_length

    unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(model)
    prompts = eval_prompts()
    repeated = [p for p in prompts for _ in range(num_images_per_prompt)]
    tokenize = CaptionTokenizer(tokenizer, prompt_length(text_encoder, tokenizer))
    images = generate(unet, text_encoder, vae, sampling_scheduler(scheduler_config), tokenize, repeated,
                      guidance_scale=guidance_scale, num_inference_steps=num_inference_steps, seed=seed,
                      batch_size=32)
    readings = [classify(image) for image in images]
    if grid:
        image_grid(images, rows=len(prompts)).save(grid)
    result = score(readings, repeated)
    result["per_prompt"] = {p: score(readings[i * num_images_per_prompt:(i + 1) * num_images_per_prompt],
                                     [p] * num_images_per_prompt)["all_three"] for i, p in enumerate(prompts)}
    resolution = model_resolution(unet, vae)
    return {
        "model": model,
        "ema_weights": used_ema,
        "guidance_scale": guidance_scale,
        "num_inference_steps": num_inference_steps,
        "num_images_per_prompt": num_images_per_prompt,
        "prompts": len(prompts),
        "generated": result,
        "classifier_on_corpus": corpus_reference(reference_images, resolution),
        "autoencoder": evaluate_autoencoder(vae, resolution=resolution, grid=reconstructions),
    }


def evaluate_autoencoder(vae, *, resolution: int, num_images: int = 200, seed: int = 12345,
                         grid: str | None = None, grid_images: int = 16) -> dict:
    """The classifier on reconstructions of held-out corpus images: what the autoencoder keeps.
    `vae`: an AutoencoderKL or its folder."""
    import paddle
    from ppdiffusers import AutoencoderKL

    from ldm.checkpoint.format import refuse_pickles
    from ldm.data.dataset import to_pixel_values
    from ldm.inference.sampling import image_grid
    from ldm.models.autoencoder import reconstruct
    from ldm.prepare.synth import record

    folder = vae if isinstance(vae, str) else None
    if folder:
        if not os.path.isfile(os.path.join(folder, "config.json")):  # ppdiffusers would make it as a cache folder
            raise OSError(f"{folder}: not an AutoencoderKL folder (no config.json)")
        refuse_pickles(folder, "autoencoder")
        vae = AutoencoderKL.from_pretrained(folder)
    vae.eval()
    captions, originals = zip(*(record(i, seed, resolution) for i in range(num_images)), strict=True)
    pixels = np.stack([np.asarray(image) for image in originals])
    outputs = np.concatenate([
        reconstruct(vae, paddle.to_tensor(to_pixel_values(list(pixels[i:i + 32])))) for i in range(0, num_images, 32)
    ])
    if grid:
        n = min(grid_images, num_images)
        image_grid(np.concatenate([pixels[:n], outputs[:n]]), rows=2).save(grid)
    result = score([classify(image) for image in outputs], list(captions))
    result["mean_abs_error"] = float(np.abs(outputs.astype(np.float32) - pixels).mean() / 255)
    return {"vqvae": folder, "scaling_factor": float(vae.config.scaling_factor), "reconstructions": result}


def misread_text(scores: dict) -> str:
    """`triangle as circle 5, square as circle 1` (empty when every shape was read right)."""
    return ", ".join(f"{k} {v}" for k, v in scores.get("shape_misread", {}).items())


def print_table(result: dict) -> None:
    rows = {"generated": result.get("generated"),
            "reconstructions": result.get("autoencoder", result).get("reconstructions"),
            "classifier_on_corpus": result.get("classifier_on_corpus")}
    for name, r in rows.items():
        if r:
            misread = misread_text(r)
            print(f"{name:>22}: object colour {r['object_colour']:.1%}  background {r['background']:.1%}  "
                  f"shape {r['shape']:.1%}  all three {r['all_three']:.1%}  ({r['images']} images)"
                  + (f"; shapes misread: {misread}" if misread else ""))


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m apps.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    shapes = commands.add_parser("shapes", help="prompt following of a model trained on the shapes corpus")
    shapes.add_argument("--model", required=True, help="pipeline folder or checkpoint-<step> folder")
    shapes.add_argument("--num_images_per_prompt", type=int, default=4)
    shapes.add_argument("--guidance_scale", type=float, default=5.0)
    shapes.add_argument("--num_inference_steps", type=int, default=50)
    shapes.add_argument("--seed", type=int, default=0)
    shapes.add_argument("--reference_images", type=int, default=1000, help="corpus images for the classifier check")
    shapes.add_argument("--grid", help="also save the generated images as a grid (a row per prompt)")
    shapes.add_argument("--reconstructions", help="also save corpus images above their autoencoder reconstructions")
    shapes.add_argument("--json", action="store_true", help="print the result as JSON")
    auto = commands.add_parser("autoencoder", help="what an autoencoder keeps of shapes images")
    auto.add_argument("--vqvae", required=True, help="an AutoencoderKL folder")
    auto.add_argument("--resolution", type=int, required=True)
    auto.add_argument("--num_images", type=int, default=200)
    auto.add_argument("--grid", help="save inputs (top row) vs reconstructions (bottom row)")
    auto.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from ldm.runtime.device import use_fast_cpu_kernels

    use_fast_cpu_kernels()
    from ldm.runtime.tracking import quiet_libraries

    quiet_libraries()
    for name in ("num_images_per_prompt", "num_inference_steps", "num_images", "reference_images"):
        if getattr(args, name, 1) < 1:
            parser.exit(2, f"error: --{name} must be at least 1\n")
    try:
        if args.command == "shapes":
            result = evaluate_model(args.model, num_images_per_prompt=args.num_images_per_prompt,
                                    guidance_scale=args.guidance_scale, num_inference_steps=args.num_inference_steps,
                                    seed=args.seed, reference_images=args.reference_images, grid=args.grid,
                                    reconstructions=args.reconstructions)
        else:
            result = evaluate_autoencoder(args.vqvae, resolution=args.resolution, num_images=args.num_images,
                                          grid=args.grid)
    except (UserError, OSError) as e:
        parser.exit(2, f"error: {e}\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
