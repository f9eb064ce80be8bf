"""--sharding stage1 on both entry points, run as users run them (2 processes over gloo): a sharded run equals the
unsharded one, its checkpoint holds every rank's optimizer state and EMA (each rank's shard, with an index), and
it resumes on any layout: sharded or not, 2 processes or 1."""

import json
import os
import shutil

import numpy as np
import pytest
from corpus import write_corpus
from entry import launch_report, run_entry, run_python, weights
from tolerance import assert_identical, assert_same_training

from ldm.checkpoint.run_folder import MANIFEST, checkpoint_problem
from ldm.checkpoint.serialization import load_state

LOOP, TRAINER = "train_txt2img_laion400m_no_trainer.py", "train_txt2img_laion400m_trainer.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("sharding_corpus")
    listing = write_corpus(str(folder), num_records=40, records_per_shard=8, kinds=("jpeg", "png"))
    return ["--allow_untrained_vae", "--file_list", listing, "--tokenizer_name", vocab_dir, "--model_max_length", "16",
            "--resolution", "32"]


def loop_args(corpus, out, *extra):
    return ["--pretrained_model_name_or_path", "ldm-tiny", *corpus, "--train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--max_train_steps", "4", "--save_steps", "2", "--logging_steps",
            "1", "--num_workers", "0", "--learning_rate", "1e-3", "--max_grad_norm", "0.05", "--use_ema",
            "--report_to", "none", "--output_dir", str(out), *extra]


def launched(script, args, cwd):
    # the Trainer path's sharding builds fleet's hybrid groups while PaddleNLP parses its arguments: under the real
    # launcher, as it was proven (once, of many runs, forked ranks timed out in gloo there on a loaded machine)
    result = run_entry(script, args, launch=True, cwd=cwd, launcher=script == TRAINER)
    assert result.returncode == 0, launch_report(result, cwd)
    return result


def assert_same_weights(a, b, identical=False):
    """The weights and EMA of checkpoints `a` and `b` (4 updates at learning rate 1e-3): the same bits where the
    arithmetic is the same (`identical`), else within what its other roundings allow (tests/tolerance.py)."""
    expected, expected_updates = weights(a)
    got, got_updates = weights(b)
    assert got_updates == expected_updates
    if identical:
        assert_identical(got, expected)
    else:
        assert_same_training(got, expected, learning_rate=1e-3, updates=4)


def moments(checkpoint) -> set[str]:
    state = load_state(str(checkpoint), "optimizer")
    return {k for k in state if "moment1" in k}


def resumed_copy(checkpoint, to):
    """A run folder holding only `checkpoint` (and what it refers to), to resume from on another layout."""
    os.makedirs(to)
    run = os.path.dirname(checkpoint)
    for name in (os.path.basename(checkpoint), "run.json", "vqvae"):
        source = os.path.join(run, name)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(to, name))
    return to


@pytest.mark.distributed
@pytest.mark.slow
def test_the_sharded_loop_equals_the_unsharded_one_and_resumes_on_any_layout(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("LDM_TEST_NAN_BATCHES", "3")  # an update the guard skips, on every rank, sharded or not
    launched(LOOP, loop_args(corpus, tmp_path / "plain"), tmp_path)
    result = launched(LOOP, loop_args(corpus, tmp_path / "sharded", "--sharding", "stage1"), tmp_path)
    assert "Logging error" not in result.stdout + result.stderr
    plain, sharded = tmp_path / "plain" / "checkpoint-4", tmp_path / "sharded" / "checkpoint-4"
    assert_same_weights(plain, sharded)  # weights and EMA, clipped and with one update skipped

    names = os.listdir(sharded)
    for part in ("optimizer", "ema"):
        assert {f"{part}-00001-of-00002.safetensors", f"{part}-00002-of-00002.safetensors",
                f"{part}.index.json"} <= set(names)
        assert f"{part}.safetensors" not in names
        manifest = json.loads((sharded / MANIFEST).read_text())["files"]
        assert f"{part}-00002-of-00002.safetensors" in manifest  # sealed over every rank's files
    index = json.loads((sharded / "optimizer.index.json").read_text())["weight_map"]
    per_file = [sum(1 for f in index.values() if f.startswith(f"optimizer-0000{r}")) for r in (1, 2)]
    assert min(per_file) > 0.2 * sum(per_file)  # each rank holds a real share
    assert moments(sharded) == moments(plain) and len(moments(plain)) > 100
    saved = load_state(str(sharded), "optimizer")
    expected = load_state(str(plain), "optimizer")
    arrays = {key for key, value in expected.items() if isinstance(value, np.ndarray)}
    assert_same_training({key: saved[key] for key in arrays}, {key: expected[key] for key in arrays},
                         learning_rate=1e-3, updates=4)
    for part, stem in (("unet", "diffusion_paddle_model"), ("bert", "model")):  # every rank wrote a share
        shares = set(json.loads((sharded / part / f"{stem}.safetensors.index.json").read_text())["weight_map"].values())
        assert shares == {f"{stem}-00001-of-00002.safetensors", f"{stem}-00002-of-00002.safetensors"}
        assert f"{part}/{stem}-00002-of-00002.safetensors" in manifest
    ema = json.loads((sharded / "ema.index.json").read_text())["weight_map"]
    assert {f for f in ema.values()} == {"ema-00001-of-00002.safetensors", "ema-00002-of-00002.safetensors"}

    # sharded -> unsharded and unsharded -> sharded on 2 processes: the straight run's weights (its skipped update
    # was the second: the resumed runs continue from after it, with no fault)
    monkeypatch.delenv("LDM_TEST_NAN_BATCHES")
    for source, extra in ((sharded, []), (plain, ["--sharding", "stage1"])):
        out = resumed_copy(str(source.parent / "checkpoint-2"), str(tmp_path / f"from-{source.parent.name}"))
        launched(LOOP, loop_args(corpus, out, "--resume_from_checkpoint", "latest", *extra), tmp_path)
        assert_same_weights(plain, os.path.join(out, "checkpoint-4"))
    # sharded 2 -> 1 process ends as unsharded 2 -> 1 process does
    ones = []
    for source in (sharded, plain):
        out = resumed_copy(str(source.parent / "checkpoint-2"), str(tmp_path / f"one-{source.parent.name}"))
        result = run_entry(LOOP, loop_args(corpus, out, "--resume_from_checkpoint", "latest"))
        assert result.returncode == 0, result.stderr[-3000:]
        ones.append(os.path.join(out, "checkpoint-4"))
    assert_same_weights(ones[1], ones[0], identical=True)
    assert checkpoint_problem(ones[0]) is None and "optimizer.safetensors" in os.listdir(ones[0])

    # the tools read a sharded checkpoint as users point them at it
    generated = run_python(["-m", "ldm.generate", "--model", str(sharded), "--prompt", "a red circle",
                            "--num_inference_steps", "2", "--seed", "0", "--output_dir", str(tmp_path / "gen")])
    assert generated.returncode == 0 and (tmp_path / "gen" / "grid.png").exists(), generated.stderr[-3000:]
    args = loop_args(corpus, tmp_path / "stage2", "--init_from_checkpoint", str(sharded))
    args[args.index("--max_train_steps") + 1] = "1"
    stage = run_entry(LOOP, args)
    assert stage.returncode == 0 and "a new stage from" in stage.stderr, stage.stderr[-3000:]
    assert "(checkpoint; EMA: " in stage.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_path_saves_every_ranks_optimizer_state_and_resumes_it(corpus, tmp_path):
    args = ["--do_train", "--model_name_or_path", "ldm-tiny", *corpus, "--per_device_train_batch_size", "4",
            "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--dataloader_num_workers", "0",
            "--use_ema", "--report_to", "none", "--sharding", "stage1"]
    result = launched(TRAINER, args + ["--output_dir", str(tmp_path / "straight")], tmp_path)
    assert "Logging error" not in result.stdout + result.stderr
    straight = tmp_path / "straight"
    assert len(moments(straight / "checkpoint-4")) > 100
    assert "optimizer.index.json" in os.listdir(straight / "checkpoint-4")
    out = resumed_copy(str(straight / "checkpoint-2"), str(tmp_path / "resumed"))
    launched(TRAINER, args + ["--output_dir", out, "--resume_from_checkpoint", "latest"], tmp_path)
    assert_same_weights(straight / "checkpoint-4", os.path.join(out, "checkpoint-4"), identical=True)


@pytest.mark.distributed
@pytest.mark.parametrize("script, flags", [(TRAINER, ["--sharding", "stage2"]),
                                           (TRAINER, ["--sharding", "stage1", "--sharding_parallel_config",
                                                      "split_param"])])
def test_sharding_this_cpu_cannot_run_is_refused_in_one_line_before_anything_is_written(corpus, tmp_path, script,
                                                                                      flags):
    out = tmp_path / "run"
    args = ["--do_train", "--model_name_or_path", "ldm-tiny", *corpus, "--max_steps", "2", "--output_dir", str(out),
            *flags]
    result = run_entry(script, args, launch=True, cwd=tmp_path, launcher=True)  # as `launched` says
    assert result.returncode != 0
    # every rank refuses; the first to exit ends the other under the launcher, maybe before it printed: any rank's
    log = "".join((tmp_path / "launch_logs" / f"workerlog.{rank}").read_text() for rank in (0, 1))
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors and "needs a GPU" in errors[0] and "--sharding stage1" in errors[0], log[-3000:]
    assert "Traceback" not in log
    assert not out.exists()


def test_the_loop_refuses_stages_it_does_not_run_and_a_degree_that_does_not_divide(corpus, tmp_path):
    for flags, message in ((["--sharding", "stage2"], "the hand-written loop shards stage1 only"),
                           (["--sharding", "stage1", "--sharding_parallel_degree", "0"], "must be -1"),
                           (["--sharding", "stage1", "--sharding_parallel_degree", "3"], "3 on one process"),
                           (["--sharding_parallel_degree", "2"], "2 without --sharding")):
        result = run_entry(LOOP, loop_args(corpus, tmp_path / "run", *flags))
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "run").exists()
