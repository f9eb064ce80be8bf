"""A Stable Diffusion XL pipeline as diffusers itself saves it, for tests/test_models_sdxl.py: a tiny
`StableDiffusionXLPipeline` of the sdxl-tiny preset's shapes built from diffusers' and transformers' own classes
(seeded PyTorch initialisation), saved by `save_pretrained` three ways, as the Hub's SDXL folders come: float32
safetensors, the float16 variant alone (`diffusion_pytorch_model.fp16.safetensors`), and float32 in shards
(`*.safetensors.index.json`: the UNet's, kept alone). Then the project's `python -m ldm.export --format diffusers` of
the float32 folder, read back by diffusers. Runs in its own virtualenv (the project needs no torch):

    /work/refvenv/bin/python tests/reference/make_sdxl_fixtures.py

Writes tests/fixtures/sdxl/: `float32/`, `fp16/`, `sharded/unet/` (the saved folders), `diffusers.npz` (diffusers'
outputs on float32/: the prompts' states and pooled vectors from the pipeline's `encode_prompt`, the UNet's prediction
for a square batch and a non-square one, each row with its own time ids, and two guided Euler steps of the whole
pipeline at 48x24 px from the noise of `ldm.generate --seed 7`: its negative is zeros, `force_zeros_for_empty_prompt`),
`exported.npz` (the same on the project's export) and `reference.json` (versions, the weight files' sha256 of the
saved and the exported folders).
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
sys.path.insert(0, HERE)
from make_interop_fixtures import clean_configs, sha256, versions  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "sdxl")
PRESET = os.path.join(ROOT, "ldm", "models", "presets", "sdxl-tiny")
PROMPTS = ["a red circle on a blue background", ""]
LENGTH = 16  # the caption length the tests train and sample with (tests/interop_models.py MAX_LENGTH)
WEIGHTS = ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
           "text_encoder/model.safetensors", "text_encoder_2/model.safetensors")
# each row's time ids: (original h, w, crop top, left, target h, w), SDXL's add_time_ids order
SQUARE = [[32, 32, 0, 0, 32, 32], [64, 48, 8, 0, 32, 32]]
NON_SQUARE = [[48, 24, 0, 0, 48, 24], [100, 40, 6, 3, 48, 24]]


def read(part: str, name: str = "config.json") -> dict:
    with open(os.path.join(PRESET, part, name)) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def tiny_pipeline():
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**read("unet"))
    vae = diffusers.AutoencoderKL(**read("vae"))
    encoders = []
    for part, model_class in (("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
        config = read(part)
        config.pop("architectures")
        encoders.append(model_class(CLIPTextConfig(**config)).eval())
    tokenizers = [CLIPTokenizer(os.path.join(PRESET, part, "vocab.json"), os.path.join(PRESET, part, "merges.txt"),
                                pad_token=read(part, "special_tokens_map.json")["pad_token"], model_max_length=LENGTH)
                  for part in ("tokenizer", "tokenizer_2")]
    scheduler = diffusers.EulerDiscreteScheduler(**read("scheduler", "scheduler_config.json"))
    return diffusers.StableDiffusionXLPipeline(vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1],
                                               tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=unet,
                                               scheduler=scheduler, force_zeros_for_empty_prompt=True)


def outputs(pipeline, rng: np.random.Generator) -> dict[str, np.ndarray]:
    with torch.no_grad():
        states, pooled = [], []
        for prompt in PROMPTS:
            embeds, _, pooled_embeds, _ = pipeline.encode_prompt(prompt, do_classifier_free_guidance=False)
            states.append(embeds[0].numpy())
            pooled.append(pooled_embeds[0].numpy())
        states, pooled = np.stack(states), np.stack(pooled)
        found = {"states": states, "pooled": pooled}
        for name, (rows, cols), time_ids in (("square", (8, 8), SQUARE), ("non_square", (12, 6), NON_SQUARE)):
            latents = rng.standard_normal((2, 4, rows, cols)).astype(np.float32)
            timesteps = np.array([10.0, 700.0], dtype=np.float32)
            added = {"text_embeds": torch.from_numpy(pooled), "time_ids": torch.tensor(time_ids, dtype=torch.float32)}
            prediction = pipeline.unet(torch.from_numpy(latents), torch.from_numpy(timesteps),
                                       encoder_hidden_states=torch.from_numpy(states), added_cond_kwargs=added).sample
            found.update({f"{name}_latents": latents, f"{name}_timesteps": timesteps,
                          f"{name}_time_ids": np.array(time_ids, np.float32), f"{name}_prediction": prediction.numpy()})
        # the initial noise of `ldm.generate --seed 7`'s first image (`ldm.inference.sampling.initial_noise`)
        noise = np.random.default_rng([7, 0]).standard_normal((4, 12, 6)).astype(np.float32)[None]
        found["generated"] = pipeline(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, output_type="np",
                                      latents=torch.from_numpy(noise), height=48, width=24).images
    return found


def digests(folder: str) -> dict[str, str]:
    return {w: sha256(os.path.join(folder, w)) for w in WEIGHTS}


def main() -> None:
    import diffusers

    torch.set_num_threads(2)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    pipeline = tiny_pipeline()
    saved = {name: os.path.join(OUT, name) for name in ("float32", "fp16", "sharded")}
    pipeline.save_pretrained(saved["float32"])
    clean_configs(saved["float32"])
    read_back = diffusers.StableDiffusionXLPipeline.from_pretrained(saved["float32"])
    read_back.save_pretrained(saved["sharded"], max_shard_size="100KB")
    for name in os.listdir(saved["sharded"]):  # its UNet's shards alone: the tests lay them in a copy of float32/
        if name != "unet":
            path = os.path.join(saved["sharded"], name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    diffusers.StableDiffusionXLPipeline.from_pretrained(saved["float32"], torch_dtype=torch.float16).save_pretrained(
        saved["fp16"], variant="fp16")
    for folder in (saved["sharded"], saved["fp16"]):
        clean_configs(folder)
    np.savez_compressed(os.path.join(OUT, "diffusers.npz"), **outputs(read_back, np.random.default_rng(3)))
    with tempfile.TemporaryDirectory() as work:
        exported = os.path.join(work, "exported")
        subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "ldm.export", "--checkpoint",
                        saved["float32"], "--output", exported, "--format", "diffusers"], check=True, cwd=ROOT)
        theirs = diffusers.StableDiffusionXLPipeline.from_pretrained(exported)
        np.savez_compressed(os.path.join(OUT, "exported.npz"), **outputs(theirs, np.random.default_rng(3)))
        reference = {"versions": versions(), "weights_sha256": digests(saved["float32"]),
                     "exported_weights_sha256": digests(exported),
                     "classes": {part: type(component).__name__ for part, component in theirs.components.items()
                                 if component is not None},
                     "force_zeros_for_empty_prompt": theirs.config.force_zeros_for_empty_prompt}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(json.dumps(reference, indent=1))


if __name__ == "__main__":
    main()
