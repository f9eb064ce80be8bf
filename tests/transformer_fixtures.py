"""The check of a seeded tiny diffusion-transformer pipeline against what diffusers and transformers computed on it
(tests/reference/make_transformer_fixtures.py, tests/fixtures/<family>/): the same weights (their files' digests),
then the text states, pooled vectors or masks, the transformer's prediction, a decode to 1e-4 of the largest value,
and two guided steps of `ldm.generate` within one grey level of diffusers' pipeline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPTS = ["a red circle on a blue background", ""]


def relative(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def check_against_diffusers(folder: str, family: str) -> dict[str, float]:
    """Each output's relative difference, asserted under 1e-4 (the image: one grey level)."""
    import paddle

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, sampling_scheduler
    from ldm.models.backbone import predict_with_variance
    from ldm.models.text import encode_prompt_pooled

    reference = json.loads((FIXTURES / family / "reference.json").read_text())
    expected = dict(np.load(FIXTURES / family / "exported.npz"))
    for name, digest in reference["weights_sha256"].items():
        with open(f"{folder}/{name}", "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest, name

    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(folder)
    tokenize = CaptionTokenizer(tokenizer, 16)
    ids = paddle.to_tensor(np.stack([tokenize(p) for p in PROMPTS]))
    with paddle.no_grad():
        states, mask, pooled = encode_prompt_pooled(text_encoder, ids)
        latents = paddle.to_tensor(expected["latents"])
        prediction, variance = predict_with_variance(unet, latents, paddle.to_tensor(expected["timesteps"]), states,
                                                     mask, pooled)
        image = vae.decode(paddle.to_tensor(expected["decode_latents"])).sample
    if variance is not None:  # learned sigma: diffusers' output holds both halves
        prediction = paddle.concat([prediction, variance], axis=1)
    found = {"states": relative(states.numpy(), expected["states"]),
             "prediction": relative(prediction.numpy(), expected["prediction"]),
             "image": relative(image.numpy(), expected["image"])}
    if "pooled" in expected:
        found["pooled"] = relative(pooled.numpy(), expected["pooled"])
    if "mask" in expected:
        np.testing.assert_array_equal(mask.numpy(), expected["mask"])
    assert max(found.values()) < 1e-4, found
    mine = generate(unet, text_encoder, vae, sampling_scheduler(scheduler_config), tokenize, PROMPTS[:1],
                    guidance_scale=3.0, num_inference_steps=2, seed=7)
    np.testing.assert_allclose(mine[0], np.round(expected["generated"][0] * 255), atol=1)
    return found
