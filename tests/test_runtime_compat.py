"""Every shim of `ldm/runtime/compat.py` against the installed Paddle and PaddleNLP: what an upgrade would break
fails here first, and a missing private name is one error naming the supported versions."""

import ctypes
import glob
import os

import numpy as np
import paddle
import pytest

from ldm.runtime import compat


def test_a_missing_private_name_is_one_error_naming_the_supported_versions():
    with pytest.raises(compat.CompatibilityError, match=r"needs GradScaler\._no_such_thing.*paddlenlp 2\.8\.1"):
        compat.private(paddle.amp.GradScaler(), "_no_such_thing", "a test")


def test_the_cpu_thread_count_can_be_set():
    """`ldm.evaluate --threads`: the count reaches the OpenMP runtime Paddle's CPU kernels run on."""
    found = glob.glob(os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5*"))
    if not found:
        pytest.skip("this Paddle build brings no OpenMP runtime of its own")
    openmp = ctypes.CDLL(found[0])  # already loaded by Paddle: the same runtime, not a second copy
    for threads in (3, 1):
        compat.set_cpu_threads(threads)
        assert openmp.omp_get_max_threads() == threads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_squared_l2_norm_is_the_sum_of_squares_in_fp32(dtype):
    values = np.random.default_rng(0).standard_normal((7, 5)).astype("float32")
    tensor = paddle.to_tensor(values).astype(dtype)
    exact = float((tensor.astype("float32").numpy().astype(np.float64) ** 2).sum())
    got = compat.squared_l2_norm(tensor)
    assert got.dtype == paddle.float32 and float(got.reshape([])) == pytest.approx(exact, rel=1e-5)


def test_scale_in_place_multiplies_by_a_host_number():
    values = np.random.default_rng(1).standard_normal((4, 3)).astype("float32")
    tensor = paddle.to_tensor(values)
    compat.scale_in_place(tensor, np.float32(0.3))
    np.testing.assert_array_equal(tensor.numpy(), values * np.float32(0.3))  # as a float32 multiply would


def test_loss_scale_is_the_factor_the_scaler_multiplies_by():
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024.0)  # disabled on a CPU: the factor is then 1
    assert float(compat.loss_scale(scaler)) == float(scaler.scale(paddle.to_tensor(1.0)))


def test_the_trainer_still_has_every_hook_ldm_trainer_overrides_or_calls():
    compat.check_trainer_hooks()
    from ldm.train.trainer import LDMTrainer

    overridden = {name for name in compat.TRAINER_HOOKS if name in vars(LDMTrainer)}
    assert overridden == set(compat.TRAINER_HOOKS)


class Numbers(paddle.io.IterableDataset):
    def __iter__(self):
        yield from (np.full([2], i, dtype="float32") for i in range(8))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_iterators_have_what_stop_loader_uses(num_workers):
    compat.check_loader_classes()
    # the way ldm.data.dataset.build_dataloader makes its loaders
    loader = paddle.io.DataLoader(Numbers(), batch_size=None, num_workers=num_workers, use_shared_memory=False,
                                  timeout=compat.READER_POLL_SECONDS)
    iterator = iter(loader)
    try:
        next(iterator)
        names = compat.LOADER_ATTRIBUTES + (("_workers", "_data_queue") if num_workers else ())
        assert [name for name in names if not hasattr(iterator, name)] == []
    finally:
        thread = iterator._thread
        compat.stop_loader(iterator)
    assert not thread.is_alive()


def conv_outputs_and_gradients(forward, x, layer):
    x = x.detach()
    x.stop_gradient = False
    out = forward(x)
    (out * out).sum().backward()
    results = [out.numpy(), x.grad.numpy(), layer.weight.grad.numpy(), layer.bias.grad.numpy()]
    layer.clear_gradients()
    return results


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
def test_the_fast_conv_bias_gives_paddles_outputs_and_gradients(data_format):
    import paddle.nn.functional as F
    import paddle.nn.functional.conv as conv

    assert compat.fast_conv_bias()  # the installed Paddle's _conv_nd is the one wrapped
    assert F.conv2d.fast_conv_bias and conv._conv_nd.fast_conv_bias
    paddle.seed(0)
    layer = paddle.nn.Conv2D(8, 16, 3, padding=1, data_format=data_format)
    x = paddle.randn([2, 8, 12, 12] if data_format == "NCHW" else [2, 12, 12, 8])
    args = (layer._stride, layer._padding, layer._dilation, layer._groups, data_format)

    def paddles(x):  # Paddle's conv2d as it was, bias and all
        return F.conv2d.original(x, layer.weight, layer.bias, *args)

    expected = conv_outputs_and_gradients(paddles, x, layer)
    ours = {  # ppdiffusers' convolutions call the functional; paddle.nn.Conv2D the private _conv_nd
        "functional": lambda x: F.conv2d(x, layer.weight, layer.bias, *args),
        "layer": layer,
    }
    for name, forward in ours.items():
        for got, want in zip(conv_outputs_and_gradients(forward, x, layer), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_fast_conv_bias_is_installed_once_and_leaves_a_changed_conv_nd_alone(monkeypatch, caplog):
    import paddle.nn.functional as F
    import paddle.nn.functional.conv as conv

    compat.fast_conv_bias()
    wrapped = F.conv2d
    assert compat.fast_conv_bias() and F.conv2d is wrapped  # a second call wraps nothing again

    def changed(x, weight, bias=None, stride=1, padding=0, new_argument=None):
        raise AssertionError("a _conv_nd of another signature must not be wrapped or called")

    monkeypatch.setattr(conv, "_conv_nd", changed)
    assert not compat.fast_conv_bias()
    assert conv._conv_nd is changed
    assert "keeps Paddle's slower bias add" in caplog.text and "paddlepaddle 3.3" in caplog.text


@pytest.mark.parametrize("skip", [True, False])
def test_skip_step_if_makes_adamw_leave_weights_moments_and_counters_alone(skip):
    """The non-finite guard's use of Paddle's `found_inf`: a skipped AdamW step changes nothing of its state, and
    the step reports what it did; the flag does not stick to the next step."""
    paddle.seed(0)
    net = paddle.nn.Linear(4, 3)
    optimizer = paddle.optimizer.AdamW(0.1, parameters=net.parameters())
    for step in range(3):  # a step, a skipped one, a step
        (net(paddle.randn([2, 4])) ** 2).sum().backward()
        before = {k: v.numpy().copy() for k, v in optimizer.state_dict().items() if hasattr(v, "numpy")}
        weights = [p.numpy().copy() for p in net.parameters()]
        now = skip and step == 1
        compat.skip_step_if(now, optimizer)
        optimizer.step()
        optimizer.clear_grad()
        assert compat.step_was_skipped(optimizer) is now
        after = {k: v.numpy() for k, v in optimizer.state_dict().items() if hasattr(v, "numpy")}
        unchanged = all(np.array_equal(w, p.numpy()) for w, p in zip(weights, net.parameters(), strict=True))
        assert unchanged is now
        if now:
            assert before and all(np.array_equal(before[k], after[k]) for k in before)  # moments and beta powers


def test_fleets_strategy_has_a_repr_and_an_unsharded_optimizer_has_no_owners():
    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )

    compat.readable_strategy()
    compat.readable_strategy()  # once: not wrapped twice
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": 2}
    assert "sharding_degree" in repr(strategy)
    layer = paddle.nn.Linear(2, 2)
    assert compat.sharding_owners(paddle.optimizer.AdamW(parameters=layer.parameters())) is None
    assert isinstance(GroupShardedOptimizerStage2.param2rank, property)  # stage 2's partition, read on a GPU


def test_weights_in_shares_load_without_a_progress_bar(tmp_path, capfd):
    """Every checkpoint of a multi-process run holds its weights in shares (`ldm.checkpoint.format.weight_jobs`):
    loading them draws no "Loading checkpoint shards" bar into the logs once the libraries are quieted."""
    from ppdiffusers import UNet2DConditionModel

    from ldm.checkpoint.background import HostBuffers, write_files
    from ldm.checkpoint.format import weight_jobs, write_part_configs

    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                norm_num_groups=32, attention_head_dim=4)
    shares = []
    for rank in range(2):
        jobs, names = weight_jobs({"unet": unet}, rank, 2, HostBuffers())
        write_files(str(tmp_path), jobs, rank, 2)
        shares.append(names)
    write_part_configs(str(tmp_path), {"unet": unet}, shares)
    compat.quiet_shard_loading()
    capfd.readouterr()
    loaded = UNet2DConditionModel.from_pretrained(str(tmp_path / "unet"))
    assert "Loading checkpoint shards" not in capfd.readouterr().err
    for name, value in unet.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value.numpy())


def test_pixarts_caption_projection_builds_with_its_unconditional_caption_in_the_state_dict():
    """ppdiffusers 0.29 builds no PixArt transformer without the shim (its patched `paddle.randn` reads the second
    side of the shape as a dtype); with it the buffer diffusers' checkpoints hold is there, of its shape."""
    from ppdiffusers.models import embeddings

    from ldm.models.families.pixart import buildable_caption_projection

    buildable_caption_projection()
    layer = embeddings.CaptionProjection(32, 16)
    assert tuple(layer.state_dict()["y_embedding"].shape) == (120, 32)
    assert layer.linear_1.weight.shape == [32, 16]
