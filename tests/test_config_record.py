"""The run's configuration (`ldm.config.record`): --config files, the record of a run, the comparison on resume; and the
progress output (`ldm.train.progress`). The entry points are exercised in test_train_loop.py and
test_train_trainer.py."""

import json
import logging
from types import SimpleNamespace

import pytest

from ldm.config.record import ConfigError, compare_resume, differences, expand_config, read_config_file


def test_a_config_file_gives_flags_that_the_command_line_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text("learning_rate: 0.001\nuse_ema: true\nfreeze_text_encoder: false\n"
                                       "report_to: [tensorboard, wandb]\nvae_name_or_path: null\n--seed: 3\n")
    argv = expand_config(["--config", str(tmp_path / "run.yaml"), "--learning_rate", "2e-4"])
    assert argv == ["--learning_rate", "0.001", "--use_ema", "true", "--freeze_text_encoder", "false",
                    "--report_to", "tensorboard", "wandb", "--seed", "3", "--learning_rate", "2e-4",
                    "--config", str(tmp_path / "run.yaml")]
    # JSON too, as `--config=FILE` or as the lone argument (PaddleNLP's convention)
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 5, "do_train": True}))
    expected = ["--max_steps", "5", "--do_train", "true", "--config", str(tmp_path / "run.json")]
    assert expand_config([f"--config={tmp_path / 'run.json'}"]) == expected
    assert expand_config([str(tmp_path / "run.json")]) == expected
    assert expand_config(["--seed", "1"]) == ["--seed", "1"]


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("- a\n- b\n", "expected a mapping of flag names to values, not a list"),
    ("seed: [1\n", "not valid YAML"),
    ("unet: {a: 1}\n", "unet is a mapping"),
    ("seed: 1\nlearning_rate: 0.1\nseed: 2\n", "'seed' is given twice"),
    ("seed: 1\nconfig: base.yaml\n", "names another config file \\(base.yaml\\)"),
])
def test_an_unusable_config_file_is_one_readable_error(tmp_path, content, message):
    path = tmp_path / "c.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        expand_config(["--config", str(path)])
    assert "\n" not in str(error.value)


def test_the_entry_points_parse_a_config_file_with_the_command_line_winning(tmp_path):
    from ldm.config.args import DataArguments, LoopArguments, ModelArguments, RunArguments, SamplingArguments, parse

    (tmp_path / "c.yaml").write_text("learning_rate: 0.5\nmax_train_steps: 7\nprogress: lines\n"
                                     "validation_guidance_scales: [1, 3]\n")
    model, data, sampling, loop, run = parse([ModelArguments, DataArguments, SamplingArguments, LoopArguments,
                                              RunArguments], ["--config", str(tmp_path / "c.yaml"),
                                                              "--learning_rate", "0.25"])
    assert (loop.learning_rate, loop.max_train_steps, run.progress) == (0.25, 7, "lines")
    assert sampling.validation_guidance_scales == [1.0, 3.0] and run.config == str(tmp_path / "c.yaml")
    (tmp_path / "typo.yaml").write_text("learnig_rate: 0.5\n")
    with pytest.raises(SystemExit) as exited:
        parse([ModelArguments, DataArguments, SamplingArguments, LoopArguments, RunArguments],
              ["--config", str(tmp_path / "typo.yaml")])
    assert exited.value.code == 2


def test_yaml_reads_no_yes_on_and_off_as_the_words_they_are(tmp_path):
    """YAML 1.1 reads `no` as false: `mixed_precision: no` was refused as not one of no, fp16, bf16."""
    from ldm.config.args import LoopArguments, ModelArguments, RunArguments, parse

    (tmp_path / "c.yaml").write_text("mixed_precision: no\nuse_ema: true\nreport_to: off\n")
    assert read_config_file(str(tmp_path / "c.yaml")) == {"mixed_precision": "no", "use_ema": True,
                                                          "report_to": "off"}
    (tmp_path / "p.yaml").write_text("mixed_precision: no\n")
    _, loop, _ = parse([ModelArguments, LoopArguments, RunArguments], ["--config", str(tmp_path / "p.yaml")])
    assert loop.mixed_precision == "no"


def record(lr=1e-4, model="ldm-tiny", resolution=256, prediction="epsilon", commit="abc"):
    return {"created": "now", "command": ["python", "x"], "step": 10,
            "arguments": {"ModelArguments": {"model_name_or_path": model},
                          "DataArguments": {"resolution": resolution},
                          "LoopArguments": {"learning_rate": lr, "resume_from_checkpoint": None}},
            "world": {"world_size": 1, "hosts": ["a"]}, "git": {"commit": commit, "dirty": False},
            "model": {"prediction_type": prediction}}


def test_a_resume_logs_each_change_and_refuses_those_a_run_cannot_make(tmp_path, caplog):
    saved = record()
    resumed = record(lr=5e-5, commit="def")
    resumed["arguments"]["LoopArguments"]["resume_from_checkpoint"] = "latest"  # expected to differ: not logged
    resumed["world"]["hosts"] = ["b"]
    with caplog.at_level(logging.WARNING, logger="ldm.train"):
        lines = compare_resume(str(tmp_path), saved, resumed, allow_change=False)
    assert lines == ["resume changes --learning_rate: 0.0001 -> 5e-05", "resume changes git.commit: 'abc' -> 'def'"]
    assert [r.getMessage() for r in caplog.records] == lines

    for changed in (record(model="ldm-demo"), record(resolution=512), record(prediction="v_prediction")):
        with pytest.raises(ConfigError, match="cannot change halfway") as refused:
            compare_resume(str(tmp_path), saved, changed, allow_change=False, log=False)
        assert "--allow_config_change" in str(refused.value)
        assert len(compare_resume(str(tmp_path), saved, changed, allow_change=True, log=False)) == 1
    assert differences(saved, saved) == []
    # a checkpoint written before records existed: nothing to compare, a warning
    assert compare_resume(str(tmp_path / "missing"), None, resumed, allow_change=False, log=False) == []


def test_progress_lines_come_at_logging_steps_and_every_few_seconds(caplog, monkeypatch):
    from ldm.train import progress as progress_module
    from ldm.train.progress import Progress, resolve_mode

    # the progress's own clock, moved by the test: a busy machine cannot put a line's seconds between two updates
    clock = [1000.0]
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    assert resolve_mode("auto", Stream(True)) == "bar" and resolve_mode("auto", Stream(False)) == "lines"
    assert resolve_mode("none", Stream(True)) == "none"
    with caplog.at_level(logging.INFO, logger="ldm.train"):
        progress = Progress("lines", total=100, initial=10, label="train", enabled=True, seconds=0.2)
        progress.update(11)
        clock[0] += 0.05
        progress.update(12, logging_step=True)
        clock[0] += 0.25
        progress.update(13)
        clock[0] += 0.1
        progress.update(14)
        silent = Progress("lines", total=100, initial=0, label="train", enabled=False)
        silent.update(1, logging_step=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("progress train: update 12/100 (12.0%)") and "ETA" in lines[0]
    assert lines[1].startswith("progress train: update 13/100") and "87 to go" in lines[1]


def test_the_metrics_window_logs_a_ratio_over_the_window_and_leaves_skipped_updates_out():
    """(sum, count) extras, as the loss by quarter of the schedule: the window's sum over its count, a quarter that
    no sample drew is NaN (not 0), and a skipped update's values count for nothing."""
    import math

    import paddle

    from ldm.runtime.distributed import Distributed
    from ldm.train.metrics import MetricsWindow

    class Batches:
        buckets = ()

        def window(self, dist):
            return 1.0, 0.0, {}, {}

    def pair(total, count):
        return paddle.to_tensor(float(total)), paddle.to_tensor(float(count))

    window = MetricsWindow()
    for extra in ({"q1": pair(3.0, 2), "q2": pair(0.0, 0)}, {"q1": pair(1.0, 1), "q2": pair(0.0, 0)}):
        window.add_micro_step(paddle.to_tensor(1.0), extra, 0.5)
    window.add_update(paddle.to_tensor(2.0))
    window.add_micro_step(paddle.to_tensor(float("nan")), {"q1": pair(100.0, 1), "q2": pair(float("nan"), 1)}, 1.0)
    window.add_update(paddle.to_tensor(float("nan")), skipped=True)
    metrics = window.read(Distributed(), Batches())
    assert metrics["q1"] == pytest.approx(4.0 / 3) and math.isnan(metrics["q2"])
    assert metrics["loss"] == pytest.approx(1.0) and metrics["grad_norm"] == pytest.approx(2.0)


def test_yaml_values_reach_the_flags_as_written_and_numbers_as_yaml_1_2_reads_them(tmp_path):
    """A text flag keeps `0x18` (YAML 1.1 would make it 24); `010` is ten, not eight (1.1's octal); a JSON file
    repeating a key is refused as a YAML one is."""
    (tmp_path / "c.yaml").write_text("aspect_buckets: 0x18\nseed: 010\nlearning_rate: 1e-4\nmax_grad_norm: 1:30\n")
    assert expand_config(["--config", str(tmp_path / "c.yaml")])[:8] == [
        "--aspect_buckets", "0x18", "--seed", "010", "--learning_rate", "1e-4", "--max_grad_norm", "1:30"]
    from ldm.config.args import LoopArguments, RunArguments, parse

    (tmp_path / "loop.yaml").write_text("seed: 010\nlearning_rate: 1e-4\n")
    loop, run = parse([LoopArguments, RunArguments], ["--config", str(tmp_path / "loop.yaml")])
    assert loop.seed == 10 and loop.learning_rate == 1e-4
    (tmp_path / "c.json").write_text('{"seed": 1, "seed": 2}')
    with pytest.raises(ConfigError, match="'seed' given twice"):
        expand_config(["--config", str(tmp_path / "c.json")])


def test_a_resume_on_the_other_entry_point_names_only_the_shared_settings_that_changed():
    from ldm.config.record import differences, one_sided

    saved = {"arguments": {"LoopArguments": {"seed": 5, "learning_rate": 1e-3, "max_train_steps": 10,
                                             "train_batch_size": 4, "adam_beta1": 0.9, "checkpoints_total_limit": 2},
                           "DataArguments": {"resolution": 32}},
             "model": {"prediction_type": "epsilon"}}
    current = {"arguments": {"TrainingArguments": {"seed": 6, "learning_rate": 1e-3, "max_steps": 12,
                                                   "per_device_train_batch_size": 4, "adam_beta1": 0.9,
                                                   "save_total_limit": 2, "logging_first_step": False,
                                                   "fp16_opt_level": "O1"},
                             "DataArguments": {"resolution": 32}},
               "model": {"prediction_type": "epsilon"}}
    assert differences(saved, current) == [("arguments.max_train_steps", 10, 12), ("arguments.seed", 5, 6)]
    assert one_sided(saved, current) == ["fp16_opt_level", "logging_first_step"]
    # the same entry point: every difference, as before
    assert differences(saved, {**saved, "model": {"prediction_type": "v_prediction"}}) == [
        ("model.prediction_type", "epsilon", "v_prediction")]


def test_a_change_is_named_by_the_flag_the_command_line_gave(tmp_path):
    saved = record()
    saved["arguments"]["LoopArguments"]["checkpoints_total_limit"] = 2
    (tmp_path / "run_config.json").write_text(json.dumps(saved))
    resumed = record()
    resumed["arguments"]["LoopArguments"]["checkpoints_total_limit"] = 1
    resumed["command"] = ["python", "train.py", "--save_total_limit", "1"]
    assert compare_resume(str(tmp_path), saved, resumed, allow_change=False, log=False) == [
        "resume changes --save_total_limit: 2 -> 1"]
    resumed["command"] = ["python", "train.py", "--checkpoints_total_limit=1"]
    assert compare_resume(str(tmp_path), saved, resumed, allow_change=False, log=False) == [
        "resume changes --checkpoints_total_limit: 2 -> 1"]
