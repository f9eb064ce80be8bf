"""The GPU lane: mixed precision, which a CPU cannot run (there the runs fall back to fp32, tested in
test_train_loop.py). Skipped without a CUDA device; on a machine with a card:

    bash scripts/test.sh -m gpu
"""

import math
import os

import numpy as np
import paddle
import pytest
from corpus import write_corpus
from entry import run_entry, weights

from ldm.checkpoint.format import read_training_state
from ldm.runtime.tracking import read_scalars

HAS_GPU = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("gpu_corpus")
    listing = write_corpus(str(folder), num_records=40, records_per_shard=8, kinds=("jpeg", "png"))
    return ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir,
            "--model_max_length", "16", "--resolution", "32"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_and_keeps_fp32_weights(corpus, tmp_path, precision):
    if precision == "bf16" and not paddle.amp.is_bfloat16_supported():
        pytest.skip("this card has no bf16")
    out = tmp_path / "run"
    result = run_entry("train_txt2img_laion400m_no_trainer.py", corpus + [
        "--train_batch_size", "4", "--max_train_steps", "4", "--save_steps", "2", "--logging_steps", "1",
        "--mixed_precision", precision, "--num_workers", "0", "--output_dir", str(out), "--use_ema"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not supported" not in result.stderr  # it really ran in mixed precision
    _, losses = read_scalars(str(out / "visualdl"), "train/loss")
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    before, _ = weights(out / "checkpoint-2")
    after, _ = weights(out / "checkpoint-4")
    assert all(after[name].dtype == np.float32 for name in after)  # master weights stay fp32
    assert any(not np.array_equal(before[n], after[n]) for n in after if n.startswith("unet."))
    scaler = read_training_state(out / "checkpoint-4")["scaler"]
    if precision == "fp16":  # dynamic loss scaling is saved for an exact resume
        assert scaler and float(np.asarray(scaler["scale"]).reshape(-1)[0]) > 0


def test_trainer_path_fp16_exports_a_pipeline(corpus, tmp_path):
    out = tmp_path / "run"
    result = run_entry("train_txt2img_laion400m_trainer.py", corpus + [
        "--per_device_train_batch_size", "4", "--max_steps", "2", "--fp16", "--dataloader_num_workers", "0",
        "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isdir(out / "pipeline")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_encoder_in_half_precision_stays_close_to_float32(dtype):
    if dtype == "bfloat16" and not paddle.amp.is_bfloat16_supported():
        pytest.skip("this card has no bf16")
    from ppdiffusers import AutoencoderKL

    from ldm.models.build import read_config, vae_folder
    from ldm.prepare.encode import encode_moments

    paddle.seed(0)
    vae = AutoencoderKL.from_config(read_config(vae_folder("ldm-tiny")))
    vae.eval()
    pixels = np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    full = encode_moments(vae, pixels, flips=True)
    half = encode_moments(vae, pixels, flips=True, dtype=dtype)
    assert half.dtype == np.float32 and not np.array_equal(half, full)  # it really ran in half precision
    np.testing.assert_allclose(half, full, rtol=5e-2, atol=5e-2)


def test_buckets_train_in_fp16_with_shapes_changing_between_updates(tmp_path, vocab_dir):
    """Batches of several shapes under autocast and dynamic loss scaling: every update finite, weights fp32."""
    from corpus import write_aspect_corpus

    listing = write_aspect_corpus(str(tmp_path / "corpus"), 40, 8, seed=1)
    out = tmp_path / "run"
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
        "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32", "--aspect_buckets", "auto",
        "--train_batch_size", "2", "--max_train_steps", "8", "--save_steps", "8", "--logging_steps", "1",
        "--mixed_precision", "fp16", "--num_workers", "1", "--output_dir", str(out), "--use_ema"])
    assert result.returncode == 0, result.stderr[-3000:]
    _, losses = read_scalars(str(out / "visualdl"), "train/loss")
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    _, mix = read_scalars(str(out / "visualdl"), "train/data_bucket_32x32")
    assert len(mix) == 8
    after, _ = weights(out / "checkpoint-8")
    assert all(after[name].dtype == np.float32 for name in after)


needs_two = pytest.mark.skipif(not HAS_GPU or paddle.device.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@needs_two
@pytest.mark.distributed
def test_the_sharded_loop_under_fp16_equals_the_unsharded_one_on_two_cards(corpus, tmp_path):
    common = corpus + ["--train_batch_size", "4", "--max_train_steps", "4", "--save_steps", "2", "--logging_steps",
                       "1", "--mixed_precision", "fp16", "--num_workers", "0", "--use_ema"]
    for name, extra in (("plain", []), ("sharded", ["--sharding", "stage1"])):
        # the real launcher: forked ranks would inherit a process that may have touched CUDA
        result = run_entry("train_txt2img_laion400m_no_trainer.py", common + ["--output_dir", str(tmp_path / name),
                                                                              *extra], launch=True, launcher=True,
                           cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    expected, _ = weights(tmp_path / "plain" / "checkpoint-4")
    got, _ = weights(tmp_path / "sharded" / "checkpoint-4")
    assert max(float(np.abs(got[k] - expected[k]).max()) for k in expected) < 1e-5


@needs_two
@pytest.mark.distributed
@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_the_trainer_path_trains_saves_and_resumes_with_sharded_gradients(corpus, tmp_path, stage):
    args = ["--do_train", "--model_name_or_path", "ldm-tiny", *corpus[2:], "--per_device_train_batch_size", "4",
            "--max_steps", "4", "--save_steps", "2", "--dataloader_num_workers", "0", "--sharding", stage,
            "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    result = run_entry("train_txt2img_laion400m_trainer.py", args, launch=True, launcher=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = run_entry("train_txt2img_laion400m_trainer.py", [*args[:args.index("--max_steps") + 1], "6",
                                                               *args[args.index("--max_steps") + 2:],
                                                               "--resume_from_checkpoint", "latest"],
                        launch=True, launcher=True, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "pipeline" / "model_index.json").exists()


def test_on_a_card_the_update_is_flat_and_the_cpu_kernel_is_refused(corpus, tmp_path):
    """`--flat_update auto` takes Paddle's kernels over the flat buffers on a card (the fused pass reads host
    memory); asking for the fused one there is one line, before anything is written."""
    from ldm.runtime.device import DeviceError
    from ldm.train.native import resolve_flat_update

    assert resolve_flat_update("auto") == "flat"
    with pytest.raises(DeviceError, match="--flat_update fused is a CPU kernel"):
        resolve_flat_update("fused")
    result = run_entry("train_txt2img_laion400m_no_trainer.py", corpus + [
        "--train_batch_size", "2", "--max_train_steps", "2", "--num_workers", "0", "--use_ema", "--max_grad_norm",
        "0.05", "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flat update: " in result.stderr and "one fused pass" not in result.stderr
