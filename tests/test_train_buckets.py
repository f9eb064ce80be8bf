"""Training in aspect-ratio buckets through the real entry points: ranks train different shapes in one update,
every record of a pass is read once, an exact resume stays bit-identical, the bucket mix and validation images at
bucket sizes reach the trackers."""

import json
import os
from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import metrics_lines
from corpus import aspect_sizes, write_aspect_corpus
from entry import launch_report, run_entry, run_python, weights

from ldm.checkpoint.format import read_training_state
from ldm.data.dataset import CONSUMED_LOG
from ldm.models.buckets import auto_buckets, bucket_name, nearest_bucket

SCRIPT = "train_txt2img_laion400m_no_trainer.py"
RECORDS, PER_SHARD, SEED = 40, 8, 11


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("aspect_corpus")
    listing = write_aspect_corpus(str(folder), RECORDS, PER_SHARD, seed=SEED)
    return ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32",
            "--aspect_buckets", "auto", "--seed", "3"]


def expected_bucket(shard: str, line: int) -> str:
    """The bucket of a record of the corpus, from the size its image was made at."""
    index = int(os.path.basename(shard).split("-")[1].split(".")[0]) * PER_SHARD + line - 1
    return bucket_name(nearest_bucket(auto_buckets(32, 8), *aspect_sizes(RECORDS, seed=SEED)[index]))


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_train_different_buckets_in_one_update_and_read_the_pass_once(corpus, tmp_path, monkeypatch):
    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    out = tmp_path / "run"
    result = run_entry(SCRIPT, corpus + ["--train_batch_size", "2", "--num_workers", "1", "--max_train_steps", "16",
                                         "--save_steps", "16", "--logging_steps", "4", "--output_dir", str(out),
                                         "--image_logging_steps", "16", "--num_inference_steps", "1",
                                         "--validation_guidance_scales", "2", "--report_to", "visualdl",
                                         "--validation_file_list", corpus[corpus.index("--file_list") + 1],
                                         "--validation_samples", "8", "--validation_steps", "16",
                                         "--validation_aspect_buckets"],
                       launch=True, cwd=tmp_path)
    assert result.returncode == 0, launch_report(result, tmp_path)
    rows = [line.split() for line in log.read_text().splitlines()]
    shapes = defaultdict(set)  # (rank, batch) -> shapes of its records
    for _, _, shard, line, shape, rank, batch in rows:
        assert shape == expected_bucket(shard, int(line)), (shard, line, shape)
        shapes[(rank, batch)].add(shape)
    assert all(len(s) == 1 for s in shapes.values())  # a batch holds one bucket
    differing = [b for b in range(16) if shapes[("0", str(b))] != shapes[("1", str(b))]]
    assert differing, "the ranks never trained different shapes in the same update"
    pass0 = Counter((shard, line) for p, _, shard, line, *_ in rows if p == "0")
    assert max(pass0.values()) == 1
    state = read_training_state(out / "checkpoint-16")
    assert all(s["pass"] >= 1 for r in state["stream"] for s in r["slots"].values())
    assert len(pass0) == RECORDS  # the pass ended: all of it, partly filled buckets included
    assert len({shape for s in shapes.values() for shape in s}) >= 4

    lines = metrics_lines(out)
    last = [line for line in lines if "train/loss" in line][-1]
    mix = {name: value for name, value in last.items() if name.startswith("train/data_bucket_")}
    held_out = [line["eval/loss"] for line in lines if "eval/loss" in line]
    assert held_out and np.isfinite(held_out).all()  # the held-out loss, in buckets
    assert set(mix) == {f"train/data_bucket_{bucket_name(b)}" for b in auto_buckets(32, 8)}
    assert sum(mix.values()) == pytest.approx(1.0)

    from visualdl import LogReader

    logs = [f for f in os.listdir(out / "visualdl") if f.startswith("vdlrecords")]
    tags = set(LogReader(file_path=str(out / "visualdl" / logs[0])).get_tags()["image"])
    assert tags == {"validation/guidance_2", "validation/guidance_2_24x48", "validation/guidance_2_48x24"}


def test_a_bucketed_resume_is_bit_identical_to_the_uninterrupted_run(corpus, tmp_path, monkeypatch):
    """Stopped where records wait in partly filled buckets, resumed: the same batches, the same weights."""
    common = corpus + ["--train_batch_size", "3", "--num_workers", "2", "--max_train_steps", "9", "--logging_steps",
                       "3", "--learning_rate", "1e-3", "--report_to", "none", "--use_ema"]
    logs = {}
    for name, stops in (("straight", [9]), ("resumed", [4, 9])):
        logs[name] = tmp_path / f"{name}.log"
        monkeypatch.setenv(CONSUMED_LOG, str(logs[name]))
        for stop in stops:
            result = run_entry(SCRIPT, common + ["--output_dir", str(tmp_path / name), "--save_steps", "4",
                                                 "--max_train_steps", str(stop), "--resume_from_checkpoint", "auto"])
            assert result.returncode == 0, result.stderr[-3000:]
    held = [s for r in read_training_state(tmp_path / "resumed" / "checkpoint-4")["stream"]
            for s in r["slots"].values() if s.get("held")]
    assert held, "no record waited in a bucket at the checkpoint: the test would not test the held records"

    def taken(path):
        return [row.split()[:5] for row in path.read_text().splitlines()]

    assert taken(logs["resumed"]) == taken(logs["straight"])
    straight, _ = weights(tmp_path / "straight" / "checkpoint-9")
    resumed, _ = weights(tmp_path / "resumed" / "checkpoint-9")
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)

    # the held-out loss of that checkpoint in its buckets: records of one shape evaluated together, the same
    # number whatever the batch; square crops (the default) give another
    listing = corpus[corpus.index("--file_list") + 1]
    losses = {}
    for name, extra in (("buckets", ["--aspect_buckets", "auto", "--validation_batch_size", "8"]),
                        ("one_by_one", ["--aspect_buckets", "auto", "--validation_batch_size", "1"]),
                        ("square", [])):
        result = run_python(["-m", "ldm.evaluate", "loss", "--model", str(tmp_path / "straight" / "checkpoint-9"),
                             "--file_list", listing, "--validation_samples", "12", "--json", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        printed = json.loads(result.stdout.strip().splitlines()[-1])
        assert printed.get("buckets") == (None if name == "square" else [bucket_name(b) for b in auto_buckets(32, 8)])
        losses[name] = printed["loss"]
    assert losses["buckets"] == pytest.approx(losses["one_by_one"], rel=1e-5)
    assert losses["buckets"] != pytest.approx(losses["square"], rel=1e-3)


def test_buckets_the_model_cannot_use_are_refused_before_anything_is_written(corpus, tmp_path):
    out = tmp_path / "run"
    args = [a for a in corpus if a != "auto"]
    args[args.index("--aspect_buckets") + 1:args.index("--aspect_buckets") + 1] = ["30x36,32x32"]
    result = run_entry(SCRIPT, args + ["--train_batch_size", "2", "--max_train_steps", "1", "--output_dir", str(out)])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --aspect_buckets: 30x36 has a side that is not a positive multiple of 8 (the model's size step: its "
        "autoencoder's downsampling times its UNet's)")
    assert not out.exists()
    square = [a for a in corpus if a not in ("--aspect_buckets", "auto")]
    result = run_entry(SCRIPT, square + ["--train_batch_size", "2", "--max_train_steps", "1", "--output_dir", str(out),
                                         "--validation_file_list", args[args.index("--file_list") + 1],
                                         "--validation_aspect_buckets"])
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().splitlines()[-1] == ("error: --validation_aspect_buckets computes the held-out loss "
                                                      "in the run's buckets: it needs --aspect_buckets")


def test_the_trainer_path_trains_in_buckets_too(corpus, tmp_path, monkeypatch):
    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    args = ["--do_train", "--model_name_or_path", "ldm-tiny"] + corpus[2:] + [
        "--per_device_train_batch_size", "3", "--dataloader_num_workers", "2", "--max_steps", "6", "--save_steps", "6",
        "--logging_steps", "3", "--output_dir", str(tmp_path / "run"), "--report_to", "none"]
    result = run_entry("train_txt2img_laion400m_trainer.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len(rows) == 18 and all(shape == expected_bucket(shard, int(line)) for _, _, shard, line, shape, *_ in rows)
    assert len({shape for *_, shape, _, _ in rows}) >= 2
    lines = metrics_lines(tmp_path / "run")
    mix = [{k: v for k, v in line.items() if k.startswith("train/data_bucket_")} for line in lines]
    assert any(m for m in mix) and all(sum(m.values()) == pytest.approx(1.0) for m in mix if m)
