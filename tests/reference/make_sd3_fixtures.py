"""Reference outputs for the Stable Diffusion 3 interop test (tests/test_models_sd3.py), computed by diffusers and
transformers themselves. Runs in its own virtualenv (the project needs no torch):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 diffusers transformers safetensors numpy sentencepiece protobuf
    /work/refvenv/bin/python tests/reference/make_sd3_fixtures.py

Writes tests/fixtures/sd3/: `exported.npz`, diffusers' outputs for the project's seeded sd3-tiny pipeline
(tests/interop_models.py --sd3, run in the project's venv: written in diffusers' layout by `ldm.inference.export`),
loaded by diffusers' `StableDiffusion3Pipeline`: the prompts' states and pooled vectors (`encode_prompt`, the three
encoders at the trained caption length), the transformer's prediction at two timesteps, a decode, and two flow Euler
steps of the whole pipeline with guidance 3 from the noise of `ldm.generate --seed 7`; `reference.json` has the weight
files' sha256, so the suite knows it built the same weights.
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
OUT = os.path.join(ROOT, "tests", "fixtures", "sd3")
sys.path.insert(0, HERE)
from make_interop_fixtures import sha256, versions  # noqa: E402

PROMPTS = ["a red circle on a blue background", ""]
LENGTH = 16  # tests/interop_models.py MAX_LENGTH: the caption length the tiny pipeline's tokenizers carry
WEIGHTS = ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
           "text_encoder/model.safetensors", "text_encoder_2/model.safetensors", "text_encoder_3/model.safetensors")


def pipeline_outputs(pipeline, rng: np.random.Generator) -> dict[str, np.ndarray]:
    states, pooled = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            embeds, _, pooled_embeds, _ = pipeline.encode_prompt(
                prompt, prompt, prompt, do_classifier_free_guidance=False, max_sequence_length=LENGTH)
            states.append(embeds[0].numpy())
            pooled.append(pooled_embeds[0].numpy())
        states, pooled = np.stack(states), np.stack(pooled)
        size = pipeline.transformer.config.sample_size
        latents = rng.standard_normal((2, pipeline.transformer.config.in_channels, size, size)).astype(np.float32)
        timesteps = np.array([10.0, 700.0], dtype=np.float32)
        prediction = pipeline.transformer(hidden_states=torch.from_numpy(latents), timestep=torch.from_numpy(timesteps),
                                          encoder_hidden_states=torch.from_numpy(states),
                                          pooled_projections=torch.from_numpy(pooled)).sample
        decode_in = rng.standard_normal((1, pipeline.vae.config.latent_channels, size, size)).astype(np.float32)
        image = pipeline.vae.decode(torch.from_numpy(decode_in)).sample
        pixels = size * pipeline.vae_scale_factor
        # the initial noise of `ldm.generate --seed 7`'s first image (`ldm.inference.sampling.initial_noise`)
        noise = np.random.default_rng([7, 0]).standard_normal(latents.shape[1:]).astype(np.float32)[None]
        generated = pipeline(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, output_type="np",
                             latents=torch.from_numpy(noise), max_sequence_length=LENGTH, height=pixels,
                             width=pixels).images
    return {"states": states, "pooled": pooled, "latents": latents, "timesteps": timesteps,
            "prediction": prediction.numpy(), "decode_latents": decode_in, "image": image.numpy(),
            "generated": generated}


def main() -> None:
    from diffusers import StableDiffusion3Pipeline

    project_python = os.path.join(ROOT, ".venv", "bin", "python")
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([project_python, os.path.join(ROOT, "tests", "interop_models.py"), work, "--sd3"], check=True,
                       cwd=ROOT)
        folder = os.path.join(work, "diffusers")
        pipeline = StableDiffusion3Pipeline.from_pretrained(folder)  # offline: a local folder
        np.savez_compressed(os.path.join(OUT, "exported.npz"), **pipeline_outputs(pipeline, np.random.default_rng(3)))
        reference = {"versions": versions(), "weights_sha256": {name: sha256(os.path.join(folder, name))
                                                                 for name in WEIGHTS},
                     "classes": {part: type(getattr(pipeline, part)).__name__ for part in (
                         "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
                         "tokenizer_3", "transformer", "scheduler")}}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(json.dumps(reference, indent=1))


if __name__ == "__main__":
    main()
