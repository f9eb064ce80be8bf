"""The demo, end to end in --quick mode, as a user runs it: `bash scripts/demo.sh --quick`."""

import json
import os
import subprocess
from dataclasses import replace

import numpy as np
import paddle
import pytest
from conftest import ROOT
from PIL import Image


def test_sample_prompts_are_corpus_captions_covering_every_colour_twice():
    from apps.demo import SAMPLE_PROMPTS
    from apps.eval import parse_caption
    from ldm.prepare.synth import COLOURS

    words = [parse_caption(prompt) for prompt in SAMPLE_PROMPTS]  # raises on any other wording
    assert sorted(colour for colour, _, _ in words) == sorted(COLOURS)
    assert sorted(background for _, _, background in words) == sorted(COLOURS)


def test_a_posthoc_ema_sweep_of_the_transformer_demo_is_refused_before_anything_runs(tmp_path, capsys):
    """The sweep writes pipeline folders, which a transformer with LDMBert has no class for: refused at once."""
    from apps.demo import main

    with pytest.raises(SystemExit) as exit_:
        main(["--posthoc_ema", "--model", "dit-demo", "--output_dir", str(tmp_path / "demo")])
    assert exit_.value.code == 2
    assert "--posthoc_ema: the sweep writes pipeline folders, and dit-demo" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_the_full_transformer_demo_trains_twice_the_unets_updates_and_quick_keeps_its_own(tmp_path, monkeypatch,
                                                                                           capsys):
    """The transformer draws shapes with 4800 updates, the UNet with 2400 (docs/demo.md, issue 67): the settings
    each demo runs with, read where its first stage would start."""
    from apps import demo

    def stop(self):
        raise demo.StageFailed(f"{self.settings.ldm_steps} updates of {self.settings.ldm_batch}")

    monkeypatch.setattr(demo.Demo, "corpus", stop)
    runs = {}
    for model in ("ldm-demo", "dit-demo"):
        for quick in ((), ("--quick",)):
            assert demo.main(["--model", model, "--output_dir", str(tmp_path / model), *quick]) == 1
            runs[model, bool(quick)] = capsys.readouterr().err.strip()
    assert runs == {("ldm-demo", False): "error: 2400 updates of 32", ("dit-demo", False): "error: 4800 updates of 32",
                    ("ldm-demo", True): "error: 4 updates of 8", ("dit-demo", True): "error: 4 updates of 8"}


@pytest.mark.slow
@pytest.mark.distributed
def test_the_demo_trains_in_one_process_per_core_up_to_two_under_paddles_launcher():
    """The demo's default: on a CPU one training process per core up to two, each stage's under
    `paddle.distributed.launch` with its own log folder; one process on a GPU (the demo's test below runs one
    process: two-process training under the launcher is the launch and cluster tests')."""
    from apps.demo import QUICK, Demo, default_processes

    on_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    assert default_processes() == (1 if on_gpu else min(2, os.cpu_count()))
    demo = Demo("/tmp/demo-test-unused", replace(QUICK, processes=2))
    assert demo.trainer("train_autoencoder.py", "autoencoder", 2)[1:] == [
        "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
        os.path.join("/tmp/demo-test-unused", "launch_logs", "autoencoder"), "train_autoencoder.py"]
    assert demo.trainer("train_autoencoder.py", "autoencoder", 1)[1:] == ["train_autoencoder.py"]


@pytest.mark.timeout(900)  # seven stages of real processes: 60 s alone, over 300 s on a loaded 2-core runner
def test_quick_demo_runs_every_stage_and_writes_every_output(tmp_path):
    out = tmp_path / "demo"
    # one training process: a launched stage costs the launcher's and each rank's interpreter (10 CPU-seconds each)
    command = ["bash", str(ROOT / "scripts" / "demo.sh"), "--quick", "--processes", "1", "--output_dir", str(out),
               "--seed", "5"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for stage in ("corpus", "autoencoder", "latents", "ldm", "export", "samples", "evaluate"):
        assert f"    {stage} done in " in result.stdout, stage  # one summary line per stage
    assert "==> demo finished" in result.stdout

    report = json.loads((out / "report.json").read_text())
    assert report["quick"] is True and report["settings"]["seed"] == 5
    assert result.stdout.count(" --seed 5 ") == 2  # the printed commands of both training stages
    assert set(report["stage_seconds"]) == {"corpus", "autoencoder", "latents", "ldm", "export", "samples",
                                            "evaluate"}
    assert report["generated"]["images"] == 24 * report["num_images_per_prompt"]
    assert report["classifier_on_corpus"]["all_three"] >= 0.99
    assert 0 < report["autoencoder"]["scaling_factor"] != 1.0  # measured, not the preset's

    from ldm.checkpoint.format import read_training_state
    from ldm.checkpoint.run_folder import latest_checkpoint

    assert report["settings"]["processes"] == 1
    for stage in ("autoencoder", "ldm"):
        state = read_training_state(latest_checkpoint(str(out / stage)))
        assert state["world_size"] == 1

    # rows = prompts (written at the left), columns = seeds, the 32 px images enlarged 4x
    samples = np.asarray(Image.open(out / "samples.png").convert("RGB"))
    width = 128 * report["settings"]["sample_seeds"]
    assert samples.shape[0] == 128 * 8 and samples.shape[1] > width
    assert (samples[:128, : samples.shape[1] - width] < 128).any()  # the first row's prompt
    assert Image.open(out / "reconstructions.png").size == (32 * 16, 32 * 2)
    loss = np.asarray(Image.open(out / "loss.png").convert("L"))
    assert loss.shape[1] > 500 and loss.std() > 10  # a drawn figure, not an empty canvas

    from ppdiffusers import LDMTextToImagePipeline

    pipeline = LDMTextToImagePipeline.from_pretrained(str(out / "pipeline"))
    assert pipeline.unet.config.sample_size == 8 and pipeline.vqvae.config.scaling_factor == \
        report["autoencoder"]["scaling_factor"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_transformer_demo_trains_flow_matching_and_samples_from_its_checkpoint(tmp_path):
    """`--model dit-demo`: the same stages with a diffusion transformer and LDMBert, which no pipeline class holds:
    flow matching (its preset's objective) without the UNet's min-SNR weighting, sampled and scored from the
    checkpoint. One process: the two-process stages are the UNet demo's test."""
    out = tmp_path / "demo"
    command = ["bash", str(ROOT / "scripts" / "demo.sh"), "--quick", "--model", "dit-demo", "--processes", "1",
               "--output_dir", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ldm_command = next(line for line in result.stdout.splitlines() if "$ python train_txt2img_laion400m" in line)
    assert "--model_name_or_path dit-demo --prediction_type flow_matching" in ldm_command
    assert "--snr_gamma" not in ldm_command
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["model"] == "dit-demo" and report["generated"]["images"] == 24
    assert not (out / "pipeline").exists() and "sampling from" in result.stdout
    run = json.loads((out / "ldm" / "run.json").read_text())
    assert run["model"]["prediction_type"] == "flow_matching", run["model"]
