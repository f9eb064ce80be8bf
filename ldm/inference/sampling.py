"""Sampling: prompts -> images with DDIM (flow matching: Euler) and classifier-free guidance.

A free function of (unet, text encoder, vae, scheduler, token ids), used by the training loops
for image logging and by `python -m ldm.generate`. Initial noise is drawn per image from
(seed, image index), so an image does not depend on the batch size it was generated in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import paddle
from PIL import Image
from ppdiffusers import DDIMScheduler

from ldm.models.autoencoder import to_uint8, unscaled_latents
from ldm.models.backbone import autoencoder_factor, check_image_size
from ldm.models.conditioning import Conditioning
from ldm.models.families import family_of, predict
from ldm.models.text import empty_caption, encode_prompt


def ddim_scheduler(noise_scheduler_config: dict, prediction_type: str | None = None):
    """The reference sampler: DDIM with the training betas, clip_sample off, steps_offset 1."""
    config = noise_scheduler_config
    return DDIMScheduler(
        beta_start=config["beta_start"],
        beta_end=config["beta_end"],
        beta_schedule=config["beta_schedule"],
        num_train_timesteps=config["num_train_timesteps"],
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type or config.get("prediction_type", "epsilon"),
    )


def sampling_scheduler(noise_scheduler_config: dict):
    """The sampler of a training noise schedule: flow matching's Euler steps (`FlowMatchEulerDiscreteScheduler`, its
    shift); the sampler the model source came with (a pipeline's `scheduler/`, kept as the training schedule's
    `_sampler`, or a sampler's own config), predicting what the model was trained to; else the reference's DDIM."""
    import ppdiffusers

    from ldm.models.noise import is_flow

    config = noise_scheduler_config
    if is_flow(config):
        return ppdiffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    sampler = config.get("_sampler") or (config if config.get("_class_name") not in (None, "DDPMScheduler") else None)
    sampler_class = getattr(ppdiffusers, str((sampler or {}).get("_class_name")), None)
    if sampler_class is None:
        return ddim_scheduler(config)
    return sampler_class.from_config({**sampler, "prediction_type": config.get("prediction_type", "epsilon")})


def initial_noise(shape: Sequence[int], seed: int, index: int) -> np.ndarray:
    return np.random.default_rng([seed, index]).standard_normal(shape).astype(np.float32)


@paddle.no_grad()
def generate(
    unet,
    text_encoder,
    vae,
    scheduler,
    tokenize: Callable[[str], np.ndarray],
    prompts: Sequence[str],
    *,
    guidance_scale: float = 7.5,
    num_inference_steps: int = 50,
    seed: int = 0,
    batch_size: int = 8,
    first_index: int = 0,
    height: int | None = None,
    width: int | None = None,
    negative_prompt: str = "",
) -> np.ndarray:
    """uint8 images [len(prompts), H, W, 3]; the models are in eval mode meanwhile, then restored.

    Image i's noise is drawn from (seed, first_index + i): a slice of a longer list, generated elsewhere (another
    rank), gets the noise it has in the whole list. `height` and `width` (pixels, multiples of the autoencoder's
    downsampling) default to the size the UNet was trained at. `negative_prompt` is the unconditional input of the
    guidance (as diffusers' pipelines take it): the empty caption by default, what the model learned from dropped
    captions (`ldm.models.text.empty_caption`: zeros where its pipeline says `force_zeros_for_empty_prompt`, as
    diffusers' pipeline makes the negative when none is given)."""
    modes = [(m, m.training) for m in (unet, text_encoder, vae)]
    for model, _ in modes:
        model.eval()
    random_state = paddle.get_rng_state()  # the flow Euler step draws (unused) noise: training's generator kept
    try:
        rows, cols = latent_size(unet, vae, height, width)
        channels = unet.config.in_channels
        uncond_ids = paddle.to_tensor(tokenize(negative_prompt))[None]
        factor = autoencoder_factor(vae.config)
        added = family_of(unet, text_encoder).sampling_added(rows * factor, cols * factor, 1, unet)
        images = []
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start : start + batch_size])
            ids = paddle.to_tensor(np.stack([tokenize(p) for p in chunk]))
            conditioning = replace(encode_prompt(text_encoder, ids), added=added).repeat(len(chunk))
            guided = guidance_scale != 1.0
            if guided:
                negative = encode_prompt(text_encoder, uncond_ids) if negative_prompt else empty_caption(
                    text_encoder, uncond_ids)
                unconditional = replace(negative, added=added).repeat(len(chunk))
                conditioning = Conditioning.concat([unconditional, conditioning])
            latents = paddle.to_tensor(np.stack([initial_noise([channels, rows, cols], seed, first_index + start + i)
                                                 for i in range(len(chunk))]))
            # after set_timesteps: Euler's initial sigma is the largest of the steps taken (flow matching: pure noise)
            scheduler.set_timesteps(num_inference_steps)
            latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)
            for t in scheduler.timesteps:
                model_input = paddle.concat([latents] * 2) if guided else latents
                if hasattr(scheduler, "scale_model_input"):
                    model_input = scheduler.scale_model_input(model_input, t)
                prediction = predict(unet, model_input, t, conditioning)
                if guided:
                    uncond_pred, cond_pred = prediction.chunk(2)
                    prediction = uncond_pred + guidance_scale * (cond_pred - uncond_pred)
                latents = scheduler.step(prediction, t, latents).prev_sample
            images.append(to_uint8(vae.decode(unscaled_latents(vae, latents.astype("float32"))).sample))
        return np.concatenate(images)
    finally:
        paddle.set_rng_state(random_state)
        for model, training in modes:
            model.train() if training else model.eval()


def latent_size(unet, vae, height: int | None, width: int | None) -> tuple[int, int]:
    """(rows, columns) of the latents of a `height` x `width` image (None: the UNet's trained size); ValueError
    (`ImageSizeError`) for a size the backbone and autoencoder cannot make (`check_image_size`)."""
    factor = autoencoder_factor(vae.config)
    trained = unet.config.sample_size * factor
    height, width = (trained if side is None else side for side in (height, width))
    check_image_size(unet.config, vae.config, height, width, f"an image of {height}x{width} px (--height x --width)")
    return height // factor, width // factor


# the widest a grid's label column grows: a long prompt wraps within it, and is cut where its row ends
LABEL_WIDTH = 360


def labeled_grid(images: np.ndarray, prompts: list[str], min_cell: int = 128) -> Image.Image:
    """A grid a person can read: a row per prompt with the prompt written at its left (wrapped within
    `LABEL_WIDTH` pixels, as many lines as its row holds, the last ending "..." when the prompt goes on), the
    images enlarged by a whole factor (nearest neighbour: no invented detail) to at least `min_cell` pixels."""
    from PIL import ImageDraw, ImageFont

    count, height, width, _ = images.shape
    scale = max(1, -(-min_cell // max(height, width)))
    grid = image_grid(images, len(prompts))
    grid = grid.resize((grid.width * scale, grid.height * scale), Image.Resampling.NEAREST)
    font = ImageFont.load_default(size=max(12, min(20, height * scale // 6)))
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    margin = 12
    row_height = height * scale
    text_width = min(LABEL_WIDTH, int(max(measure.textlength(prompt, font=font) for prompt in prompts)))
    line_height = int(font.size * 1.25)
    fitting = max(1, (row_height - margin) // line_height)
    labels = [label_lines(prompt, lambda text: measure.textlength(text, font=font), text_width, fitting)
              for prompt in prompts]
    out = Image.new("RGB", (text_width + 2 * margin + grid.width, grid.height), "white")
    out.paste(grid, (text_width + 2 * margin, 0))
    draw = ImageDraw.Draw(out)
    for row, lines in enumerate(labels):
        top = row * row_height + (row_height - line_height * len(lines)) // 2
        for i, line in enumerate(lines):
            draw.text((margin, top + i * line_height + line_height // 2), line, fill="black", font=font, anchor="lm")
    return out


def label_lines(text: str, length: Callable[[str], float], width: float, most: int) -> list[str]:
    """`text` wrapped at spaces into lines at most `width` long (`length` measures one; a word longer than a line is
    broken), at most `most` of them: a text cut short ends its last line with "..."."""
    lines: list[str] = []
    words = text.split()
    while words and len(lines) < most:
        line = words.pop(0)
        while length(line) > width and len(line) > 1:  # a word wider than the column: broken where it overflows
            cut = max(i for i in range(1, len(line) + 1) if i == 1 or length(line[:i]) <= width)
            lines.append(line[:cut])
            line = line[cut:]
        while words and length(f"{line} {words[0]}") <= width:
            line = f"{line} {words.pop(0)}"
        lines.append(line)
    if len(lines) > most or words:
        lines = lines[:most]
        last = lines[-1]
        while last and length(last + "...") > width:
            last = last[:-1].rstrip()
        lines[-1] = last + "..."
    return lines


def image_grid(images: np.ndarray, rows: int) -> Image.Image:
    """[N, H, W, 3] uint8 -> one image with `rows` rows (N must be a multiple of rows)."""
    count, height, width, _ = images.shape
    cols = -(-count // rows)
    grid = np.full((rows * height, cols * width, 3), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid[r * height : (r + 1) * height, c * width : (c + 1) * width] = image
    return Image.fromarray(grid)
