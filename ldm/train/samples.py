"""Sample images logged during training (rank 0's writer only)."""

from __future__ import annotations

import numpy as np

# Prompts of the sample images logged during training (fixed, so that runs compare).
SAMPLE_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a red circle on a blue background",
    "a painting of a lighthouse at sunset",
    "a green square on a white background",
)


def log_samples(writer, step: int, model, tokenizer, model_max_length: int, num_inference_steps: int,
                seed: int = 0, tag: str = "samples") -> None:
    """Sample images at guidance 1.0 and 7.5 for the fixed prompts (on the writing rank only)."""
    if not writer.active:
        return
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.sampling import ddim_scheduler, generate, image_grid

    tokenize = CaptionTokenizer(tokenizer, model_max_length)
    scheduler = ddim_scheduler(dict(model.noise_scheduler.config))
    for guidance in (1.0, 7.5):
        images = generate(model.unet, model.text_encoder, model.vae, scheduler, tokenize, SAMPLE_PROMPTS,
                          guidance_scale=guidance, num_inference_steps=num_inference_steps, seed=seed)
        writer.image(f"{tag}/guidance_{guidance}", np.asarray(image_grid(images, 1)), step)
