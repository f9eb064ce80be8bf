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


def check_against_diffusers(folder: str, family: str, outputs: str = "exported.npz") -> dict[str, float]:
    """Each output's relative difference, asserted under 1e-4 (the image: one grey level); `family`: the fixture
    folder, `outputs` its file of diffusers' outputs."""
    import paddle

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, sampling_scheduler
    from ldm.models.families import predict_with_variance
    from ldm.models.text import encode_prompt

    reference = json.loads((FIXTURES / family / "reference.json").read_text())
    expected = dict(np.load(FIXTURES / family / outputs))
    for name, digest in reference["weights_sha256"].items():
        with open(f"{folder}/{name}", "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest, name

    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(folder)
    tokenize = CaptionTokenizer(tokenizer, 16)
    ids = paddle.to_tensor(np.stack([tokenize(p) for p in PROMPTS]))
    with paddle.no_grad():
        conditioning = encode_prompt(text_encoder, ids)
        states, mask, pooled = conditioning.states, conditioning.mask, conditioning.pooled
        latents = paddle.to_tensor(expected["latents"])
        prediction, variance = predict_with_variance(unet, latents, paddle.to_tensor(expected["timesteps"]),
                                                     conditioning)
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


def export_to_diffusers(checkpoint, exported, source: str, encoders: tuple[str, ...]) -> dict:
    """`python -m ldm.export --format diffusers` of a checkpoint trained from `source`: its frozen `encoders` as they
    came, its transformer trained; its model_index.json."""
    from entry import run_python
    from safetensors.numpy import load_file

    result = run_python(["-m", "ldm.export", "--checkpoint", str(checkpoint), "--output", str(exported), "--format",
                         "diffusers"])
    assert result.returncode == 0, result.stderr[-3000:]
    for part in encoders:
        theirs, ours = (load_file(f"{folder}/{part}/model.safetensors") for folder in (source, exported))
        assert theirs.keys() == ours.keys() and all(np.array_equal(theirs[k], ours[k]) for k in theirs), part
    trained, start = (load_file(f"{folder}/transformer/diffusion_pytorch_model.safetensors")
                      for folder in (exported, source))
    assert not np.array_equal(trained["proj_out.weight"], start["proj_out.weight"])
    return json.loads((Path(exported) / "model_index.json").read_text())


def sampled_as_by_the_pipeline(exported, pipeline_class, **call):
    """`ldm.generate` of an exported folder against ppdiffusers' `pipeline_class` from the same noise (48x24, three
    steps, guidance 3): the same image within one grey level; the pipeline."""
    import paddle

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, initial_noise, sampling_scheduler

    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(str(exported))
    mine = generate(unet, text_encoder, vae, sampling_scheduler(scheduler_config), CaptionTokenizer(tokenizer, 16),
                    ["a red circle"], guidance_scale=3.0, num_inference_steps=3, seed=7, height=48, width=24)
    theirs = pipeline_class.from_pretrained(str(exported), from_diffusers=True)
    latents = paddle.to_tensor(initial_noise([unet.config.in_channels, 12, 6], 7, 0)[None])
    image = theirs("a red circle", num_inference_steps=3, guidance_scale=3.0, latents=latents, height=48, width=24,
                   output_type="np", **call).images[0]
    assert mine[0].std() > 1  # an image, not a flat field
    np.testing.assert_allclose(np.round(image * 255), mine[0], atol=1)
    return theirs
