"""The autoencoder entry point: the shared loop, checkpoints and resume, a measured scaling factor."""

import json

import numpy as np
import paddle
import pytest
from entry import run_entry
from safetensors.numpy import load_file

from ldm.data.dataset import to_pixel_values
from ldm.prepare.synth import record, synth_corpus
from ldm.runtime.tracking import read_scalars

CONFIG = {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 4,
          "block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 16,
          "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ae")
    listing = synth_corpus(str(folder / "corpus"), num_records=64, resolution=16, records_per_shard=16)
    (folder / "config").mkdir()
    (folder / "config" / "config.json").write_text(json.dumps(CONFIG))
    return folder, ["--model_name_or_path", str(folder / "config"), "--file_list", listing, "--resolution", "16",
                    "--train_batch_size", "8", "--num_workers", "0", "--learning_rate", "5e-3", "--seed", "3",
                    "--adam_weight_decay", "0", "--scale_batches", "4"]


def run(args):
    return run_entry("train_autoencoder.py", args)


def test_trains_writes_vqvae_with_the_measured_scaling_factor(setup, tmp_path):
    folder, common = setup
    out = tmp_path / "run"
    result = run(common + ["--max_train_steps", "40", "--logging_steps", "8", "--save_steps", "40",
                           "--image_logging_steps", "20", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    steps, l1 = read_scalars(str(out / "visualdl"), "train/reconstruction_l1")
    assert steps == [8, 16, 24, 32, 40]
    assert l1[-1] < 0.75 * l1[0], l1  # it learns to reconstruct
    assert read_scalars(str(out / "visualdl"), "train/kl")[1][-1] > 0

    from ppdiffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(str(out / "vqvae"))
    vae.eval()
    pixels = to_pixel_values([np.asarray(record(i, 0, 16)[1]) for i in range(64)])
    with paddle.no_grad():
        latents = vae.encode(paddle.to_tensor(pixels)).latent_dist.sample()
    scaled_std = float(latents.std()) * vae.config.scaling_factor
    assert 0.85 < scaled_std < 1.15, scaled_std  # measured on the training data, so it normalises it
    assert vae.config.scaling_factor != 0.18215


@pytest.mark.slow
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(setup, tmp_path):
    _, common = setup
    common = common + ["--logging_steps", "2", "--save_steps", "3", "--lr_scheduler", "constant"]
    assert run(common + ["--max_train_steps", "6", "--output_dir", str(tmp_path / "a")]).returncode == 0
    assert run(common + ["--max_train_steps", "3", "--output_dir", str(tmp_path / "b")]).returncode == 0
    resumed = run(common + ["--max_train_steps", "6", "--output_dir", str(tmp_path / "b"),
                            "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    name = "diffusion_paddle_model.safetensors"
    expected = load_file(str(tmp_path / "a" / "checkpoint-6" / "vqvae" / name))
    got = load_file(str(tmp_path / "b" / "checkpoint-6" / "vqvae" / name))
    start = load_file(str(tmp_path / "b" / "checkpoint-3" / "vqvae" / name))
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert any(not np.array_equal(start[k], got[k]) for k in got)


def test_a_bad_flag_is_one_line_and_exit_2(setup, tmp_path):
    _, common = setup
    result = run(common + ["--kl_weight", "-1", "--output_dir", str(tmp_path / "x")])
    assert result.returncode == 2 and "--kl_weight must be >= 0" in result.stderr
    result = run(common + ["--model_name_or_path", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "y")])
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: model not found")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
