"""`python -m ldm.evaluate run` on a pipeline the real entry point trained and exported: generation per guidance
scale, FID against statistics `stats` made of the corpus, CLIP score, the files it writes; the same numbers on one
process and two; and FID during training (`--fid_steps`)."""

from __future__ import annotations

import json

import eval_weights as ew
import numpy as np
import pytest
from conftest import ROOT, metrics_lines
from corpus import write_corpus
from entry import launch_report, run_entry, run_python
from PIL import Image
from safetensors.numpy import save_file

CLIP = str(ROOT / "tests" / "fixtures" / "eval" / "tiny-clip")
SCRIPT = "train_txt2img_laion400m_no_trainer.py"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, vocab_dir):
    """(corpus file list, exported pipeline, Inception weights, reference statistics at 32 px, prompts file)."""
    folder = tmp_path_factory.mktemp("evaluate_run")
    listing = write_corpus(str(folder / "corpus"), num_records=12, records_per_shard=6)
    weights = str(folder / "inception.safetensors")
    save_file(ew.random_inception(), weights)
    result = run_entry(SCRIPT, ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
                                listing, "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution",
                                "32", "--train_batch_size", "4", "--num_workers", "0", "--max_train_steps", "1",
                                "--report_to", "none", "--output_dir", str(folder / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    reference = str(folder / "reference.npz")
    made = run_python(["-m", "ldm.evaluate", "stats", "--file_list", listing, "--resolution", "32", "--inception",
                       weights, "--output", reference])
    assert made.returncode == 0, made.stderr[-3000:]
    prompts = folder / "prompts.txt"
    prompts.write_text("a photo\na red photo\nthe blue image\n")
    return listing, str(folder / "run" / "pipeline"), weights, reference, str(prompts)


def run_args(setup, out, *extra):
    _, pipeline, weights, reference, prompts = setup
    return ["run", "--model", pipeline, "--prompts", prompts, "--num_samples", "6", "--batch_size", "2",
            "--guidance_scale", "1", "3", "--num_inference_steps", "3", "--inception", weights, "--reference",
            reference, "--clip", CLIP, "--grid_images", "4", "--output_dir", str(out), "--json", *extra]


@pytest.mark.distributed
def test_run_scores_each_guidance_scale_writes_its_figures_and_two_processes_agree(setup, tmp_path):
    one = run_python(["-m", "ldm.evaluate", *run_args(setup, tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    printed = json.loads(one.stdout.strip().splitlines()[-1])
    assert printed == json.loads((tmp_path / "one" / "results.json").read_text())
    assert [r["guidance_scale"] for r in printed["results"]] == [1.0, 3.0]
    for r in printed["results"]:
        assert r["samples"] == 6 and np.isfinite(r["fid"]) and r["fid"] > 0 and 0 <= r["clip_score"] <= 100
    assert printed["resolution"] == 32 and printed["mode"] == "clean" and printed["ranks"] == 1
    assert any("fewer than 2048" in w for w in printed["warnings"]) and "fewer than 2048" in one.stderr
    with Image.open(tmp_path / "one" / "samples.png") as grid, Image.open(tmp_path / "one" / "fid_clip.png") as plot:
        assert grid.height >= 2 * 32 and plot.width > 100  # a row per guidance scale

    args = run_args(setup, tmp_path / "two")
    args[args.index("--guidance_scale") + 1:args.index("--guidance_scale") + 3] = ["3"]  # one scale: half the time
    two = run_entry("ldm/evaluate.py", args, launch=True, cwd=tmp_path)
    assert two.returncode == 0, launch_report(two, tmp_path)
    on_two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert on_two["ranks"] == 2
    a, b = printed["results"][1], on_two["results"][0]
    assert b["fid"] == pytest.approx(a["fid"], rel=1e-9) and b["clip_score"] == pytest.approx(a["clip_score"], rel=1e-9)


def test_run_refuses_bad_input_in_one_line_before_generating(setup, tmp_path):
    listing, pipeline, weights, reference, prompts = setup
    (tmp_path / "empty.txt").write_text("\n\n")
    other = str(tmp_path / "at64.npz")
    assert run_python(["-m", "ldm.evaluate", "stats", "--file_list", listing, "--resolution", "64", "--max_images",
                       "2", "--inception", weights, "--output", other]).returncode == 0
    for argv, words in [
        (["--prompts", str(tmp_path / "empty.txt")], "no prompt"),
        (["--reference", other], "resolution"),
        (["--model", str(tmp_path)], "neither a training checkpoint"),
        (["--inception", reference], "not Inception weights"),
        (["--output_dir", "/proc/no_such_dir"], "/proc/no_such_dir"),
        (["--num_samples", "1"], "--num_samples must be at least 2"),
        (["--guidance_scale", "nan"], "--guidance_scale must be finite"),
    ]:
        args = run_args(setup, tmp_path / "out")
        for flag, value in zip(argv[::2], argv[1::2], strict=True):
            args[args.index(flag) + 1] = value
        result = run_python(["-m", "ldm.evaluate", *args])
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and words in last, (argv, last)
    assert not (tmp_path / "out").exists()
    missing = run_python(["-m", "ldm.evaluate", "stats", "--file_list", str(tmp_path / "no.list"), "--inception",
                          weights, "--output", str(tmp_path / "s.npz")])
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith("error: file list not found")


def test_fid_during_training_is_logged_from_the_ema_and_drawn(setup, vocab_dir, tmp_path):
    listing, _, weights, reference, prompts = setup
    out = tmp_path / "run"
    result = run_entry(SCRIPT, ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
                                listing, "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution",
                                "32", "--train_batch_size", "4", "--num_workers", "0", "--max_train_steps", "2",
                                "--use_ema", "--report_to", "none", "--fid_steps", "2", "--fid_samples", "4",
                                "--fid_inference_steps", "2", "--fid_reference", reference, "--inception", weights,
                                "--clip", CLIP, "--fid_prompts", prompts, "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = metrics_lines(out)
    evals = [line for line in logged if "eval/fid" in line]
    assert [line["step"] for line in evals] == [2]
    assert np.isfinite(evals[0]["eval/fid"]) and 0 <= evals[0]["eval/clip_score"] <= 100
    assert "validation at update 2: fid" in result.stderr
    plotted = run_python(["-m", "ldm.plot", str(out), "--panel", "eval/fid,eval/clip_score", "--output",
                          str(tmp_path / "fid.png")])
    assert plotted.returncode == 0 and (tmp_path / "fid.png").stat().st_size > 0, plotted.stderr

    refused = run_entry(SCRIPT, ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
                                 listing, "--tokenizer_name", vocab_dir, "--resolution", "32", "--max_train_steps", "1",
                                 "--fid_steps", "2", "--fid_reference", reference, "--inception", reference,
                                 "--fid_prompts", prompts, "--output_dir", str(tmp_path / "refused")])
    assert refused.returncode == 2 and "not Inception weights" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "refused").exists()  # checked before the first write
