"""Presets, initialisation, the training objective, EMA, sampling and export on the tiny preset."""

import json
import math
import os
import shutil

import numpy as np
import paddle
import pytest
from entry import modes_not_as_umask_says, run_python

from ldm.checkpoint.format import save_model
from ldm.checkpoint.serialization import load_state, save_state
from ldm.data.tokenize import CaptionTokenizer, load_tokenizer
from ldm.models.build import PRESETS_DIR, build_components
from ldm.models.diffusion import LatentDiffusion
from ldm.models.ema import EMA
from ldm.models.init import fan_in, unet_zero_init_layers

MAX_LENGTH = 16


@pytest.fixture(scope="module")
def tokenizer(vocab_dir):
    return load_tokenizer(vocab_dir, MAX_LENGTH)


def tiny(tokenizer, prediction_type="epsilon", seed=0):
    return build_components("ldm-tiny", vocab_size=tokenizer.vocab_size, model_max_length=MAX_LENGTH,
                            prediction_type=prediction_type, seed=seed)


def batch(tokenizer, n=4, seed=0):
    rng = np.random.default_rng(seed)
    pixels = paddle.to_tensor(rng.uniform(-1, 1, (n, 3, 32, 32)).astype("float32"))
    tokenize = CaptionTokenizer(tokenizer, MAX_LENGTH)
    ids = paddle.to_tensor(np.stack([tokenize(c) for c in ["a red circle", "a blue square", "", "green"][:n]]))
    return pixels, ids


def test_presets_carry_the_reference_numbers():
    def config(preset, part, name="config.json"):
        return json.loads((PRESETS_DIR / preset / part / name).read_text())

    bert = config("ldm-32layer", "bert")
    assert (bert["d_model"], bert["encoder_layers"], bert["encoder_ffn_dim"]) == (1280, 32, 5120)
    assert (bert["encoder_attention_heads"], bert["head_dim"], bert["vocab_size"]) == (8, 64, 30522)
    assert bert["max_position_embeddings"] == 77 and bert["dropout"] == bert["attention_dropout"] == 0.0
    unet = config("ldm-32layer", "unet")
    assert unet["block_out_channels"] == [320, 640, 1280, 1280] and unet["cross_attention_dim"] == 1280
    assert (unet["layers_per_block"], unet["attention_head_dim"], unet["sample_size"]) == (2, 8, 32)
    assert unet["down_block_types"] == ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"]
    assert unet["up_block_types"] == ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3
    assert unet["flip_sin_to_cos"] is True and unet["freq_shift"] == 0 and unet["norm_eps"] == 1e-5
    vae = config("ldm-32layer", "vqvae")
    assert vae["block_out_channels"] == [128, 256, 512, 512] and vae["latent_channels"] == 4
    assert vae["scaling_factor"] == 0.18215
    small = config("ldm-12layer", "bert")
    assert (small["d_model"], small["encoder_layers"], small["encoder_ffn_dim"]) == (768, 12, 3072)
    assert config("ldm-12layer", "unet")["cross_attention_dim"] == 768
    scheduler = config("ldm-32layer", "scheduler", "scheduler_config.json")
    assert (scheduler["beta_start"], scheduler["beta_end"], scheduler["beta_schedule"]) == (0.00085, 0.012,
                                                                                           "scaled_linear")


def test_text_encoder_follows_the_tokenizer(tokenizer):
    c = tiny(tokenizer)
    assert c.text_encoder.config.vocab_size == tokenizer.vocab_size
    assert c.text_encoder.config.max_position_embeddings == MAX_LENGTH
    assert c.pretrained == {"unet": False, "text_encoder": False, "vae": False}


def test_initialisation_statistics(tokenizer):
    c = tiny(tokenizer)
    zeroed = {id(p) for layer in unet_zero_init_layers(c.unet) for p in layer.parameters()}
    assert len(zeroed) >= 2 * 5  # conv_out + ResNet conv2s + proj_outs, weights and biases
    assert all(float(p.abs().max()) == 0 for p in c.unet.parameters() if id(p) in zeroed)
    checked = 0
    for model in (c.unet, c.text_encoder):
        for layer in model.sublayers():
            if isinstance(layer, paddle.nn.Linear | paddle.nn.Conv2D) and id(layer.weight) not in zeroed:
                bound = 1 / math.sqrt(fan_in(layer))
                w = layer.weight.numpy()
                assert np.abs(w).max() <= bound + 1e-6
                if w.size >= 2000:  # uniform(-b, b): std b/sqrt(3)
                    assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.1, layer
                    assert abs(w.mean()) < 0.1 * bound
                    checked += 1
                if layer.bias is not None:
                    assert np.abs(layer.bias.numpy()).max() <= bound + 1e-6
            if isinstance(layer, paddle.nn.LayerNorm | paddle.nn.GroupNorm):
                assert np.all(layer.weight.numpy() == 1) and np.all(layer.bias.numpy() == 0)
    assert checked > 10
    for embedding in (c.text_encoder.model.embed_tokens, c.text_encoder.model.embed_positions):
        assert abs(embedding.weight.numpy().std() - 0.02) < 0.004
    time_linear = c.unet.time_embedding.linear_1  # fan_in 32: a plain PyTorch-default layer
    assert np.abs(time_linear.weight.numpy()).max() > 0.8 / math.sqrt(32)


def test_gradients_reach_unet_and_text_encoder_never_the_vae(tokenizer):
    c = tiny(tokenizer)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler)
    model.train()
    # zero-initialised outputs stop gradients upstream at step 0: perturb them to see the whole graph
    for layer in unet_zero_init_layers(c.unet):
        paddle.nn.initializer.Normal(0, 0.1)(layer.weight)
    model(*batch(tokenizer)).backward()
    assert not c.vae.training and all(p.stop_gradient and p.grad is None for p in c.vae.parameters())
    for part in (c.unet, c.text_encoder.model):
        trained = [p for p in part.parameters() if not p.stop_gradient]
        assert trained and all(p.grad is not None for p in trained)
        assert sum(float(p.grad.abs().sum()) for p in trained) > 0
    assert all(p.stop_gradient for p in c.text_encoder.to_logits.parameters())


def test_freeze_text_encoder(tokenizer):
    c = tiny(tokenizer)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, freeze_text_encoder=True)
    assert {n.split(".")[0] for n, p in model.named_parameters() if not p.stop_gradient} == {"unet"}


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_loss_target_is_the_schedulers(tokenizer, prediction_type):
    """conv_out is zero-initialised, so the prediction is 0 and the loss is mean(target^2)."""
    c = tiny(tokenizer, prediction_type)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler)
    pixels, ids = batch(tokenizer)
    paddle.seed(7)
    latents = model.encode_latents(pixels)
    noise = paddle.randn(latents.shape)
    timesteps = paddle.randint(0, 1000, [latents.shape[0]], dtype="int64")
    target = noise if prediction_type == "epsilon" else c.noise_scheduler.get_velocity(latents, noise, timesteps)
    expected = float((target**2).mean())
    paddle.seed(7)
    assert float(model(pixels, ids)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights(tokenizer, prediction_type):
    """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon targets, / (SNR + 1) for v."""
    c = tiny(tokenizer, prediction_type)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, snr_gamma=5.0)
    t = paddle.to_tensor([10, 500, 990])
    alphas = c.noise_scheduler.alphas_cumprod.numpy()[[10, 500, 990]]
    snr = alphas / (1 - alphas)
    expected = np.minimum(snr, 5.0) / (snr + 1 if prediction_type == "v_prediction" else snr)
    np.testing.assert_allclose(model.loss_weights(t).numpy(), expected, rtol=1e-5)


def test_recompute_gives_the_same_loss_and_gradients(tokenizer):
    results = []
    for recompute in (False, True):
        c = tiny(tokenizer, seed=1)
        for layer in unet_zero_init_layers(c.unet):
            paddle.nn.initializer.Normal(0, 0.1)(layer.weight)
        model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, recompute=recompute,
                                noise_offset=0.05)
        model.train()
        paddle.seed(3)
        loss = model(*batch(tokenizer))
        loss.backward()
        results.append((float(loss), c.unet.conv_in.weight.grad.numpy().copy()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-4, atol=1e-7)


def mean_loss(model, pixels, ids, draws=6):
    model.eval()
    paddle.seed(123)
    with paddle.no_grad():
        value = sum(float(model(pixels, ids)) for _ in range(draws)) / draws
    model.train()
    return value


def test_one_batch_overfits(tokenizer):
    c = tiny(tokenizer)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler)
    pixels, ids = batch(tokenizer)
    before = mean_loss(model, pixels, ids)
    optimizer = paddle.optimizer.AdamW(2e-3, parameters=[p for p in model.parameters() if not p.stop_gradient])
    model.train()
    paddle.seed(0)
    for _ in range(40):  # the loss is at 0.22 of its start after 40 updates (0.18 after 80)
        model(pixels, ids).backward()
        optimizer.step()
        optimizer.clear_grad()
    after = mean_loss(model, pixels, ids)
    assert after < 0.35 * before, (before, after)


def test_ema_warmup_and_counter_survive_save_load(tokenizer, tmp_path):
    c = tiny(tokenizer)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler)
    ema = EMA(model, decay=0.999)
    assert {n.split(".")[0] for n in ema.shadow} == {"unet", "text_encoder"}
    assert not any(n.startswith("text_encoder.to_logits") for n in ema.shadow)
    weight = model.unet.conv_in.weight
    for _ in range(3):
        weight.set_value(weight + 1.0)
        ema.update()
    assert ema.num_updates == 3 and ema.decay() == pytest.approx(4 / 13)
    save_state(str(tmp_path), "ema", ema.state_dict())
    restored = EMA(model, decay=0.999)
    restored.load_state_dict(load_state(str(tmp_path), "ema"))
    assert restored.num_updates == 3
    for n in ema.shadow:
        np.testing.assert_array_equal(ema.shadow[n].numpy(), restored.shadow[n].numpy())
    ema.update()
    restored.update()
    np.testing.assert_allclose(ema.shadow["unet.conv_in.weight"].numpy(),
                               restored.shadow["unet.conv_in.weight"].numpy())


def test_checkpoint_export_from_pretrained_generate_round_trip(tokenizer, tmp_path, capsys):
    from ppdiffusers import LDMTextToImagePipeline

    from ldm.export import main
    from ldm.inference.export import export_checkpoint
    from ldm.models.autoencoder import autoencoder_identity

    c = tiny(tokenizer)
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler)
    ema = EMA(model)
    c.vae.save_pretrained(str(tmp_path / "vqvae"))
    with paddle.no_grad():
        c.unet.conv_in.weight.set_value(c.unet.conv_in.weight + 1.0)  # raw weights now differ from EMA ones
    checkpoint = tmp_path / "checkpoint-1"
    save_model(str(checkpoint), parts={"unet": c.unet, "bert": c.text_encoder}, tokenizer=tokenizer,
               noise_scheduler=c.noise_scheduler, vae_folder=str(tmp_path / "vqvae"),
               vae_identity=autoencoder_identity(c.vae))
    save_state(str(checkpoint), "ema", ema.state_dict())

    output, used_ema = export_checkpoint(str(checkpoint), str(tmp_path / "pipeline"))
    assert used_ema
    assert modes_not_as_umask_says(output) == []
    pipeline = LDMTextToImagePipeline.from_pretrained(output)
    np.testing.assert_allclose(pipeline.unet.conv_in.weight.numpy(), ema.shadow["unet.conv_in.weight"].numpy())
    assert pipeline.tokenizer.model_max_length == MAX_LENGTH
    assert type(pipeline.scheduler).__name__ == "DDIMScheduler" and pipeline.scheduler.config.steps_offset == 1
    # the pipeline assumes an 8x autoencoder when shaping latents; the tiny one is 4x
    image = pipeline("a red circle", num_inference_steps=2, guidance_scale=7.5, height=64, width=64,
                     output_type="np").images[0]
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()

    raw, _ = export_checkpoint(str(checkpoint), str(tmp_path / "raw"), use_ema=False)
    np.testing.assert_allclose(LDMTextToImagePipeline.from_pretrained(raw).unet.conv_in.weight.numpy(),
                               c.unet.conv_in.weight.numpy())

    out = run_python(["-m", "ldm.generate", "--model", output, "--prompt", "a red circle", "--prompt", "a blue square",
                      "--num_images_per_prompt", "2", "--num_inference_steps", "2",
                      "--output_dir", str(tmp_path / "samples")])
    assert out.returncode == 0, out.stderr[-2000:]
    files = sorted(os.listdir(tmp_path / "samples"))
    assert len(files) == 5 and "grid.png" in files
    from PIL import Image

    # grid.png: the 32 px images enlarged 4x (nearest neighbour) to 128 px cells, each row's prompt at its left
    grid = np.asarray(Image.open(tmp_path / "samples" / "grid.png").convert("RGB"))
    assert grid.shape[0] == 2 * 128 and grid.shape[1] > 2 * 128
    label = grid.shape[1] - 2 * 128
    for row in range(2):
        for col in range(2):
            image = np.asarray(Image.open(tmp_path / "samples" / files[2 * row + col]).convert("RGB"))
            cell = grid[row * 128:(row + 1) * 128, label + col * 128:label + (col + 1) * 128]
            np.testing.assert_array_equal(cell[::4, ::4], image)
            np.testing.assert_array_equal(cell, image.repeat(4, axis=0).repeat(4, axis=1))
        assert (grid[row * 128:(row + 1) * 128, :label] < 128).any()  # the prompt is written there

    # another autoencoder in the checkpoint's vqvae folder: the UNet never saw its latents
    with paddle.no_grad():
        c.vae.decoder.conv_out.bias.set_value(c.vae.decoder.conv_out.bias + 0.5)
    c.vae.save_pretrained(str(tmp_path / "vqvae"))
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "swapped")]) == 2
    err = capsys.readouterr().err
    assert "no longer holds it (its weights differ: modified or replaced" in err
    assert not os.path.exists(tmp_path / "swapped")


def test_continuing_from_a_pipeline_keeps_its_noise_schedule_unless_a_flag_says_otherwise(tokenizer, tmp_path):
    """An exported pipeline stores a DDIM config: its betas and prediction type must carry over to training."""
    source = tmp_path / "pipeline"
    shutil.copytree(PRESETS_DIR / "ldm-tiny", source)
    (source / "scheduler").mkdir(exist_ok=True)
    (source / "scheduler" / "scheduler_config.json").write_text(json.dumps({
        "_class_name": "DDIMScheduler", "beta_start": 0.001, "beta_end": 0.02, "beta_schedule": "scaled_linear",
        "num_train_timesteps": 1000, "prediction_type": "v_prediction", "steps_offset": 1, "clip_sample": False}))
    kept = build_components(str(source), vocab_size=tokenizer.vocab_size, model_max_length=MAX_LENGTH)
    assert type(kept.noise_scheduler).__name__ == "DDPMScheduler"
    assert kept.noise_scheduler.config.prediction_type == "v_prediction"
    assert kept.noise_scheduler.config.beta_end == 0.02
    flagged = build_components(str(source), vocab_size=tokenizer.vocab_size, model_max_length=MAX_LENGTH,
                               prediction_type="epsilon")
    assert flagged.noise_scheduler.config.prediction_type == "epsilon"
    assert build_components("ldm-tiny", vocab_size=tokenizer.vocab_size).noise_scheduler.config.prediction_type == \
        "epsilon"


def test_sdpa_attention_computes_what_the_default_does(tokenizer):
    """`--attention sdpa`: the same outputs and gradients as ppdiffusers' default processor (on a GPU in
    fp16/bf16 the same call runs FlashAttention; here its reference math)."""
    from ldm.models.attention import SDPAttnProcessor, set_attention

    unet = tiny(tokenizer).unet
    assert any(True for _ in unet.attn_processors)  # the tiny UNet has attention to replace
    with paddle.no_grad():  # the zero-initialised output projections would hide the attention entirely
        for p in unet.parameters():
            p.set_value(paddle.randn(p.shape, dtype=p.dtype) * 0.2)
    x = paddle.randn([2, unet.config.in_channels, 8, 8])
    t = paddle.to_tensor([10, 500])
    states = paddle.randn([2, MAX_LENGTH, unet.config.cross_attention_dim])

    def run():
        unet.clear_gradients()
        out = unet(x, t, encoder_hidden_states=states).sample
        (out ** 2).mean().backward()
        return out.numpy(), {n: p.grad.numpy().copy() for n, p in unet.named_parameters() if p.grad is not None}

    expected, expected_grads = run()
    set_attention(unet, "sdpa")
    assert all(isinstance(p, SDPAttnProcessor) for p in unet.attn_processors.values())
    got, grads = run()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, expected_grads[name], rtol=1e-3, atol=1e-6, err_msg=name)
