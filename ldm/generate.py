"""Generate images from a training checkpoint or an exported pipeline folder.

    python -m ldm.generate --model OUTPUT/pipeline --prompt "a red circle on a blue background" \\
        --num_inference_steps 50 --guidance_scale 7.5 --seed 0 --output_dir samples/

Writes one PNG per image (`<prompt index>-<image index>.png`) and `grid.png`: a row per prompt with the
prompt written at its left, images enlarged (nearest neighbour) to at least `--grid_cell` pixels.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from ldm.runtime.cli import ToolParser
from ldm.runtime.errors import UserError


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "empty"


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m ldm.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint-<step> folder or pipeline folder")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line")
    parser.add_argument("--negative_prompt", default="",
                        help="what guidance steers away from: the unconditional input (default: the empty caption)")
    parser.add_argument("--num_images_per_prompt", type=int, default=1)
    parser.add_argument("--num_inference_steps", type=int, default=50)
    parser.add_argument("--guidance_scale", type=float, default=7.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--height", type=int, default=None,
                        help="image height in pixels (default: the size the model was trained at)")
    parser.add_argument("--width", type=int, default=None,
                        help="image width in pixels, a multiple of the autoencoder's downsampling")
    parser.add_argument("--no_ema", action="store_true", help="use raw weights of a checkpoint that has EMA ones")
    parser.add_argument("--grid_cell", type=int, default=128,
                        help="smallest side of an image in grid.png, in pixels (enlarged by a whole factor)")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    from ldm.runtime.device import use_fast_cpu_kernels

    use_fast_cpu_kernels()

    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.strip() for line in f if line.strip()]
        except OSError as e:
            parser.exit(2, f"error: cannot read --prompts_file: {e.strerror or e}\n")
    if not prompts:
        parser.exit(2, "error: give at least one --prompt or a --prompts_file\n")
    for name in ("num_images_per_prompt", "num_inference_steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.exit(2, f"error: --{name} must be at least 1\n")

    from ldm.runtime.tracking import quiet_libraries

    quiet_libraries()
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, labeled_grid, latent_size, sampling_scheduler
    from ldm.models.text import prompt_length

    try:
        unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(args.model, not args.no_ema)
    except (UserError, OSError) as e:
        parser.exit(2, f"error: {e}\n")
    tokenize = CaptionTokenizer(tokenizer, prompt_length(text_encoder, tokenizer))
    warn_cut_prompts(tokenize, [*prompts, args.negative_prompt])
    repeated = [p for p in prompts for _ in range(args.num_images_per_prompt)]
    try:
        latent_size(unet, vae, args.height, args.width)
    except ValueError as e:  # a size the autoencoder cannot make
        parser.exit(2, f"error: {e}\n")
    images = generate(unet, text_encoder, vae, sampling_scheduler(scheduler_config), tokenize, repeated,
                      guidance_scale=args.guidance_scale, num_inference_steps=args.num_inference_steps,
                      seed=args.seed, batch_size=args.batch_size, height=args.height, width=args.width,
                      negative_prompt=args.negative_prompt)
    from PIL import Image

    from ldm.runtime.files import save_image

    os.makedirs(args.output_dir, exist_ok=True)
    for i, image in enumerate(images):
        p, k = divmod(i, args.num_images_per_prompt)
        save_image(Image.fromarray(image), os.path.join(args.output_dir, f"{p:03d}-{k:02d}-{slug(prompts[p])}.png"))
    save_image(labeled_grid(images, prompts, args.grid_cell), os.path.join(args.output_dir, "grid.png"))
    print(f"wrote {len(images)} images and grid.png to {args.output_dir}")
    return 0


def warn_cut_prompts(tokenize, prompts: list[str]) -> None:
    """One line per prompt longer than the caption length the model was trained with, whose end is left out (as
    diffusers' pipelines say of theirs)."""
    for prompt in dict.fromkeys(prompts):
        tokenize(prompt)
        if tokenize.cut:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            print(f"warning: the prompt {shown!r} is longer than the {tokenize.max_length} tokens this model was "
                  f"trained with: its last {tokenize.cut} tokens are left out", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
