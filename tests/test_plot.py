"""`python -m ldm.plot`: curves drawn from the metrics files runs write (`ldm.runtime.tracking.MetricsFile`)."""

import os

from entry import run_python

from ldm.plot import main, read_metrics
from ldm.runtime.tracking import MetricsFile


def write_run(folder, steps, *, evaluate=(), nan_at=()):
    folder.mkdir()
    metrics = MetricsFile(str(folder))
    for step in steps:
        values = {"train/loss": float("nan") if step in nan_at else 1.0 / step, "train/loss_q1": 2.0 / step}
        if step in evaluate:
            values.update({"eval/loss": 0.5 / step, "eval/loss_t125": 0.4 / step, "eval/loss_t875": 0.6 / step})
        metrics.write(step, values)
    metrics.close()
    return str(folder)


def legend_labels(svg: str) -> list[str]:
    """The legend entries of an SVG matplotlib wrote (each label is a text element with its own comment)."""
    import re

    return re.findall(r"<!-- (.+?) -->", svg)


def test_a_run_is_drawn_from_its_metrics_file_leaving_out_nan_and_cut_lines(tmp_path, capsys):
    run = write_run(tmp_path / "run", range(1, 11), evaluate=(5, 10), nan_at=(3,))
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 11, "train/lo')  # a line cut short by a kill
    series = read_metrics(run)
    assert series["train/loss"][0] == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # the NaN window and the cut line left out
    assert series["eval/loss"] == ([5, 10], [0.1, 0.05])

    out = tmp_path / "curves.svg"
    assert main([run, "--output", str(out)]) == 0
    printed = capsys.readouterr()
    # the default panels: the losses (no EMA in this run), the loss per timestep, per quarter
    assert printed.out.splitlines()[:3] == ["train/loss, eval/loss, eval/ema_loss: train/loss, eval/loss",
                                            "eval/loss_t*: eval/loss_t125, eval/loss_t875",
                                            "train/loss_q*: train/loss_q1"]
    labels = legend_labels(out.read_text())
    for label in ("train/loss", "eval/loss", "eval/loss_t125", "eval/loss_t875", "train/loss_q1"):
        assert label in labels, labels
    assert "eval/ema_loss" not in labels and printed.err == ""


def test_two_runs_share_the_panels_and_the_panels_are_chosen_by_pattern(tmp_path, capsys):
    a = write_run(tmp_path / "a", range(1, 6), evaluate=(5,))
    b = write_run(tmp_path / "b", range(1, 9), evaluate=(4, 8))
    out = tmp_path / "two.svg"
    assert main([a, b, "--panel", "eval/loss_t*", "--panel", "train/loss,eval/los", "--output", str(out)]) == 0
    printed = capsys.readouterr()
    assert "eval/loss_t*: eval/loss_t125, eval/loss_t875" in printed.out
    assert "train/loss, eval/los: train/loss" in printed.out
    assert printed.err == "warning: no metric matches 'eval/los'\n"  # a typo is said, not silently dropped
    labels = legend_labels(out.read_text())
    assert {"a: eval/loss_t125", "b: eval/loss_t875", "a: train/loss", "b: train/loss"} <= set(labels), labels


def test_what_cannot_be_drawn_is_one_line_and_no_image(tmp_path):
    run = write_run(tmp_path / "run", range(1, 4))
    out = tmp_path / "x.png"
    missing = run_python(["-m", "ldm.plot", str(tmp_path / "nowhere"), "--output", str(out)])
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    assert missing.stderr.startswith("error: ") and "no metrics.jsonl" in missing.stderr
    absent = run_python(["-m", "ldm.plot", run, "--panel", "eval/*", "--output", str(out)])
    assert absent.returncode == 2 and "none of eval/* is in" in absent.stderr and "train/loss" in absent.stderr
    for output, says in ((tmp_path / "curves.txt", "extensions"), (tmp_path / "no" / "x.png", "does not exist")):
        wrong = run_python(["-m", "ldm.plot", run, "--output", str(output)])
        assert wrong.returncode == 2 and says in wrong.stderr and wrong.stderr.strip().count("\n") == 0, wrong.stderr
    assert not out.exists() and not (tmp_path / "curves.txt").exists()


def test_timesteps_are_ordered_by_number_and_patterns_keep_their_order():
    from ldm.plot import matching

    names = ["eval/loss_t875", "eval/loss_t5", "eval/loss_t125", "eval/loss", "train/loss"]
    assert matching(names, ["eval/loss_t*"]) == ["eval/loss_t5", "eval/loss_t125", "eval/loss_t875"]
    assert matching(names, ["train/*", "eval/loss"]) == ["train/loss", "eval/loss"]


def test_the_metrics_file_is_strict_json_with_null_for_nan_and_inf(tmp_path):
    import json

    import pytest

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    run = write_run(tmp_path / "run", range(1, 4), nan_at=(2,))
    metrics = MetricsFile(run)
    metrics.write(4, {"train/loss": float("inf"), "train/loss_q1": float("-inf")})
    metrics.close()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line, parse_constant=refuse) for line in f]
    assert records[1]["train/loss"] is None and records[3]["train/loss"] is None
    assert records[3]["train/loss_q1"] is None and records[0]["train/loss"] == pytest.approx(1.0)
    assert read_metrics(run)["train/loss"][0] == [1, 3]  # null is left out of the curves as NaN was
