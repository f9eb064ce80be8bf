"""`python -m ldm.plot`: curves drawn from the metrics files runs write (`ldm.tracking.MetricsFile`)."""

import os

from entry import run_python

from ldm.plot import main, read_metrics
from ldm.tracking import MetricsFile


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


def lines_in(path):
    """The curves an image holds, told by matplotlib reading it back: its size, and that it is not blank."""
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    return pixels.shape, float((pixels[..., :3] < 0.5).mean())


def test_a_run_is_drawn_from_its_metrics_file_leaving_out_nan_and_cut_lines(tmp_path):
    run = write_run(tmp_path / "run", range(1, 11), evaluate=(5, 10), nan_at=(3,))
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 11, "train/lo')  # a line cut short by a kill
    series = read_metrics(run)
    assert series["train/loss"][0] == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # the NaN window and the cut line left out
    assert series["eval/loss"] == ([5, 10], [0.1, 0.05])

    out = tmp_path / "curves.png"
    assert main([run, "--output", str(out)]) == 0
    shape, dark = lines_in(out)
    assert shape[1] > 3 * shape[0] > 0 and dark > 0.001  # three panels side by side, something drawn


def test_two_runs_share_the_panels_and_the_panels_are_chosen_by_pattern(tmp_path, capsys):
    a = write_run(tmp_path / "a", range(1, 6), evaluate=(5,))
    b = write_run(tmp_path / "b", range(1, 9), evaluate=(4, 8))
    out = tmp_path / "two.svg"
    assert main([a, b, "--panel", "eval/loss_t*", "--panel", "train/loss", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "eval/loss_t*: eval/loss_t125, eval/loss_t875" in printed and "train/loss: train/loss" in printed
    svg = out.read_text()
    assert svg.count("a: eval/loss_t125") == 1 and svg.count("b: train/loss") == 1  # legends name each run


def test_what_cannot_be_drawn_is_one_line_and_no_image(tmp_path):
    run = write_run(tmp_path / "run", range(1, 4))
    out = tmp_path / "x.png"
    missing = run_python(["-m", "ldm.plot", str(tmp_path / "nowhere"), "--output", str(out)])
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    assert "no metrics.jsonl" in missing.stderr
    absent = run_python(["-m", "ldm.plot", run, "--panel", "eval/*", "--output", str(out)])
    assert absent.returncode == 2 and "none of ['eval/*']" in absent.stderr and "train/loss" in absent.stderr
    assert not out.exists()


def test_timesteps_are_ordered_by_number_and_patterns_keep_their_order():
    from ldm.plot import matching

    names = ["eval/loss_t875", "eval/loss_t5", "eval/loss_t125", "eval/loss", "train/loss"]
    assert matching(names, ["eval/loss_t*"]) == ["eval/loss_t5", "eval/loss_t125", "eval/loss_t875"]
    assert matching(names, ["train/*", "eval/loss"]) == ["train/loss", "eval/loss"]
