"""FLOPs per training sample counted from the model (`ldm.models.flops`) against a count by hand of the tiny preset."""

import pytest


def resnet(h, w, cin, cout, temb=0):
    """ResnetBlock2D: two 3x3 convolutions, a 1x1 shortcut when the width changes, the timestep projection."""
    flops = 2 * h * w * (9 * cin * cout + 9 * cout * cout + (cin * cout if cin != cout else 0))
    return flops + (2 * temb * cout if temb else 0)


def attention(n_q, n_kv, width, kv_width):
    """q, k, v and output projections, then scores and mixing (2 x queries x keys x width each)."""
    return 2 * n_q * width * width * 2 + 2 * n_kv * kv_width * width * 2 + 2 * 2 * n_q * n_kv * width


def transformer(h, w, c, context, context_width):
    """Transformer2DModel with one BasicTransformerBlock: 1x1 proj_in/out, self- and cross-attention, GEGLU (4c)."""
    n = h * w
    return (2 * 2 * n * c * c + attention(n, n, c, c) + attention(n, context, c, context_width)
            + 2 * n * c * 8 * c + 2 * n * 4 * c * c)


def conv(h_out, w_out, cin, cout, k=3):
    return 2 * h_out * w_out * cin * cout * k * k


def tiny_unet(latent=8, text=16):
    """ldm-tiny's UNet (blocks 32, 64; one layer per block; cross-attention at 32; timestep embedding 128)."""
    s, t = latent, 128
    flops = 2 * (32 * t + t * t)  # timestep embedding MLP
    flops += conv(s, s, 4, 32)  # conv_in
    flops += resnet(s, s, 32, 32, t) + transformer(s, s, 32, text, 32) + conv(s // 2, s // 2, 32, 32)  # down 0
    flops += resnet(s // 2, s // 2, 32, 64, t)  # down 1 (last: no downsampler)
    flops += 2 * resnet(s // 2, s // 2, 64, 64, t) + transformer(s // 2, s // 2, 64, text, 32)  # mid
    # up 0: two resnets over the skips (64 + 64, 64 + 32), then the upsampler's 3x3 conv at twice the size
    flops += resnet(s // 2, s // 2, 128, 64, t) + resnet(s // 2, s // 2, 96, 64, t) + conv(s, s, 64, 64)
    # up 1 (cross-attention): skips 32 and 32
    flops += resnet(s, s, 96, 32, t) + transformer(s, s, 32, text, 32) + resnet(s, s, 64, 32, t)
    flops += transformer(s, s, 32, text, 32)
    return flops + conv(s, s, 32, 4)  # conv_out


def tiny_bert(text=16):
    """LDMBert: 2 layers of width 32 (2 heads x 16), feed-forward 64."""
    per_layer = attention(text, text, 32, 32) + 2 * text * 32 * 64 * 2
    return 2 * per_layer


def tiny_vae_encode(res=32):
    """The autoencoder's encoder (blocks 32, 32, 64), its single-head mid attention and quant_conv."""
    flops = conv(res, res, 3, 32)
    flops += resnet(res, res, 32, 32) + conv(res // 2, res // 2, 32, 32)
    flops += resnet(res // 2, res // 2, 32, 32) + conv(res // 4, res // 4, 32, 32)
    s = res // 4
    flops += resnet(s, s, 32, 64)
    flops += 2 * resnet(s, s, 64, 64) + attention(s * s, s * s, 64, 64)
    return flops + conv(s, s, 64, 8) + conv(s, s, 8, 8, k=1)


@pytest.fixture(scope="module")
def tiny_model(vocab_dir):
    from ldm.config.args import DataArguments, ModelArguments
    from ldm.train import setup

    data = DataArguments(tokenizer_name=vocab_dir, model_max_length=16, resolution=32)
    tokenizer = setup.build_tokenizer(data)
    model, _ = setup.build_model(ModelArguments(model_name_or_path="ldm-tiny", allow_untrained_vae=True), data,
                                 tokenizer, recompute=False, seed=0)
    return model


def test_counted_flops_of_the_tiny_preset_match_a_count_by_hand(tiny_model):
    from ldm.models.flops import ldm_training_flops

    flops = ldm_training_flops(tiny_model, resolution=32, text_length=16)
    assert flops["unet"] == 3 * tiny_unet()  # forward, and a backward of twice its cost
    assert flops["text_encoder"] == 3 * tiny_bert()
    assert flops["vae_encode"] == tiny_vae_encode()  # frozen: forward only
    assert flops["total"] == flops["unet"] + flops["text_encoder"] + flops["vae_encode"]
    # on latent shards the autoencoder does not run
    assert ldm_training_flops(tiny_model, resolution=32, text_length=16, on_latents=True)["vae_encode"] == 0


def test_counting_leaves_the_random_state_and_the_mode_alone(tiny_model):
    import numpy as np
    import paddle

    from ldm.models.flops import ldm_training_flops

    tiny_model.train()
    paddle.seed(7)
    expected = paddle.randn([4]).numpy()
    paddle.seed(7)
    ldm_training_flops(tiny_model, resolution=32, text_length=16)
    np.testing.assert_array_equal(paddle.randn([4]).numpy(), expected)
    assert tiny_model.training and not tiny_model.vae.training  # the frozen autoencoder stays in eval mode


def test_a_frozen_text_encoder_costs_its_forward_only(vocab_dir):
    from ldm.config.args import DataArguments, ModelArguments
    from ldm.models.flops import ldm_training_flops
    from ldm.train import setup

    data = DataArguments(tokenizer_name=vocab_dir, model_max_length=16, resolution=32)
    model, _ = setup.build_model(ModelArguments(model_name_or_path="ldm-tiny", allow_untrained_vae=True,
                                                freeze_text_encoder=True,
                                                allow_untrained_text_encoder=True), data, setup.build_tokenizer(data),
                                 recompute=False, seed=0)
    assert ldm_training_flops(model, resolution=32, text_length=16)["text_encoder"] == tiny_bert()


def test_throughput_metrics():
    from ldm.models.flops import throughput_metrics

    assert throughput_metrics(2e12, 10.0, 2, None) == {"tflops_per_device": 10.0}
    assert throughput_metrics(2e12, 10.0, 2, 40.0) == {"tflops_per_device": 10.0, "mfu": 0.25}
    assert throughput_metrics(None, 10.0, 1, 40.0) == {}


def test_mfu_counts_each_bucket_at_its_shape_by_its_share_of_the_window():
    from ldm.models.flops import SampleFlops

    flops = SampleFlops(square=100, by_bucket={"32x64": 120, "32x32": 100, "64x32": 120})
    assert flops.mean({}) == 100  # no bucket shares logged: the square count
    assert flops.mean({"data_bucket_32x64": 0.5, "data_bucket_32x32": 0.5, "data_bucket_64x32": 0.0}) == 110
    assert SampleFlops(square=100).mean({"data_bucket_32x64": 1.0}) == 100


def test_a_bucket_is_counted_at_its_own_shape():
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion
    from ldm.models.flops import ldm_training_flops

    parts = build_components("ldm-tiny", vocab_size=64, model_max_length=8)
    model = LatentDiffusion(parts.unet, parts.text_encoder, parts.vae, parts.noise_scheduler)
    square = ldm_training_flops(model, resolution=32, text_length=8)
    wide = ldm_training_flops(model, resolution=(32, 64), text_length=8)
    for part in ("vae_encode", "unet"):  # convolutions: linear in the area; attention grows faster
        assert 2 * square[part] <= wide[part] < 2.3 * square[part], part
    assert wide["text_encoder"] == square["text_encoder"]
