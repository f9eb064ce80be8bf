"""A PixArt-α pipeline as diffusers itself saves it, for tests/test_models_pixart.py: a tiny `PixArtAlphaPipeline`
built from diffusers' and transformers' own classes (its transformer a `PixArtTransformer2DModel`, which has no
`caption_projection.y_embedding`; its T5 tokenizer a transformers 5 `tokenizer.json`), saved by `save_pretrained`,
then read back with `torch_dtype=torch.bfloat16` and saved again, as SD3.5 and PixArt-Σ ship. Runs in its own
virtualenv (the project needs no torch):

    /work/refvenv/bin/python tests/reference/make_diffusers_pixart_fixtures.py [--multi-scale]

Writes tests/fixtures/pixart-diffusers/{float32,bfloat16}/: `pipeline/` (the saved folder), `diffusers.npz` (what
diffusers' pipeline computes on it, read in float32: `make_transformer_fixtures.pipeline_outputs`, so the guided steps
take the unconditional branch from the T5 encoding of the empty caption, with its mask) and `reference.json`.

And tests/fixtures/pixart-diffusers/multi-scale/: a tiny multi-scale transformer (`use_additional_conditions`, at
PixArt-α's 1024 px models' sample_size 128, the only one diffusers' pipeline gives the conditions at; 24 wide:
adaLN-single gives a third of its width to each of the resolution's two numbers and the aspect ratio) saved by
diffusers (`transformer/`), and `multi_scale.npz`: its prediction on non-square latents for two images' resolution
(original height, width) and aspect ratio (their crop's height / width), and the `added_cond_kwargs` diffusers'
`PixArtAlphaPipeline` gives the transformer when sampling 48 x 32 pixels.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from make_interop_fixtures import clean_configs, sha256, versions  # noqa: E402
from make_transformer_fixtures import FAMILIES, pipeline_outputs, pixart_conditions  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "pixart-diffusers")
TOKENIZER = os.path.join(ROOT, "ldm", "models", "presets", "pixart-tiny", "tokenizer")  # its spiece.model
# PixArt-α's own sampler, as on the Hub (`tests/interop_models.py` gives the project's tiny pipeline the same)
SAMPLER = {"algorithm_type": "dpmsolver++", "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
           "lower_order_final": True, "num_train_timesteps": 1000, "prediction_type": "epsilon", "solver_order": 2,
           "solver_type": "midpoint", "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
           "use_karras_sigmas": False}
WEIGHTS = ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
           "text_encoder/model.safetensors")


def tiny_pipeline():
    """The smallest PixArt-α pipeline of the shapes PixArt's code takes: a 2-block DiT 16 wide over 8 x 8 latents of a
    3-level autoencoder (32 px images), a 1-layer T5 16 wide, the pixart-tiny preset's 64-piece SentencePiece."""
    import diffusers
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    torch.manual_seed(0)
    transformer = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=4, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3)
    text_encoder = T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                           feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0,
                                           eos_token_id=1))
    tokenizer = T5Tokenizer.from_pretrained(TOKENIZER, model_max_length=16)
    scheduler = diffusers.DPMSolverMultistepScheduler(**SAMPLER)
    return diffusers.PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae,
                                         transformer=transformer, scheduler=scheduler)


def write(folder: str, pipeline) -> None:
    """`pipeline/` as `save_pretrained` writes it, diffusers' outputs on it read back in float32, the reference."""
    import diffusers

    saved = os.path.join(folder, "pipeline")
    shutil.rmtree(saved, ignore_errors=True)
    pipeline.save_pretrained(saved)
    clean_configs(saved)
    read = diffusers.PixArtAlphaPipeline.from_pretrained(saved, torch_dtype=torch.float32)
    outputs = pipeline_outputs(read, pixart_conditions, FAMILIES["pixart"][4], np.random.default_rng(3))
    np.savez_compressed(os.path.join(folder, "diffusers.npz"), **outputs)
    reference = {"versions": versions(), "weights_sha256": {w: sha256(os.path.join(saved, w)) for w in WEIGHTS},
                 "classes": {part: type(component).__name__ for part, component in read.components.items()
                             if component is not None}}
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(folder, json.dumps(reference, indent=1))


def multi_scale() -> None:
    """The multi-scale transformer, its prediction with resolution and aspect-ratio conditions, and what the pipeline
    conditions a sample on."""
    import diffusers

    folder = os.path.join(OUT, "multi-scale")
    torch.manual_seed(1)
    transformer = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=24, sample_size=128, patch_size=2, caption_channels=16, use_additional_conditions=True)
    shutil.rmtree(os.path.join(folder, "transformer"), ignore_errors=True)
    transformer.save_pretrained(os.path.join(folder, "transformer"))
    rng = np.random.default_rng(5)
    latents = rng.standard_normal([2, 4, 12, 8]).astype(np.float32)
    states = rng.standard_normal([2, 5, 16]).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], np.int64)
    timesteps = np.array([10, 700], np.int64)
    resolution = np.array([[300, 200], [96, 64]], np.float32)  # the images' sizes before the resize
    aspect_ratio = np.array([[48 / 32], [48 / 32]], np.float32)  # their 48 x 32 crops' (a bucket's) height / width
    with torch.no_grad():
        prediction = transformer(torch.from_numpy(latents), encoder_hidden_states=torch.from_numpy(states),
                                 encoder_attention_mask=torch.from_numpy(mask), timestep=torch.from_numpy(timesteps),
                                 added_cond_kwargs={"resolution": torch.from_numpy(resolution),
                                                    "aspect_ratio": torch.from_numpy(aspect_ratio)}).sample.numpy()
    given = {}

    class Given(Exception):
        """The first call's conditions are recorded: the sampling stops there."""

    def record(module, args, kwargs):
        given.update({name: value.numpy() for name, value in kwargs["added_cond_kwargs"].items()})
        raise Given

    pipeline = tiny_pipeline()
    pipeline = diffusers.PixArtAlphaPipeline(tokenizer=pipeline.tokenizer, text_encoder=pipeline.text_encoder,
                                             vae=pipeline.vae, transformer=transformer, scheduler=pipeline.scheduler)
    handle = transformer.register_forward_pre_hook(record, with_kwargs=True)
    with contextlib.suppress(Given):
        pipeline("a red circle", height=48, width=32, num_inference_steps=2, use_resolution_binning=False,
                 clean_caption=False, max_sequence_length=16)
    handle.remove()
    np.savez_compressed(os.path.join(folder, "multi_scale.npz"), latents=latents, states=states, mask=mask,
                        timesteps=timesteps, resolution=resolution, aspect_ratio=aspect_ratio, prediction=prediction,
                        sampled_resolution=given["resolution"], sampled_aspect_ratio=given["aspect_ratio"])
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump({"versions": versions(), "weights_sha256": {"transformer/diffusion_pytorch_model.safetensors": sha256(
            os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"))}}, f, indent=1)
    print(folder, given)


def main() -> None:
    import diffusers

    torch.set_num_threads(2)
    if "--multi-scale" in sys.argv:  # that fixture alone (the others stay as they were made)
        multi_scale()
        return
    for dtype in ("float32", "bfloat16"):
        os.makedirs(os.path.join(OUT, dtype), exist_ok=True)
    write(os.path.join(OUT, "float32"), tiny_pipeline())
    bf16 = diffusers.PixArtAlphaPipeline.from_pretrained(os.path.join(OUT, "float32", "pipeline"),
                                                         torch_dtype=torch.bfloat16)
    write(os.path.join(OUT, "bfloat16"), bf16)
    multi_scale()


if __name__ == "__main__":
    main()
