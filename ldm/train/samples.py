"""Validation images logged during training (rank 0's writer only)."""

from __future__ import annotations

import contextlib

import numpy as np

from ldm.data.tokenize import CaptionTokenizer
from ldm.inference.sampling import generate, image_grid, sampling_scheduler
from ldm.models.noise import scheduler_config

# Prompts of the validation images when --validation_prompts gives none: general ones, fixed so runs compare.
DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a painting of a lighthouse at sunset",
    "a bowl of fruit on a wooden table",
    "a city street at night in the rain",
)


def validation_sizes(buckets) -> list[tuple[int, int] | None]:
    """The sizes of the validation grids: the trained square size (None), and with aspect-ratio buckets the
    widest and the tallest bucket too."""
    if not buckets:
        return [None]
    return [None] + [b for b in dict.fromkeys((buckets[-1], buckets[0])) if b[0] != b[1]]  # sorted by ratio


def log_validation(writer, step: int, model, tokenizer, model_max_length: int, sampling, ema=None,
                   sizes=(None,)) -> None:
    """One grid per guidance scale and size (`validation_sizes`: (height, width), None for the trained square): a row
    per prompt; with EMA, the trained weights (left) beside the EMA's (right). Every image of a grid starts from
    the same noise (`--validation_seed`)."""
    if not writer.active:
        return
    prompts = sampling.validation_prompts or DEFAULT_PROMPTS
    tokenize = CaptionTokenizer(tokenizer, model_max_length)
    scheduler = sampling_scheduler(scheduler_config(model.noise_scheduler))
    weights = [contextlib.nullcontext] + ([lambda: ema.swapped(model)] if ema is not None else [])
    grids = {(scale, size): [] for size in sizes for scale in sampling.validation_guidance_scales}
    for swap in weights:  # generate() puts every part back in the mode it found it in
        with swap():  # the trained weights are put back exactly afterwards
            for (guidance, size), images in grids.items():
                height, width = size or (None, None)
                images.append(generate(model.unet, model.text_encoder, model.vae, scheduler, tokenize, prompts,
                                       guidance_scale=guidance, num_inference_steps=sampling.num_inference_steps,
                                       seed=sampling.validation_seed, height=height, width=width))
    for (guidance, size), images in grids.items():
        grid = np.stack(images, axis=1).reshape(-1, *images[0].shape[1:])  # prompt by prompt, raw then EMA
        name = f"validation/guidance_{guidance:g}" + (f"_{size[0]}x{size[1]}" if size else "")
        writer.image(name, np.asarray(image_grid(grid, len(prompts))), step)
