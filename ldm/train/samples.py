"""Validation images logged during training (rank 0's writer only)."""

from __future__ import annotations

import contextlib

import numpy as np

from ldm.data.tokenize import CaptionTokenizer
from ldm.sampling import ddim_scheduler, generate, image_grid

# Prompts of the validation images when --validation_prompts gives none: general ones, fixed so runs compare.
DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a painting of a lighthouse at sunset",
    "a bowl of fruit on a wooden table",
    "a city street at night in the rain",
)


def log_validation(writer, step: int, model, tokenizer, model_max_length: int, sampling, ema=None) -> None:
    """One grid per guidance scale: a row per prompt; with EMA, the trained weights (left) beside the EMA's
    (right). Every image of a grid starts from the same noise (`--validation_seed`)."""
    if not writer.active:
        return
    prompts = sampling.validation_prompts or DEFAULT_PROMPTS
    tokenize = CaptionTokenizer(tokenizer, model_max_length)
    scheduler = ddim_scheduler(dict(model.noise_scheduler.config))
    weights = [contextlib.nullcontext] + ([lambda: ema.swapped(model)] if ema is not None else [])
    columns: dict[float, list[np.ndarray]] = {scale: [] for scale in sampling.validation_guidance_scales}
    for swap in weights:  # generate() puts every part back in the mode it found it in
        with swap():  # the trained weights are put back exactly afterwards
            for guidance, images in columns.items():
                images.append(generate(model.unet, model.text_encoder, model.vae, scheduler, tokenize, prompts,
                                       guidance_scale=guidance, num_inference_steps=sampling.num_inference_steps,
                                       seed=sampling.validation_seed))
    for guidance, images in columns.items():
        grid = np.stack(images, axis=1).reshape(-1, *images[0].shape[1:])  # prompt by prompt, raw then EMA
        writer.image(f"validation/guidance_{guidance:g}", np.asarray(image_grid(grid, len(prompts))), step)
