"""Reference outputs for the diffusion-transformer interop tests (tests/test_models_sd3.py and
tests/test_models_pixart.py), computed by diffusers and transformers themselves. Runs in its own virtualenv (the
project needs no torch):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 diffusers transformers safetensors numpy sentencepiece protobuf
    /work/refvenv/bin/python tests/reference/make_transformer_fixtures.py

Writes tests/fixtures/sd3/ and tests/fixtures/pixart/: `exported.npz`, diffusers' outputs for the project's seeded
sd3-tiny and pixart-tiny pipelines (tests/interop_models.py --sd3 / --pixart, run in the project's venv: written in
diffusers' layout by `ldm.inference.export`), loaded by diffusers' `StableDiffusion3Pipeline` / `PixArtAlphaPipeline`:
the prompts' states (SD3: and pooled vectors; PixArt: and masks) from the pipeline's `encode_prompt` at the trained
caption length, the transformer's prediction at two timesteps, a decode, and two steps of the whole pipeline with
guidance 3 from the noise of `ldm.generate --seed 7`; `reference.json` has the weight files' sha256, so the suite knows
it built the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from make_interop_fixtures import sha256, versions  # noqa: E402

PROMPTS = ["a red circle on a blue background", ""]
LENGTH = 16  # tests/interop_models.py MAX_LENGTH: the caption length the tiny pipelines' tokenizers carry
SHARED = ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
          "text_encoder/model.safetensors")


def sd3_conditions(pipeline) -> tuple[dict, dict]:
    """(the prompts' states and pooled vectors, the transformer's keyword arguments for them)."""
    states, pooled = [], []
    for prompt in PROMPTS:
        embeds, _, pooled_embeds, _ = pipeline.encode_prompt(
            prompt, prompt, prompt, do_classifier_free_guidance=False, max_sequence_length=LENGTH)
        states.append(embeds[0].numpy())
        pooled.append(pooled_embeds[0].numpy())
    states, pooled = np.stack(states), np.stack(pooled)
    return ({"states": states, "pooled": pooled},
            {"encoder_hidden_states": torch.from_numpy(states), "pooled_projections": torch.from_numpy(pooled)})


def pixart_conditions(pipeline) -> tuple[dict, dict]:
    """(the prompts' T5 states and masks, the transformer's keyword arguments for them)."""
    states, masks = [], []
    for prompt in PROMPTS:
        embeds, mask, _, _ = pipeline.encode_prompt(prompt, do_classifier_free_guidance=False, clean_caption=False,
                                                    max_sequence_length=LENGTH)
        states.append(embeds[0].numpy())
        masks.append(mask[0].numpy())
    states, masks = np.stack(states), np.stack(masks)
    return ({"states": states, "mask": masks},
            {"encoder_hidden_states": torch.from_numpy(states), "encoder_attention_mask": torch.from_numpy(masks),
             "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}})


FAMILIES = {  # fixture folder: (interop_models flag, pipeline class, its weight files, conditions, pipeline kwargs)
    "sd3": ("--sd3", "StableDiffusion3Pipeline",
            SHARED + ("text_encoder_2/model.safetensors", "text_encoder_3/model.safetensors"), sd3_conditions, {}),
    "pixart": ("--pixart", "PixArtAlphaPipeline", SHARED, pixart_conditions,
               {"use_resolution_binning": False, "clean_caption": False}),
}


def pipeline_outputs(pipeline, conditions, call: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    with torch.no_grad():
        encoded, kwargs = conditions(pipeline)
        size = pipeline.transformer.config.sample_size
        latents = rng.standard_normal((2, pipeline.transformer.config.in_channels, size, size)).astype(np.float32)
        timesteps = np.array([10.0, 700.0], dtype=np.float32)
        prediction = pipeline.transformer(hidden_states=torch.from_numpy(latents), timestep=torch.from_numpy(timesteps),
                                          **kwargs).sample
        decode_in = rng.standard_normal((1, pipeline.vae.config.latent_channels, size, size)).astype(np.float32)
        image = pipeline.vae.decode(torch.from_numpy(decode_in)).sample
        pixels = size * pipeline.vae_scale_factor
        # the initial noise of `ldm.generate --seed 7`'s first image (`ldm.inference.sampling.initial_noise`)
        noise = np.random.default_rng([7, 0]).standard_normal(latents.shape[1:]).astype(np.float32)[None]
        generated = pipeline(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, output_type="np",
                             latents=torch.from_numpy(noise), max_sequence_length=LENGTH, height=pixels,
                             width=pixels, **call).images
    return {**encoded, "latents": latents, "timesteps": timesteps, "prediction": prediction.numpy(),
            "decode_latents": decode_in, "image": image.numpy(), "generated": generated}


def main() -> None:
    import diffusers

    project_python = os.path.join(ROOT, ".venv", "bin", "python")
    torch.set_num_threads(2)
    for name, (flag, class_name, weights, conditions, call) in FAMILIES.items():
        out = os.path.join(ROOT, "tests", "fixtures", name)
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryDirectory() as work:
            subprocess.run([project_python, os.path.join(ROOT, "tests", "interop_models.py"), work, flag],
                           check=True, cwd=ROOT)
            folder = os.path.join(work, "diffusers")
            pipeline = getattr(diffusers, class_name).from_pretrained(folder)  # offline: a local folder
            outputs = pipeline_outputs(pipeline, conditions, call, np.random.default_rng(3))
            np.savez_compressed(os.path.join(out, "exported.npz"), **outputs)
            reference = {"versions": versions(), "weights_sha256": {w: sha256(os.path.join(folder, w))
                                                                     for w in weights},
                         "classes": {part: type(component).__name__ for part, component in pipeline.components.items()
                                     if component is not None}}
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(reference, f, indent=1)
        print(name, json.dumps(reference, indent=1))


if __name__ == "__main__":
    main()
