"""Flow matching (`ldm.models.noise`): rectified flow's noisy latents, target, σ draws and loss weights, the backbone's
timestep 1000 σ, and one tiny run: trained, exported, sampled by ppdiffusers' pipeline as by `ldm.generate`, and a
resume with another objective refused."""

import json
import math
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from conftest import metrics_lines
from corpus import write_corpus
from entry import run_entry

from ldm.models.noise import FlowSettings, draw_sigmas, flow_loss_weights, flow_noisy, shifted


def test_flow_noisy_latents_and_target_on_known_tensors():
    x0 = paddle.to_tensor([[[[1.0, -2.0]]], [[[0.5, 3.0]]]])
    noise = paddle.to_tensor([[[[0.0, 4.0]]], [[[-1.0, 1.0]]]])
    noisy, target = flow_noisy(x0, noise, paddle.to_tensor([0.25, 1.0]))
    np.testing.assert_allclose(noisy.numpy().ravel(), [0.75, -0.5, -1.0, 1.0])  # (1 - σ) x0 + σ ε
    np.testing.assert_allclose(target.numpy().ravel(), [-1.0, 6.0, -1.5, -2.0])  # ε - x0


def test_sigma_draws_have_the_moments_of_their_distribution():
    paddle.seed(0)
    n = 40000
    sigmas = draw_sigmas(n, FlowSettings("logit_normal", logit_mean=0.5, logit_std=0.8)).numpy()
    logits = np.log(sigmas / (1 - sigmas))
    assert abs(logits.mean() - 0.5) < 0.02 and abs(logits.std() - 0.8) < 0.02
    uniform = draw_sigmas(n, FlowSettings("uniform")).numpy()
    assert abs(uniform.mean() - 0.5) < 0.01 and abs(uniform.var() - 1 / 12) < 0.003
    # the shift moves the median noise level: shift 3 takes 0.5 to 0.75
    assert np.median(draw_sigmas(n, FlowSettings(), shift=3.0).numpy()) == pytest.approx(0.75, abs=0.01)
    paddle.seed(1)
    mode = draw_sigmas(8, FlowSettings("mode", mode_scale=1.29)).numpy()
    paddle.seed(1)
    u = paddle.rand([8]).numpy()  # diffusers' compute_density_for_timestep_sampling, "mode"
    np.testing.assert_allclose(mode, 1 - u - 1.29 * (np.cos(np.pi * u / 2) ** 2 - 1 + u), rtol=1e-6)
    np.testing.assert_allclose(shifted(paddle.to_tensor([0.2]), 3.0).numpy(), [0.6 / 1.4], rtol=1e-6)


def test_loss_weightings_are_sd3s():
    sigmas = paddle.to_tensor([0.5, 0.25])
    np.testing.assert_allclose(flow_loss_weights(sigmas, "sigma_sqrt").numpy(), [4.0, 16.0], rtol=1e-6)
    np.testing.assert_allclose(flow_loss_weights(sigmas, "cosmap").numpy(),
                               [4 / math.pi, 2 / (math.pi * (1 - 0.5 + 0.125))], rtol=1e-6)
    assert flow_loss_weights(sigmas, "none") is None


def test_the_backbone_gets_1000_sigma_and_is_trained_towards_noise_minus_latents():
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion

    c = build_components("ldm-tiny", prediction_type="flow_matching", flow_shift=3.0, seed=0)
    seen = {}

    def forward(sample, timestep, **_):  # the UNet predicts 1 everywhere, and records what it was given
        seen.update(sample=sample, timestep=timestep)
        return SimpleNamespace(sample=paddle.ones_like(sample))

    c.unet.forward = forward
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, flow=FlowSettings(weighting="cosmap"))
    assert model.prediction_type == "flow_matching"
    mean = np.random.default_rng(0).standard_normal((3, 4, 8, 8)).astype("float32")
    moments = paddle.to_tensor(np.concatenate([mean, np.full_like(mean, -60.0)], axis=1))  # no sampling noise
    ids = paddle.zeros([3, 16], dtype="int64")
    paddle.seed(3)
    _, per_sample, timesteps = model(None, ids, moments, details=True)
    x0 = mean * c.vae.config.scaling_factor
    sigma = timesteps.numpy() / 1000
    np.testing.assert_array_equal(seen["timestep"].numpy(), timesteps.numpy())
    assert timesteps.dtype == paddle.float32 and ((sigma > 0) & (sigma < 1)).all()
    noise = (seen["sample"].numpy() - (1 - sigma[:, None, None, None]) * x0) / sigma[:, None, None, None]
    expected = ((1 - (noise - x0)) ** 2).mean(axis=(1, 2, 3)) * 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))
    np.testing.assert_allclose(per_sample.numpy(), expected, rtol=1e-4)


def test_a_flow_matching_run_exports_samples_as_ppdiffusers_does_and_refuses_another_objective(tmp_path, vocab_dir):
    from ppdiffusers import LDMTextToImagePipeline

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, initial_noise, sampling_scheduler
    from ldm.models.build import noise_scheduler_config

    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    common = ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
              "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32", "--train_batch_size",
              "2", "--save_steps", "2", "--num_workers", "0", "--report_to", "none", "--output_dir",
              str(tmp_path / "run")]
    flow = ["--prediction_type", "flow_matching", "--flow_shift", "3", "--flow_weighting", "cosmap"]
    held_out = ["--validation_file_list", listing, "--validation_steps", "2", "--validation_samples", "2"]
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [*common, "--max_train_steps", "2", *flow, *held_out])
    assert result.returncode == 0, result.stderr[-3000:]
    held_out = [line for line in metrics_lines(tmp_path / "run") if "eval/loss" in line]
    assert held_out and all(math.isfinite(line["eval/loss"]) for line in held_out)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["model"]["prediction_type"] == "flow_matching"
    pipeline = str(tmp_path / "run" / "pipeline")
    config = noise_scheduler_config(pipeline)  # the folder alone makes a flow-matching model
    assert config["_class_name"] == "FlowMatchEulerDiscreteScheduler" and config["shift"] == 3.0

    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(pipeline)
    ours = generate(unet, text_encoder, vae, sampling_scheduler(scheduler_config), CaptionTokenizer(tokenizer, 16),
                    ["a red circle"], guidance_scale=1.0, num_inference_steps=3, seed=7)
    theirs = LDMTextToImagePipeline.from_pretrained(pipeline)
    latents = paddle.to_tensor(initial_noise([1, 4, 8, 8], 7, 0)[0][None])
    image = theirs("a red circle", num_inference_steps=3, guidance_scale=1.0, latents=latents, output_type="np",
                   height=64, width=64)  # its latents are height // 8: 8 x 8 here, as ours
    np.testing.assert_allclose(np.round(image.images[0] * 255), ours[0], atol=1)

    refused = run_entry("train_txt2img_laion400m_no_trainer.py", [*common, "--max_train_steps", "3",
                                                                  "--resume_from_checkpoint", "latest"])
    assert refused.returncode == 2
    assert "prediction type: 'flow_matching' -> 'epsilon'" in refused.stderr.strip().splitlines()[-1]


def test_flow_flags_on_a_run_that_does_not_train_flow_matching_are_refused_in_one_line(vocab_dir):
    from ldm.config.args import DataArguments, ModelArguments
    from ldm.models.build import ModelSourceError
    from ldm.train import setup

    model_args = ModelArguments(model_name_or_path="ldm-tiny", allow_untrained_vae=True, flow_weighting="cosmap")
    data = DataArguments(tokenizer_name=vocab_dir, model_max_length=16, resolution=32)
    text = setup.text_source(model_args)
    with pytest.raises(ModelSourceError, match=r"--flow_\* flags are for flow matching, and ldm-tiny trains epsilon"):
        setup.build_model(model_args, data, setup.build_tokenizer(data, text), recompute=False, seed=0, text=text)


def test_snr_gamma_on_a_flow_matching_run_is_refused_in_one_line(vocab_dir):
    """The one refusal (`setup.build_model`): a flow-matching model, by the flag or by its folder's scheduler."""
    from ldm.config.args import DataArguments, ModelArguments
    from ldm.models.build import ModelSourceError
    from ldm.train import setup

    model_args = ModelArguments(model_name_or_path="ldm-tiny", allow_untrained_vae=True,
                                prediction_type="flow_matching", snr_gamma=5.0)
    data = DataArguments(tokenizer_name=vocab_dir, model_max_length=16, resolution=32)
    text = setup.text_source(model_args)
    with pytest.raises(ModelSourceError, match=r"ldm-tiny trains with flow matching .*: --snr_gamma weights epsilon"):
        setup.build_model(model_args, data, setup.build_tokenizer(data, text), recompute=False, seed=0, text=text)
