"""The PaddleNLP Trainer path, run as users run it: real entry point, tiny preset, generated shards."""

import json
import os
import re
import signal

import numpy as np
import pytest
from conftest import ROOT, metrics_lines
from corpus import write_corpus
from entry import guard_stop_errors, launch_report, run_entry, run_until, weights

from ldm.checkpoint.format import read_training_state
from ldm.checkpoint.run_folder import checkpoint_problem


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("trainer_corpus")
    listing = write_corpus(str(folder), num_records=40, records_per_shard=8, kinds=("jpeg", "png"), bad_every=13)
    return ["--do_train", "--model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir,
            "--model_max_length", "16", "--resolution", "32", "--per_device_train_batch_size", "4"]


SCRIPT = "train_txt2img_laion400m_trainer.py"


def run(args, launch=False, cwd=None):
    return run_entry(SCRIPT, args, launch, cwd)


@pytest.mark.slow
@pytest.mark.parametrize("workers, stop", [(0, "max_steps"), (2, "SIGTERM")])
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(corpus, tmp_path, workers, stop):
    common = corpus + ["--gradient_accumulation_steps", "2", "--logging_steps", "1", "--save_steps", "4",
                       "--dataloader_num_workers", str(workers), "--use_ema", "--lr_scheduler_type",
                       "constant_with_warmup", "--warmup_steps", "2", "--learning_rate", "1e-3", "--seed", "5"]
    result = run(common + ["--max_steps", "8", "--output_dir", str(tmp_path / "a")])
    assert result.returncode == 0, result.stderr[-3000:]
    if stop == "SIGTERM":  # to the process group, workers included, as a scheduler or Ctrl-C would
        code, log = run_until(SCRIPT, common + ["--max_steps", "8", "--output_dir", str(tmp_path / "b")],
                              "global_step: 2,", signal.SIGTERM)
        assert code == 128 + signal.SIGTERM, log[-3000:]
        stopped = re.search(r"SIGTERM: stopped after update (\d+) and saved (\S+checkpoint-\d+)", log)
        assert stopped and 2 <= int(stopped.group(1)) < 8, log[-3000:]
        assert checkpoint_problem(stopped.group(2)) is None
    else:
        result = run(common + ["--max_steps", "4", "--output_dir", str(tmp_path / "b")])
        assert result.returncode == 0, result.stderr[-3000:]
    result = run(common + ["--max_steps", "8", "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint",
                           "latest"])
    assert result.returncode == 0, result.stderr[-3000:]
    expected, expected_updates = weights(tmp_path / "a" / "checkpoint-8")
    got, got_updates = weights(tmp_path / "b" / "checkpoint-8")
    assert got_updates == expected_updates == 8
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # the data position came from the checkpoint: 8 updates x 2 micro-steps, no batch replayed
    assert read_training_state(tmp_path / "b" / "checkpoint-8")["stream"][0]["batches"] == 16
    # each trained weight once, no frozen autoencoder (not PaddleNLP's whole-wrapper model_state.pdparams), and
    # no pickle at all: not PaddleNLP's optimizer.pdopt, scheduler.pdparams, rng_state.pth or training_args.bin
    with open(tmp_path / "b" / "checkpoint-8" / "manifest.json") as f:
        files = json.load(f)["files"]
    assert not [name for name in files if name.endswith(".safetensors")
                and not name.startswith(("unet/", "bert/", "ema.", "optimizer.", "training_state."))]
    assert not [name for name in files if name.endswith((".pdparams", ".pdopt", ".pth", ".bin", ".pkl"))]
    assert "optimizer.safetensors" in files and "trainer_state.json" in files


def test_logs_exports_and_refuses_a_used_output_dir(corpus, tmp_path):
    out = tmp_path / "run"
    result = run(corpus + ["--max_steps", "3", "--save_steps", "2", "--logging_steps", "1", "--report_to",
                           "visualdl", "--dataloader_num_workers", "0", "--output_dir", str(out),
                           "--image_logging_steps", "2", "--num_inference_steps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    from ppdiffusers import LDMTextToImagePipeline
    from visualdl import LogReader

    assert LDMTextToImagePipeline.from_pretrained(str(out / "pipeline")).unet.config.sample_size == 8
    run_dir = out / "runs" / os.listdir(out / "runs")[0]
    reader = LogReader(file_path=str(run_dir / os.listdir(run_dir)[0]))
    tags = reader.get_tags()["scalar"]
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/data_wait_fraction", "train/data_ok",
                "train/global_samples_per_second"):
        assert tag in tags, tags

    # beside the Trainer's own TrainingArguments, the run's whole record
    record = json.loads(reader.get_data("text", "run_config")[0].text.encoded_text_string)
    assert record == json.loads((out / "run.json").read_text()) | {"created": record["created"]}
    # validation images go to the Trainer's own trackers, beside its scalars, and to PNG files
    assert {"validation/guidance_1", "validation/guidance_7.5"} <= set(reader.get_tags()["image"])
    assert sorted(os.listdir(out / "images" / "validation" / "guidance_7.5")) == ["00000002.png"]

    again = run(corpus + ["--max_steps", "1", "--output_dir", str(out)])
    assert again.returncode == 2
    assert "--resume_from_checkpoint" in again.stderr and "--overwrite_output_dir" in again.stderr


@pytest.mark.parametrize("extra, message", [
    (["--no_such_flag", "1"], "unknown flag(s) for this entry point: --no_such_flag"),
    (["--train_batch_size", "4"], "--train_batch_size (did you mean --per_device_train_batch_size?)"),
    (["--file_list", "/no/such/list"], "file list not found"),
    (["--prediction_type", "sample"], "--prediction_type must be"),
    ([], "has no trained weights: the diffusion model would learn random projections"),  # without the allowance
])
def test_user_errors_exit_non_zero_with_one_readable_line(corpus, tmp_path, extra, message):
    common = corpus if extra else [a for a in corpus if a != "--allow_untrained_vae"]
    result = run(common + ["--max_steps", "1", "--output_dir", str(tmp_path / "x"), *extra])
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x").exists()  # a failed start leaves nothing that blocks the corrected retry


def test_a_file_list_naming_a_file_that_is_no_shard_is_refused_at_start(corpus, tmp_path):
    from test_train_loop import wrong_kind_lists

    result = run(corpus + ["--file_list", wrong_kind_lists(tmp_path, corpus)["wrong_kind"], "--max_steps", "1",
                           "--output_dir", str(tmp_path / "x")])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "00000_stats.json is a JSON file" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()


@pytest.mark.distributed
def test_two_processes_read_disjoint_data_and_stay_identical(corpus, tmp_path):
    out = tmp_path / "run"
    result = run(corpus + ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "2",
                           "--gradient_accumulation_steps", "2", "--dataloader_num_workers", "1",
                           "--output_dir", str(out)], launch=True, cwd=tmp_path)
    assert result.returncode == 0, launch_report(result, tmp_path)
    state = read_training_state(out / "checkpoint-4")
    assert state["world_size"] == 2
    assert state["weights_checksum"][0] == state["weights_checksum"][1]
    slots = [{int(slot) for slot in stream["slots"]} for stream in state["stream"]]  # JSON keys are strings
    assert slots[0].isdisjoint(slots[1]) and slots[0] | slots[1] == {0, 1}
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl", "pipeline", "run.json", "runs",
                                      "vqvae"]
    runs = [os.path.join(d, f) for d, _, files in os.walk(out / "runs") for f in files]
    assert len(runs) == 1  # one VisualDL file: rank 0's


def test_one_json_file_of_arguments(corpus, tmp_path):
    import json

    flags = corpus + ["--max_steps", "1", "--dataloader_num_workers", "0", "--output_dir", str(tmp_path / "run"),
                      "--fp16"]
    args = {}
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else True
            args[flag[2:]] = int(value) if isinstance(value, str) and value.isdigit() else value
    (tmp_path / "args.json").write_text(json.dumps(args))
    result = run([str(tmp_path / "args.json")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isdir(tmp_path / "run" / "pipeline")


def test_a_save_that_finds_no_space_ends_with_one_line_and_the_retry_resumes(corpus, tmp_path):
    """As on the loop's path (tests/test_train_loop.py): a real failed write under a file-size limit."""
    from entry import run_python
    from test_train_loop import FILE_SIZE_LIMIT

    out = tmp_path / "run"
    args = corpus + ["--max_steps", "3", "--save_steps", "2", "--dataloader_num_workers", "0", "--output_dir", str(out)]
    result = run_python(["-c", FILE_SIZE_LIMIT, str(5 << 20), ROOT / SCRIPT, *args])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "error: no space to write checkpoint-2" in result.stderr and "--resume_from_checkpoint auto" in result.stderr
    assert not [name for name in os.listdir(out) if name.startswith("checkpoint-")]

    retry = run(args + ["--resume_from_checkpoint", "auto"])
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert read_training_state(out / "checkpoint-3")["step"] == 3


def test_three_updates_on_img2dataset_tars_with_metadata_filters(img2dataset_corpus, vocab_dir, tmp_path):
    """The tars img2dataset wrote (tests/img2dataset_corpus.py), read directly by two loader workers, filtered."""
    from ldm.runtime.tracking import read_scalars

    out = tmp_path / "run"
    result = run(["--do_train", "--model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
                  img2dataset_corpus["tar_list"], "--tokenizer_name", vocab_dir, "--model_max_length", "16",
                  "--resolution", "32", "--per_device_train_batch_size", "4", "--max_steps", "3", "--save_steps", "3",
                  "--logging_steps", "1", "--dataloader_num_workers", "2", "--output_dir", str(out),
                  "--report_to", "visualdl", "--metadata_filter", "punsafe < 0.5", "min_side >= 160"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_training_state(out / "checkpoint-3")["step"] == 3
    run_dir = out / "runs" / os.listdir(out / "runs")[0]
    ok = read_scalars(str(run_dir), "train/data_ok")[1]
    rejected = read_scalars(str(run_dir), "train/data_filter_punsafe_lt_0.5")[1]
    assert ok[-1] >= 12 and rejected[-1] > 0


@pytest.mark.parametrize("launch", [False, pytest.param(True, marks=pytest.mark.distributed)])
def test_the_guard_skips_non_finite_updates_and_stops_the_run(corpus, tmp_path, launch):
    """The loop's guard on PaddleNLP's Trainer: a learning rate of 1e30 makes every loss after update 1 non-finite;
    those updates are skipped on every rank (the schedule does not move) and the third in a row stops the run
    with one line."""
    out = tmp_path / "run"
    result = run(corpus + ["--max_steps", "30", "--save_steps", "2", "--logging_steps", "1", "--report_to", "none",
                           "--dataloader_num_workers", "0", "--learning_rate", "1e30", "--max_nonfinite_updates", "3",
                           "--output_dir", str(out)], launch=launch, cwd=tmp_path)
    errors = guard_stop_errors(result, tmp_path, launch)
    assert errors and all(line.startswith("error: 3 updates in a row (the last at update 4)") for line in errors)
    assert all(str(out / "checkpoint-2") in line for line in errors)
    lines = metrics_lines(out)
    assert [(line["step"], line["train/nonfinite_skips"]) for line in lines] == [(1, 0), (2, 1), (3, 1), (4, 1)]
    rates = [line["train/learning_rate"] for line in lines]
    assert rates[1] == rates[2] == rates[3]  # linear decay, not stepped on skipped updates
    assert not (out / "checkpoint-4").exists()


def test_config_file_run_record_metrics_file_and_progress_lines(corpus, tmp_path):
    """The Trainer path's --config (YAML), run.json, metrics.jsonl with --report_to none, plain progress lines in a
    log file, and a resume that continues the metrics file and logs what it changed."""
    out = tmp_path / "run"
    config = {"do_train": True, "model_name_or_path": "ldm-tiny", "allow_untrained_vae": True,
              "file_list": corpus[corpus.index("--file_list") + 1],
              "tokenizer_name": corpus[corpus.index("--tokenizer_name") + 1], "model_max_length": 16,
              "resolution": 32, "per_device_train_batch_size": 4, "dataloader_num_workers": 0, "report_to": ["none"],
              "logging_steps": 1, "save_steps": 2, "max_steps": 2, "output_dir": str(out),
              "validation_file_list": corpus[corpus.index("--file_list") + 1], "validation_steps": 2,
              "validation_samples": 4, "validation_timesteps": 2}
    (tmp_path / "run.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in config.items()))
    result = run(["--config", str(tmp_path / "run.yaml"), "--learning_rate", "1e-3"])
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads((out / "run.json").read_text())
    assert set(recorded["arguments"]) == {"ModelArguments", "DataArguments", "SamplingArguments", "TrainingArguments",
                                          "RunArguments", "ValidationArguments"}
    training = recorded["arguments"]["TrainingArguments"]
    assert training["learning_rate"] == 1e-3 and training["max_steps"] == 2 and "adam_beta2" in training
    assert training["seed"] == 23  # the recipe's, as on the loop (PaddleNLP's own default is 42)
    assert len(training) > 50  # every field of PaddleNLP's TrainingArguments, defaults included
    assert json.loads((out / "checkpoint-2" / "run_config.json").read_text())["arguments"] == recorded["arguments"]
    metrics = metrics_lines(out)
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/nonfinite_skips",
            "train/tflops_per_device"} <= set(metrics[0])
    assert "\r" not in result.stderr and "progress train: update 2/2 (100.0%)" in result.stderr
    assert not (out / "runs").exists()  # no tracker, no tracker folder
    # the held-out loss, under the trackers' eval/ names
    evals = [m for m in metrics if "eval/loss" in m]
    assert [m["step"] for m in evals] == [2] and {"eval/loss_t250", "eval/loss_t750"} <= set(evals[0])

    assert not [key for m in metrics for key in m if key.startswith("train/phase_")]  # --phase_timing is off

    resumed = run(["--config", str(tmp_path / "run.yaml"), "--max_steps", "3", "--resume_from_checkpoint", "latest",
                   "--phase_timing", "--profile_steps", "3-3"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume changes --max_steps: 2 -> 3" in resumed.stderr
    assert "resume changes --learning_rate: 0.001 -> 5e-05" in resumed.stderr  # the file's default, now
    metrics = metrics_lines(out)
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2, 3]
    # where the update's time went, from the Trainer's hooks: every phase, adding up to the window's time
    last = [m for m in metrics if "train/loss" in m][-1]
    phases = {key: value for key, value in last.items() if key.startswith("train/phase_")}
    assert len(phases) == 10 and abs(sum(phases.values()) - 1) < 1e-6, phases
    assert min(phases[f"train/phase_{name}"] for name in ("data", "forward", "backward", "sync", "clip", "vote",
                                                           "optimizer", "ema")) > 0, phases
    # the profile of update 3, the first after the resume
    lines = (out / "profile" / "rank0-phases.txt").read_text().splitlines()
    assert lines[0].startswith("updates 3-3 on rank 0: ")
    total = float(lines[0].split(": ")[1].split(" s")[0])  # the window from the first update's start: no set-up
    assert sum(float(line.split()[1]) for line in lines[2:]) == pytest.approx(total, abs=1e-3)
    assert any(name.endswith(".paddle_trace.json") for name in os.listdir(out / "profile"))


def test_resuming_a_finished_run_trains_nothing_more(corpus, tmp_path):
    """A finished job requeued with the same command: PaddleNLP would take one more update before it checks
    max_steps; the run instead says there is nothing left and exports its last checkpoint again."""
    out = tmp_path / "run"
    args = corpus + ["--max_steps", "2", "--save_steps", "2", "--dataloader_num_workers", "0",
                     "--output_dir", str(out)]
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run(args + ["--resume_from_checkpoint", "latest"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to train" in again.stderr
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    assert read_training_state(out / "checkpoint-2")["step"] == 2 and (out / "pipeline").is_dir()
