"""Reference outputs for the Stable Diffusion interop tests (tests/test_inference_sd.py), computed by diffusers and
transformers themselves. Runs in its own virtualenv (the project needs no torch):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 diffusers transformers safetensors numpy
    /work/refvenv/bin/python tests/reference/make_sd_fixtures.py

Writes tests/fixtures/sd/:
  exported.npz          diffusers' outputs (the CLIP text encoder's hidden states, the UNet's prediction, a decode)
                        for the project's seeded sd-tiny pipeline (tests/interop_models.py --sd, run in the project's
                        venv) after `python -m ldm.export --format diffusers`, loaded by `StableDiffusionPipeline`;
                        reference.json has its weight files' sha256, so the suite knows it exported the same weights
  diffusers/            a random tiny StableDiffusionPipeline built and saved by diffusers and transformers (float16
                        values, safetensors), with the sd-tiny preset's tokenizer files; diffusers.npz: its outputs
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "tests", "fixtures", "sd")
TOKENIZER = os.path.join(ROOT, "ldm", "models", "presets", "sd-tiny", "tokenizer")
sys.path.insert(0, HERE)
from make_interop_fixtures import fill_seeded, relative, sha256, versions  # noqa: E402

PROMPTS = ["a red circle on a blue background", ""]
EXPORTED_WEIGHTS = ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                    "text_encoder/model.safetensors")


def pipeline_outputs(pipeline, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What the pipeline computes from fixed inputs, as its `__call__` would: the prompts' token ids (the empty one is
    the unconditional prompt) and hidden states, the UNet's prediction on them at two timesteps, a decode; and two
    DDIM steps of the whole pipeline with classifier-free guidance, from given latents."""
    tokens = pipeline.tokenizer(PROMPTS, padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt")
    size = pipeline.unet.config.sample_size
    latents = rng.standard_normal((2, pipeline.unet.config.in_channels, size, size)).astype(np.float32)
    timesteps = np.array([10, 500], dtype=np.int64)
    decode_in = rng.standard_normal((1, pipeline.vae.config.latent_channels, size, size)).astype(np.float32)
    with torch.no_grad():
        hidden = pipeline.text_encoder(tokens.input_ids)[0]
        prediction = pipeline.unet(torch.from_numpy(latents), torch.from_numpy(timesteps),
                                   encoder_hidden_states=hidden).sample
        image = pipeline.vae.decode(torch.from_numpy(decode_in)).sample
        generated = pipeline(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, output_type="np",
                             latents=torch.from_numpy(latents[:1])).images
    return {"input_ids": tokens.input_ids.numpy(), "latents": latents, "timesteps": timesteps,
            "decode_latents": decode_in, "hidden_states": hidden.numpy(), "prediction": prediction.numpy(),
            "image": image.numpy(), "generated": generated}


def exported(project_python: str, work: str) -> dict:
    from diffusers import StableDiffusionPipeline

    subprocess.run([project_python, os.path.join(ROOT, "tests", "interop_models.py"), work, "--sd"], check=True,
                   cwd=ROOT)
    folder = os.path.join(work, "diffusers")
    subprocess.run([project_python, "-m", "ldm.export", "--checkpoint", os.path.join(work, "ppdiffusers"),
                    "--output", folder, "--format", "diffusers"], check=True, cwd=ROOT)
    pipeline = StableDiffusionPipeline.from_pretrained(folder)  # offline: a local folder
    np.savez_compressed(os.path.join(OUT, "exported.npz"), **pipeline_outputs(pipeline, np.random.default_rng(1)))
    return {"weights_sha256": {name: sha256(os.path.join(folder, name)) for name in EXPORTED_WEIGHTS},
            "text_encoder_class": type(pipeline.text_encoder).__module__ + "." + type(pipeline.text_encoder).__name__,
            "tokenizer_class": type(pipeline.tokenizer).__name__}


def diffusers_pipeline():
    """A random tiny StableDiffusionPipeline (8 and 16 channels: small fixtures), built by diffusers and
    transformers, with sd-tiny's tokenizer."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                layers_per_block=1, norm_num_groups=4, attention_head_dim=2, cross_attention_dim=16,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        layers_per_block=1, norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, sample_size=16)
    tokenizer = CLIPTokenizer.from_pretrained(TOKENIZER)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=16, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    for seed, part in enumerate((unet, text_encoder, vae)):
        fill_seeded(part, 30 + seed, float16_values=True)
        part.eval()
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def saved_by_diffusers() -> dict:
    from diffusers import StableDiffusionPipeline

    pipeline = diffusers_pipeline()
    outputs = pipeline_outputs(pipeline, np.random.default_rng(2))
    folder = os.path.join(OUT, "diffusers")
    shutil.rmtree(folder, ignore_errors=True)
    pipeline.to(torch.float16)  # half the bytes; the weights are float16 values already
    pipeline.save_pretrained(folder, safe_serialization=True)
    reloaded = pipeline_outputs(StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32),
                                np.random.default_rng(2))
    differences = {k: relative(reloaded[k], outputs[k]) for k in ("hidden_states", "prediction", "image")}
    assert max(differences.values()) < 1e-6, differences  # the files hold what was computed
    np.savez_compressed(os.path.join(OUT, "diffusers.npz"), **outputs)
    return {"files": sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)}


def main() -> None:
    project_python = os.path.join(ROOT, ".venv", "bin", "python")
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        reference = {"versions": versions(), "exported": exported(project_python, work),
                     "diffusers": saved_by_diffusers()}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(json.dumps(reference, indent=1))


if __name__ == "__main__":
    main()
