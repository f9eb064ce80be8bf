"""The hand-written loop, run as users run it: real entry point, tiny preset, generated shards."""

import json
import os
import random
import re
import shutil
import signal

import numpy as np
import paddle
import pytest
from conftest import ROOT, metrics_lines
from corpus import write_corpus
from entry import (
    FILE_SIZE_LIMIT,
    guard_stop_errors,
    launch_report,
    modes_not_as_umask_says,
    run_entry,
    run_until,
    subprocess_result,
    weights,
)
from tolerance import GRADIENT_ERROR, UNIT_ROUNDOFF, assert_same_training

from ldm.checkpoint.format import read_training_state
from ldm.checkpoint.run_folder import MANIFEST, checkpoint_problem, latest_checkpoint
from ldm.checkpoint.serialization import load_state, save_state
from ldm.runtime.tracking import read_scalars
from ldm.train.objective import Objective


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("train_corpus")
    listing = write_corpus(str(folder), num_records=40, records_per_shard=8, kinds=("jpeg", "png"), bad_every=13)
    return ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir,
            "--model_max_length", "16", "--resolution", "32", "--train_batch_size", "4"]


SCRIPT = "train_txt2img_laion400m_no_trainer.py"


def run(args, launch=False, cwd=None):
    return run_entry(SCRIPT, args, launch, cwd)


@pytest.mark.slow
@pytest.mark.parametrize("workers, fault", [(0, "SIGKILL"), (2, "SIGTERM")])
def test_a_run_killed_or_stopped_resumes_to_the_weights_of_an_uninterrupted_one(corpus, tmp_path, workers, fault):
    """SIGKILL lands at a random moment, often inside a checkpoint write (one per update); SIGTERM reaches
    the process group (workers too) and must end in a checkpoint of the update it interrupted."""
    common = corpus + ["--gradient_accumulation_steps", "2", "--logging_steps", "1",
                       "--num_workers", str(workers), "--use_ema", "--lr_scheduler", "constant_with_warmup",
                       "--lr_warmup_steps", "2", "--learning_rate", "1e-3", "--seed", "5", "--max_train_steps", "8"]
    straight = run(common + ["--save_steps", "3", "--output_dir", str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "b"
    if fault == "SIGKILL":
        # saves written in the update's own time (not in the background), so the two checkpoints before the one
        # being written are whole when "step 3" shows, on a loaded machine too: one of them is damaged below, and
        # the resume needs the other (in the background, a loaded machine had sealed only checkpoint-1 by then)
        code, log = run_until(SCRIPT, common + ["--save_steps", "1", "--async_save", "false", "--output_dir",
                                                str(out)], "step 3 ", signal.SIGKILL, delay=random.uniform(0, 0.3))
        assert code == -signal.SIGKILL, log[-3000:]
        # and the newest complete checkpoint is damaged afterwards: latest must skip it too
        newest = latest_checkpoint(str(out))
        with open(os.path.join(newest, "optimizer.safetensors"), "r+b") as f:
            f.truncate(100)
    else:
        code, log = run_until(SCRIPT, common + ["--save_steps", "100", "--output_dir", str(out)], "step 3 ",
                              signal.SIGTERM)
        assert code == 128 + signal.SIGTERM, log[-3000:]
        stopped = re.search(r"SIGTERM: stopped after update (\d+) and saved (\S+checkpoint-\d+)", log)
        assert stopped, log[-3000:]
        assert stopped.group(2).endswith(f"checkpoint-{stopped.group(1)}") and 3 <= int(stopped.group(1)) < 8
        assert checkpoint_problem(stopped.group(2)) is None
        assert "pipeline" not in os.listdir(out)  # a stopped run does not export
    resumed = run(common + ["--save_steps", "3", "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    if fault == "SIGKILL":
        assert f"skipping {newest}: optimizer.safetensors has 100 bytes" in resumed.stderr
    assert not [name for name in os.listdir(out) if name.startswith(".tmp-")]

    expected, expected_updates = weights(tmp_path / "a" / "checkpoint-8")
    got, got_updates = weights(out / "checkpoint-8")
    assert got_updates == expected_updates == 8
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # and training moved the weights at all
    start, _ = weights(tmp_path / "a" / "checkpoint-3")
    assert any(not np.array_equal(start[n], got[n]) for n in got if n.startswith("unet."))


def test_stops_exactly_saves_on_its_own_interval_and_rotates(corpus, tmp_path):
    out = tmp_path / "run"
    (tmp_path / "prompts.txt").write_text("a red circle\n\na blue square\n")
    result = run(corpus + ["--max_train_steps", "5", "--save_steps", "2", "--logging_steps", "3",
                           "--checkpoints_total_limit", "2", "--gradient_accumulation_steps", "2",
                           "--num_workers", "0", "--output_dir", str(out), "--use_ema",
                           "--validation_prompts", str(tmp_path / "prompts.txt"), "a green circle",
                           "--validation_guidance_scales", "1", "4",
                           "--image_logging_steps", "2", "--num_inference_steps", "2", "--freeze_text_encoder",
                           "--allow_untrained_text_encoder",
                           "--lr_scheduler", "linear", "--lr_warmup_steps", "2", "--learning_rate", "1e-3"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-5"]
    state = read_training_state(out / "checkpoint-5")
    assert state["step"] == 5 and load_state(str(out / "checkpoint-5"), "ema")["num_updates"] == 5
    # 5 updates x 2 micro-steps x 4 images, nothing more read
    assert state["stream"][0]["batches"] == 10
    # the exported pipeline loads offline
    from ppdiffusers import LDMTextToImagePipeline

    assert LDMTextToImagePipeline.from_pretrained(str(out / "pipeline")).unet.config.sample_size == 8
    assert modes_not_as_umask_says(out) == []  # checkpoints, pipeline, images: readable as mkdir/open make them
    assert re.search(r"asynchronous saves: \d+\.\d\d GiB of host memory per rank for the checkpoint snapshot, "
                     r"reserved now", result.stderr)

    from visualdl import LogReader

    logs = [f for f in os.listdir(out / "visualdl") if f.startswith("vdlrecords")]
    reader = LogReader(file_path=str(out / "visualdl" / logs[0]))
    tags = reader.get_tags()["scalar"]
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/global_samples_per_second",
                "train/data_wait_fraction", "train/data_ok", "train/data_missing_columns"):
        assert tag in tags, tags
    assert [r.id for r in reader.get_data("scalar", "train/loss")] == [3, 5]
    # the run's whole record as the tracker's hyperparameters
    args = reader.get_data("text", "args")[0].text.encoded_text_string
    for name in ('"arguments.learning_rate": 0.001', '"arguments.max_nonfinite_updates": 20', '"versions.paddle"',
                 '"git.commit"', '"model.prediction_type": "epsilon"', '"world.world_size": 1'):
        assert name in args, args[:2000]
    # the schedule counts optimizer updates, not micro-steps: after update 3 of 5 (warm-up 2), 2/3 of the peak
    rates = [r.value for r in reader.get_data("scalar", "train/learning_rate")]
    np.testing.assert_allclose(rates, [1e-3 * 2 / 3, 0.0], rtol=1e-5, atol=1e-12)
    # --freeze_text_encoder: update 5 moved the UNet; LDMBert, frozen, is in no checkpoint but once beside them
    before, _ = weights(out / "checkpoint-4")
    after, _ = weights(out / "checkpoint-5")
    assert not (out / "checkpoint-5" / "bert").exists() and (out / "text_encoder" / "model.safetensors").is_file()
    assert json.loads((out / "checkpoint-5" / "ldm_model.json").read_text())["text_encoder_identity"]["family"] == \
        "ldmbert"
    assert any(not np.array_equal(before[n], after[n]) for n in after if n.startswith("unet."))
    assert set(reader.get_tags()["image"]) == {"validation/guidance_1", "validation/guidance_4"}
    assert [r.id for r in reader.get_data("image", "validation/guidance_4")] == [2, 4]
    # the same grids as PNG files: a row per prompt (3), the trained weights beside the EMA's (--use_ema)
    from PIL import Image

    for scale in ("1", "4"):
        folder = out / "images" / "validation" / f"guidance_{scale}"
        assert sorted(os.listdir(folder)) == ["00000002.png", "00000004.png"]
        grid = np.asarray(Image.open(folder / "00000004.png"))
        assert grid.shape == (3 * 32, 2 * 32, 3)
    # the EMA (warm-up decay (1+n)/(10+n)) differs from the trained weights: so do their images (a little)
    early = np.asarray(Image.open(out / "images" / "validation" / "guidance_4" / "00000002.png")).astype(int)
    assert np.abs(early[:, :32] - early[:, 32:]).max() > 0

    # stderr is a file here (--progress auto): plain progress lines at the logging steps, no redrawn bar
    assert "train: 100%" not in result.stderr and "\r" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "progress train: update" in line]
    assert [re.search(r"update (\d+)/5", line).group(1) for line in lines] == ["3", "5"], lines
    assert "upd/s" in lines[0] and "ETA" in lines[0]

    again = run(corpus + ["--max_train_steps", "1", "--output_dir", str(out)])
    assert again.returncode == 2
    assert "--resume_from_checkpoint" in again.stderr and "--overwrite_output_dir" in again.stderr


@pytest.mark.parametrize("extra, message", [
    (["--no_such_flag", "1"], "unknown flag(s) for this entry point: --no_such_flag"),
    (["--per_device_train_batch_size", "4"], "--per_device_train_batch_size (did you mean --train_batch_size?)"),
    (["--learnig_rate", "1e-3"], "--learnig_rate (did you mean --learning_rate?)"),
    (["--lr_scheduler", "exponential"], "--lr_scheduler must be one of"),
    (["--attention", "flash"], "--attention must be default or sdpa"),
    (["--report_to", "mlflow"], "--report_to: unknown tracker(s) mlflow"),
    (["--file_list", "/no/such/list"], "file list not found"),
    (["--tokenizer_name", "/no/such/tokenizer/dir"], "cannot load tokenizer"),
])
def test_user_errors_exit_non_zero_with_one_readable_line(corpus, tmp_path, extra, message):
    result = run(corpus + ["--max_train_steps", "1", "--output_dir", str(tmp_path / "x"), *extra])
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x").exists()  # a failed start leaves nothing that blocks the corrected retry


def wrong_kind_lists(tmp_path, corpus) -> dict:
    """File lists of a good shard beside a file that is no shard, and of shards none of which can be read."""
    good = os.path.join(os.path.dirname(corpus[corpus.index("--file_list") + 1]), "train-00000.gz")
    (tmp_path / "00000_stats.json").write_text('{"count": 10, "successes": 8}')
    for name in ("a.gz", "b.gz"):
        (tmp_path / name).mkdir()  # there, but nothing can read it
    lists = {}
    for case, names in (("wrong_kind", [good, "00000_stats.json"]), ("unreadable", ["a.gz", "b.gz"])):
        (tmp_path / f"{case}.filelist").write_text("".join(f"{n}\n" for n in names))
        (tmp_path / f"{case}.list").write_text(f"{case}.filelist\n")
        lists[case] = str(tmp_path / f"{case}.list")
    return lists


@pytest.mark.parametrize("case, message", [
    ("wrong_kind", "names a file that is no shard: {dir}/00000_stats.json is a JSON file"),
    ("unreadable", "none of the 2 shard(s) of {list} whose first bytes were read can be read"),
])
def test_a_file_list_of_wrong_kinds_or_unreadable_shards_is_refused_at_start(corpus, tmp_path, case, message):
    lists = wrong_kind_lists(tmp_path, corpus)
    result = run(corpus + ["--file_list", lists[case], "--num_workers", "2", "--max_train_steps", "1",
                           "--output_dir", str(tmp_path / "x")])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message.format(dir=tmp_path, list=lists[case]) in last, last
    assert not (tmp_path / "x").exists()


def test_an_untrained_autoencoder_is_refused_with_what_to_pass_instead(corpus, tmp_path):
    result = run([a for a in corpus if a != "--allow_untrained_vae"] + ["--max_train_steps", "1", "--output_dir",
                                                                        str(tmp_path / "x")])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the autoencoder from") and "has no trained weights" in last
    assert "--vae_name_or_path" in last and "train_autoencoder.py" in last and "--allow_untrained_vae" in last
    assert not (tmp_path / "x").exists()
    assert "model from" not in result.stderr  # refused before the model is built (ldm-32layer: most of a minute)


def test_unusable_data_fails_the_start_with_one_line_and_writes_nothing(corpus, tmp_path):
    """Every record bad, in-process reading (Paddle's loader thread used to die on it and the run hung)."""
    for i in range(2):
        (tmp_path / f"bad{i}.gz").write_bytes(b"no tabs here\n" * 20)
    (tmp_path / "f").write_text("bad0.gz\nbad1.gz\n")
    (tmp_path / "list").write_text("f\n")
    result = run(corpus + ["--file_list", str(tmp_path / "list"), "--num_workers", "0", "--max_train_steps", "2",
                           "--output_dir", str(tmp_path / "x")])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: slot 0 of 1 read no usable record")
    assert not (tmp_path / "x").exists()


def test_a_run_that_fails_before_its_first_checkpoint_does_not_block_the_corrected_retry(corpus, tmp_path):
    """One loader slot of two finds no usable record once the run has written its folder (an empty tar used to be
    one such slot's only shard); the corrected command then starts afresh in its place."""
    import tarfile

    good = write_corpus(str(tmp_path / "good"), num_records=16, records_per_shard=16)
    (tmp_path / "bad.gz").write_bytes(b"no tabs here\n" * 16)
    tarfile.open(tmp_path / "empty.tar", "w").close()  # a valid tar of no members: 10,240 zero bytes
    (tmp_path / "f").write_text(f"{tmp_path / 'good' / 'train-00000.gz'}\nbad.gz\nempty.tar\n")
    (tmp_path / "list").write_text("f\n")
    from ldm.prepare.tools import slot_plan

    # a seed whose second slot reads the bad shard: the first batch (slot 0's, taken before anything is written)
    # is good, and the failure comes once the run has written its folder
    seed = next(s for s in range(20) if any(worker == 1 and shard.endswith("bad.gz") for _, worker, shard, _ in
                                            slot_plan(str(tmp_path / "list"), 1, 2, s, 0, 1)))
    out = tmp_path / "x"
    args = corpus + ["--num_workers", "2", "--max_train_steps", "2", "--output_dir", str(out), "--seed", str(seed)]
    result = run(args + ["--file_list", str(tmp_path / "list")])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.match(r"error: slot \d of 2 read no usable record", result.stderr.strip().splitlines()[-1])
    assert json.loads((out / "run.json").read_text())["failed"].startswith("NoUsableData: slot ")

    retry = run(args + ["--file_list", good])
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert "failed before its first checkpoint" in retry.stderr
    assert "the run there failed before its first checkpoint: emptied" in retry.stderr
    assert "--overwrite_output_dir: emptied" not in retry.stderr  # a flag the command did not give
    assert "failed" not in json.loads((out / "run.json").read_text())


def test_the_offline_validation_finds_a_missing_file_list_before_it_loads_a_model(tmp_path):
    from entry import run_python

    result = run_python(["-m", "ldm.evaluate", "loss", "--model", str(tmp_path / "no_model"), "--file_list",
                         str(tmp_path / "no_list")])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: file list not found: {tmp_path / 'no_list'}"


@pytest.mark.distributed
def test_two_processes_read_disjoint_data_and_stay_identical(corpus, tmp_path):
    """With --recompute too: the public example's recompute path skipped the gradient all-reduce."""
    out = tmp_path / "run"
    result = run(corpus + ["--max_train_steps", "4", "--save_steps", "2", "--logging_steps", "2", "--recompute",
                           "--gradient_accumulation_steps", "2", "--num_workers", "1", "--output_dir", str(out)],
                 launch=True, cwd=tmp_path)
    assert result.returncode == 0, launch_report(result, tmp_path)
    state = read_training_state(out / "checkpoint-4")
    assert state["world_size"] == 2
    checksums = state["weights_checksum"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]  # gradients were averaged, ranks in step
    slots = [{int(slot) for slot in stream["slots"]} for stream in state["stream"]]  # JSON keys are strings
    assert slots[0].isdisjoint(slots[1]) and slots[0] | slots[1] == {0, 1}
    assert all(s["num_slots"] == 2 for stream in state["stream"] for s in stream["slots"].values())
    # only rank 0 wrote: one VisualDL file, one set of checkpoints, and the pipeline
    assert len(os.listdir(out / "visualdl")) == 1
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl", "pipeline", "run.json",
                                      "visualdl", "vqvae"]
    # launched ranks leave with os._exit (ldm.runtime.distributed.exit_process): the last log lines and scalars
    # are there
    assert read_scalars(str(out / "visualdl"), "train/loss")[0] == [2, 4]
    assert "exported" in (tmp_path / "launch_logs" / "workerlog.0").read_text().splitlines()[-1]


def checkpoint_digest(checkpoint) -> dict[str, str]:
    """The sha256 of a checkpoint's weights and optimizer state, as its manifest records them (checked first)."""
    assert checkpoint_problem(str(checkpoint)) is None  # the manifest matches the bytes on disk
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    return {rel: info["sha256"] for rel, info in files.items()
            if rel.endswith(".safetensors") and not rel.startswith("training_state.")}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_process_runs_of_one_seed_end_with_bit_identical_weights(corpus, tmp_path):
    """The demo preset, 60 updates in two processes, twice: the same bytes at the end. Two runs of the demo's
    LDM stage once drifted apart after 50-100 updates, with caption dropout on: the drift came from records seeded by
    their shard's absolute path, so the second run reads a copy of the corpus in another folder, as a second clone of
    the project would, and differs from the first update on if that comes back (60 updates: past the first sign).

    The first run saves every 10 updates in the background (each rank writes its share of the same state, rank 0
    seals), the second waits for its one save: the snapshot is the state of its update, to the byte."""
    args = [a if a != "ldm-tiny" else "ldm-demo" for a in corpus]
    args[args.index("--train_batch_size") + 1] = "2"
    listing = args[args.index("--file_list") + 1]
    digests = []
    for run_name, saves in (("first", ["--save_steps", "10"]), ("second", ["--save_steps", "60", "--async_save",
                                                                         "false"])):
        folder = tmp_path / run_name
        folder.mkdir()
        if run_name == "second":
            shutil.copytree(os.path.dirname(listing), folder / "corpus")
            args[args.index("--file_list") + 1] = str(folder / "corpus" / os.path.basename(listing))
        result = run(args + ["--max_train_steps", "60", *saves, "--logging_steps", "50",
                             "--caption_dropout_prob", "0.1", "--learning_rate", "1e-3", "--num_workers", "0",
                             "--output_dir", str(folder / "out")], launch=True, cwd=folder)
        assert result.returncode == 0, launch_report(result, folder)
        digests.append(checkpoint_digest(folder / "out" / "checkpoint-60"))
    # UNet and LDMBert weights and the optimizer state, each rank's share of each
    assert len(digests[0]) == 6 and digests[0] == digests[1]
    first = tmp_path / "first" / "out"
    assert all(checkpoint_problem(str(first / f"checkpoint-{step}")) is None for step in range(10, 61, 10))
    saves = [line for line in map(json.loads, (first / "metrics.jsonl").read_text().splitlines())
             if "checkpoint/stall_seconds" in line]
    assert len(saves) == 6 and all(line["checkpoint/bytes"] > 1e6 and line["checkpoint/write_seconds"] > 0
                                    for line in saves)
    assert sorted(name for name in os.listdir(first / "checkpoint-60") if name.startswith("optimizer")) == \
        sorted(["optimizer.index.json", *(f"optimizer-0000{r}-of-00002.{e}" for r in (1, 2) for e in ("json",
                                                                                              "safetensors"))])


@pytest.mark.skipif(paddle.amp.is_float16_supported(), reason="fp16 works on this device")
@pytest.mark.parametrize("precision, message", [
    ("fp16", "fp16 mixed precision is not supported"),
    # a CPU without bf16 instructions says it is unsupported; one with them, that autocast casts nothing on a CPU
    ("bf16", "bf16 mixed precision on a CPU: Paddle's autocast casts nothing there, training in fp32"
     if paddle.amp.is_bfloat16_supported() else "bf16 mixed precision is not supported"),
])
def test_mixed_precision_this_device_cannot_run_falls_back_says_so_and_records_it(corpus, tmp_path, precision,
                                                                                  message):
    if paddle.device.get_device() != "cpu":
        pytest.skip("what a CPU does")
    result = run(corpus + ["--max_train_steps", "1", "--mixed_precision", precision, "--recompute", "--num_workers",
                           "0", "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert message in result.stderr
    assert read_training_state(tmp_path / "run" / "checkpoint-1")["step"] == 1
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["world"]["precision"] == "no" and record["arguments"]["LoopArguments"]["mixed_precision"] == precision


def test_a_run_with_no_practical_end_counts_its_progress_toward_the_next_checkpoint():
    from ldm.train.run import progress_target

    assert progress_target(3, 5, 2) == (5, "train")
    assert progress_target(3, 10**9, 100) == (100, "to checkpoint-100")  # the original recipe's 1e9 updates
    assert progress_target(100, 10**9, 100) == (200, "to checkpoint-200")


def test_the_progress_bar_and_a_resize_agree_on_which_run_has_no_practical_end():
    from ldm.train.elastic import NO_PRACTICAL_END, describe_resize
    from ldm.train.run import progress_target

    for max_steps in (NO_PRACTICAL_END // 2, NO_PRACTICAL_END - 1, NO_PRACTICAL_END):
        endless = progress_target(0, max_steps, 100)[1] != "train"
        line, _ = describe_resize(2, 8, 4, 16, 10, max_steps)
        assert endless == ("no practical end" in line), (max_steps, line)


@pytest.mark.parametrize("max_norm", [0.05, 1e9, float("inf")])
def test_clip_grad_norm_matches_paddles(max_norm):
    """The loop's clipping (`ldm.train.loop`: the norm, the factor, the rescaling below 1) against Paddle's."""
    from ldm.train.gradients import TensorGradients, clip_factor, global_grad_norm

    def loop_clip(parameters, max_norm):
        gradients = TensorGradients(parameters)
        norm = gradients.norm()
        factor = clip_factor(norm, max_norm)
        if factor is not None and float(factor) < 1:
            gradients.scale(float(factor))
        return norm

    def clipped(clip):
        paddle.seed(0)
        net = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.GELU(), paddle.nn.Linear(16, 4))
        (net(paddle.randn([5, 8])) ** 2).sum().backward()
        norm = clip(net.parameters(), max_norm)
        assert norm.stop_gradient  # no autograd graph kept by a norm the loop sums over a logging window
        norm = float(norm)
        return norm, [p.grad.numpy().copy() for p in net.parameters()]

    expected_norm, expected = clipped(paddle.nn.utils.clip_grad_norm_)
    norm, grads = clipped(loop_clip)
    unclipped, _ = clipped(lambda parameters, _: global_grad_norm(parameters))
    # two float sums of the same n non-negative squares, in other orders: each within n roundings of the exact one
    rel = 2 * sum(g.size for g in grads) * UNIT_ROUNDOFF
    assert unclipped == pytest.approx(expected_norm, rel=rel)
    assert norm == pytest.approx(expected_norm, rel=rel) and norm > 0.05
    for got, want in zip(grads, expected, strict=True):  # scaled by factors that far apart, and rounded once more
        np.testing.assert_allclose(got, want, rtol=rel + UNIT_ROUNDOFF, atol=0)
    total = np.sqrt(sum(float((g.astype("float64") ** 2).sum()) for g in grads))
    assert total == pytest.approx(min(norm, max_norm), rel=1e-4)  # clipped to max_norm, or untouched


@pytest.mark.slow
def test_overwrite_starts_afresh_and_resuming_refuses_another_autoencoder(corpus, tmp_path):
    from ppdiffusers import AutoencoderKL

    from ldm.models.autoencoder import autoencoder_identity
    from ldm.models.build import PRESETS_DIR

    out = tmp_path / "run"
    args = corpus + ["--max_train_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--num_workers", "0",
                     "--output_dir", str(out)]
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]
    other = AutoencoderKL.from_config(AutoencoderKL.load_config(str(PRESETS_DIR / "ldm-tiny" / "vqvae")))
    other.save_pretrained(str(tmp_path / "other_vae"))
    again = run(args + ["--overwrite_output_dir", "--vae_name_or_path", str(tmp_path / "other_vae")])
    assert again.returncode == 0, again.stderr[-3000:]
    # nothing of the first run survives or is reused: one VisualDL record, the new autoencoder everywhere
    assert len(os.listdir(out / "visualdl")) == 1
    wanted = autoencoder_identity(other)
    for folder in (out / "vqvae", out / "pipeline" / "vqvae"):
        assert autoencoder_identity(AutoencoderKL.from_pretrained(str(folder))) == wanted, folder

    # without --vae_name_or_path a resume continues with the autoencoder the checkpoint was trained with
    resumed = run(args + ["--max_train_steps", "3", "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"with the autoencoder it was trained with, {out / 'vqvae'}" in resumed.stderr
    third = AutoencoderKL.from_config(AutoencoderKL.load_config(str(PRESETS_DIR / "ldm-tiny" / "vqvae")))
    third.save_pretrained(str(tmp_path / "third_vae"))
    refused = run(args + ["--max_train_steps", "4", "--resume_from_checkpoint", "latest", "--vae_name_or_path",
                          str(tmp_path / "third_vae")])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "was trained with another autoencoder" in refused.stderr
    assert f"the run's own is {out / 'vqvae'}: pass --vae_name_or_path" in refused.stderr
    with open(out / "checkpoint-2" / "optimizer.safetensors", "r+b") as f:
        f.truncate(100)
    named = run(args + ["--max_train_steps", "3", "--vae_name_or_path", str(tmp_path / "other_vae"),
                        "--resume_from_checkpoint", str(out / "checkpoint-2")])
    assert named.returncode == 2 and "Traceback" not in named.stderr
    assert "not a usable checkpoint: optimizer.safetensors has 100 bytes" in named.stderr


def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_trains_on(corpus, tmp_path):
    """A job started twice, or a command repeated in another terminal: the second start is refused in one line
    naming the first, even with --overwrite_output_dir, and the first run finishes untouched."""
    import tempfile
    import time
    from pathlib import Path

    from entry import start_python

    out = tmp_path / "run"
    args = corpus + ["--max_train_steps", "12", "--save_steps", "6", "--logging_steps", "1", "--num_workers", "0",
                     "--seed", "5", "--output_dir", str(out)]
    log = os.path.join(tempfile.mkdtemp(dir=tmp_path), "log")
    first = start_python([ROOT / SCRIPT, *args], None, log, log)
    try:
        deadline = time.monotonic() + 240
        while "step 2 " not in Path(log).read_text() and first.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.exitcode is None, Path(log).read_text()[-3000:]
        for extra in (["--overwrite_output_dir"], ["--resume_from_checkpoint", "auto"], []):
            second = run(args + extra + ["--seed", "6"])
            assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
            assert re.search(rf"error: output_dir {re.escape(str(out))} is in use by another run \(host \S+, "
                             rf"pid {first.pid}, since", second.stderr), second.stderr[-3000:]
        first.join(240)
    finally:
        if first.exitcode is None:
            first.kill()
    assert first.exitcode == 0, Path(log).read_text()[-3000:]
    assert json.loads((out / "run.json").read_text())["arguments"]["LoopArguments"]["seed"] == 5
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-12", "checkpoint-6"]
    assert ".run.lock" not in os.listdir(out)  # released at the end: the next start is free
    resumed = run(args + ["--max_train_steps", "13", "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_stop_together_when_the_launcher_gets_sigterm(corpus, tmp_path):
    """Kubernetes signals the container's first process, here the launcher, which passes SIGTERM on (three
    times, 0.2 s apart): both ranks must finish the same update, save it once and exit."""
    out = tmp_path / "run"
    # far more updates than run before the signal: the launcher passes rank 0's output on only every 2 s
    args = corpus + ["--max_train_steps", "100000", "--save_steps", "100000", "--logging_steps", "1",
                     "--num_workers", "1", "--output_dir", str(out)]
    code, log = run_until(SCRIPT, args, "step 2 ", signal.SIGTERM, launch=True, cwd=tmp_path,
                          act=lambda proc: proc.send_signal(signal.SIGTERM))
    assert code != 0, log[-3000:]
    rank0 = (tmp_path / "launch_logs" / "workerlog.0").read_text()
    stopped = re.search(r"SIGTERM: stopped after update (\d+) and saved (\S+checkpoint-\d+)", rank0)
    assert stopped, launch_report(subprocess_result(code, log), tmp_path)
    checkpoint = stopped.group(2)
    assert checkpoint_problem(checkpoint) is None
    state = read_training_state(checkpoint)
    assert state["step"] == int(stopped.group(1)) and len(set(state["weights_checksum"])) == 1
    resumed = run(args[:-2] + ["--output_dir", str(out), "--max_train_steps", str(state["step"] + 2),
                               "--resume_from_checkpoint", "latest"], launch=True, cwd=tmp_path)
    assert resumed.returncode == 0, launch_report(resumed, tmp_path)
    assert len(set(read_training_state(out / f"checkpoint-{state['step'] + 2}")["weights_checksum"])) == 1


@pytest.mark.distributed
def test_ranks_whose_launcher_is_killed_save_the_update_they_are_in_and_exit(corpus, tmp_path):
    """A scheduler that SIGKILLs the launcher alone: the ranks (each in a session of its own) would train on beside
    the job started in its place; they get SIGTERM from the kernel instead (PR_SET_PDEATHSIG) and stop as after
    any SIGTERM."""
    import time

    from entry import launched_rank_pid

    out = tmp_path / "run"
    args = corpus + ["--max_train_steps", "100000", "--save_steps", "100000", "--logging_steps", "1",
                     "--num_workers", "1", "--output_dir", str(out)]
    ranks = []

    def kill_the_launcher_only(proc):
        ranks.extend(launched_rank_pid(proc.pid, rank) for rank in (0, 1))
        proc.kill()

    code, log = run_until(SCRIPT, args, "step 2 ", signal.SIGKILL, launch=True, cwd=tmp_path,
                          act=kill_the_launcher_only)
    assert code == -signal.SIGKILL and len(ranks) == 2
    deadline = time.monotonic() + 120
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "ranks trained on after their launcher was killed"
    stopped = re.search(r"SIGTERM: stopped after update (\d+) and saved (\S+checkpoint-\d+)",
                        (tmp_path / "launch_logs" / "workerlog.0").read_text())
    assert stopped and checkpoint_problem(stopped.group(2)) is None


class PixelRegression(Objective):
    """A deterministic objective (no noise, no dropout): a small conv net predicts each image's mean colour.
    The loss is a per-image mean, so a batch of 8 and two micro-batches of 4 of the same images must give the
    same update, through the loop's loss scaling, accumulation, clipping, LR schedule and AdamW. (AdamW and a
    binding clip hide a wrongly scaled loss from the weights; the logged gradient norm shows it.)"""

    tokenizer = None
    ema = None

    def __init__(self):
        paddle.seed(0)
        self.model = paddle.nn.Sequential(paddle.nn.Conv2D(3, 8, 3, padding=1), paddle.nn.GELU(),
                                          paddle.nn.AdaptiveAvgPool2D(1), paddle.nn.Flatten(), paddle.nn.Linear(8, 3))

    def loss(self, net, batch):
        from ldm.models.autoencoder import unit_range

        pixels = unit_range(batch["pixel_values"])
        return ((net(pixels) - pixels.mean(axis=[2, 3])) ** 2).mean(), {}

    def check_resume(self, checkpoint):
        pass

    def write_frozen(self, run_dir):
        pass

    def trained_parts(self):
        return {}  # its weights are written by `save`, at the snapshot: they are tiny

    def save(self, folder, final_folder, shares):
        save_state(folder, "net", self.model.state_dict())

    def export(self, checkpoint, batches, dist, run_dir):
        pass


def test_accumulating_two_micro_batches_of_4_is_one_update_of_a_batch_of_8(tmp_path):
    from ldm.config.args import DataArguments, LoopArguments
    from ldm.prepare.synth import synth_corpus
    from ldm.train.loop import train_objective

    listing = synth_corpus(str(tmp_path / "corpus"), num_records=48, resolution=16, records_per_shard=48)
    data = DataArguments(file_list=listing, resolution=16, shuffle_buffer=1)

    def train(batch_size, accumulation):
        out = tmp_path / f"{batch_size}x{accumulation}"
        objective = PixelRegression()
        # warm-up and a clip that binds: both must act once per update, on the accumulated gradient
        loop = LoopArguments(output_dir=str(out), train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, max_train_steps=4, learning_rate=0.05,
                             lr_scheduler="linear", lr_warmup_steps=2, max_grad_norm=0.02, num_workers=0,
                             save_steps=100, logging_steps=1)
        assert train_objective(loop, data, lambda dist, resume, resolved: objective)["step"] == 4
        logged = {tag: read_scalars(str(out / "visualdl"), tag)[1]
                  for tag in ("train/loss", "train/grad_norm", "train/learning_rate")}
        return load_state(str(out / "checkpoint-4"), "net"), logged

    (one, logged_one), (two, logged_two) = train(8, 1), train(4, 2)
    start = PixelRegression().model.state_dict()
    for name, value in one.items():
        assert not np.allclose(value, start[name].numpy()), name  # it trained
    # one batch of 8 or two of 4 sum each gradient in another order (tests/tolerance.py)
    assert_same_training(two, one, learning_rate=0.05, updates=4)
    for tag, values in logged_one.items():
        assert len(values) == 4, tag
        # each a forward (and backward) of weights that close: within the gradients' relative error
        np.testing.assert_allclose(np.array(logged_two[tag]), np.array(values), rtol=GRADIENT_ERROR, err_msg=tag)
    assert min(logged_one["train/grad_norm"]) > 0.02  # the clip bound: clipped at every update


def tfevents_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars of TensorBoard event files, read with their protobuf (records: length, crc, event, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for name in os.listdir(folder):
        data = (folder / name).read_bytes()
        while data:
            (length,) = struct.unpack("<Q", data[:8])
            event = event_pb2.Event.FromString(data[12:12 + length])
            data = data[12 + length + 4:]
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_trackers_tensorboard_and_wandb_offline_or_none(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    common = corpus + ["--max_train_steps", "2", "--logging_steps", "1", "--num_workers", "0", "--save_steps", "100",
                       "--image_logging_steps", "2", "--num_inference_steps", "1",
                       "--validation_prompts", "a red circle"]
    result = run(common + ["--report_to", "tensorboard", "wandb", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "visualdl").exists()
    scalars = tfevents_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2]
    assert "train/data_ok" in scalars and "train/learning_rate" in scalars
    runs = list((out / "wandb").glob("wandb/offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").rglob("*"))
    assert list(runs[0].glob("run-*.wandb")) and (runs[0] / "files" / "media" / "images").is_dir()

    quiet = tmp_path / "quiet"
    result = run(common + ["--report_to", "none", "--output_dir", str(quiet)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not {"visualdl", "tensorboard", "wandb"} & set(os.listdir(quiet))
    assert os.listdir(quiet / "images" / "validation" / "guidance_7.5") == ["00000002.png"]  # asked for by a flag


@pytest.mark.parametrize("script", [SCRIPT, "train_txt2img_laion400m_trainer.py"])
def test_a_resumed_run_continues_its_wandb_run(corpus, tmp_path, monkeypatch, script):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    out = tmp_path / "run"
    common = corpus + ["--num_workers", "0", "--report_to", "wandb", "--output_dir", str(out)]
    if script != SCRIPT:  # the Trainer path's names for the same settings
        common = [{"--pretrained_model_name_or_path": "--model_name_or_path",
                   "--train_batch_size": "--per_device_train_batch_size",
                   "--num_workers": "--dataloader_num_workers"}.get(a, a) for a in common] + ["--do_train"]
    steps = "--max_train_steps" if script == SCRIPT else "--max_steps"
    for step, extra in ((1, []), (2, ["--resume_from_checkpoint", "latest"])):
        result = run_entry(script, common + [steps, str(step), "--save_steps", "1", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
    run_id = (out / "wandb" / "run_id").read_text().strip()
    where = "wandb/wandb" if script == SCRIPT else "runs/*/wandb"  # the Trainer's: below its logging_dir
    runs = sorted(p.name for p in out.glob(f"{where}/offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs


@pytest.mark.parametrize("limit, what", [(5 << 20, "checkpoint-2"), (3 << 20, "checkpoint-2"), (2 << 20, "vqvae")])
def test_a_save_that_finds_no_space_ends_with_one_line_and_the_retry_resumes(corpus, tmp_path, limit, what):
    """A real failed write: a file-size limit the optimizer state (6.6 MB) exceeds and the autoencoder
    (2.9 MB) does not, so the run starts and its first checkpoint cannot be written (in the background: the run
    ends at the next update); at 3 MB the UNet's weights (3.2 MB) are what fails, at 2 MB the frozen autoencoder
    written at the start (both found by the soak: tracebacks)."""
    from entry import run_python

    from ldm.checkpoint.run_folder import TEMP_PREFIX

    out = tmp_path / "run"
    args = corpus + ["--max_train_steps", "3", "--save_steps", "2", "--num_workers", "0", "--output_dir", str(out)]
    result = run_python(["-c", FILE_SIZE_LIMIT, str(limit), ROOT / SCRIPT, *args])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no space to write {what if what != 'vqvae' else out / 'vqvae'}"), last
    assert "--resume_from_checkpoint auto" in last
    assert not [name for name in os.listdir(out) if name.startswith(TEMP_PREFIX) or name.startswith("checkpoint-")]

    retry = run(args + ["--resume_from_checkpoint", "auto"])
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert read_training_state(out / "checkpoint-3")["step"] == 3


def test_three_updates_on_img2dataset_tars_with_metadata_filters(img2dataset_corpus, vocab_dir, tmp_path):
    """The tars img2dataset wrote (tests/img2dataset_corpus.py), read directly by two loader workers, filtered."""
    out = tmp_path / "run"
    result = run(["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
                  img2dataset_corpus["tar_list"], "--tokenizer_name", vocab_dir, "--model_max_length", "16",
                  "--resolution", "32", "--train_batch_size", "4", "--max_train_steps", "3", "--save_steps", "3",
                  "--logging_steps", "1", "--num_workers", "2", "--output_dir", str(out),
                  "--metadata_filter", "punsafe < 0.5", "min_side >= 160"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_training_state(out / "checkpoint-3")["step"] == 3
    ok = read_scalars(str(out / "visualdl"), "train/data_ok")[1]
    rejected = read_scalars(str(out / "visualdl"), "train/data_filter_punsafe_lt_0.5")[1]
    assert ok[-1] >= 12 and rejected[-1] > 0


class PoisonedPixelRegression(PixelRegression):
    """PixelRegression whose loss is NaN at the updates `poisoned` (1-based), as a poisoned record would make it."""

    def __init__(self, poisoned, use_ema=False):
        super().__init__()
        from ldm.models.ema import EMA

        self.poisoned, self.calls = set(poisoned), 0
        self.ema = EMA(self.model, 0.99) if use_ema else None

    def loss(self, net, batch):
        self.calls += 1
        loss, extra = super().loss(net, batch)
        return (loss * float("nan") if self.calls in self.poisoned else loss), extra


def pixel_run(tmp_path, objective, name, **loop_overrides):
    from ldm.config.args import DataArguments, LoopArguments, RunArguments
    from ldm.prepare.synth import synth_corpus
    from ldm.train.loop import train_objective

    listing = synth_corpus(str(tmp_path / "corpus"), num_records=48, resolution=16, records_per_shard=48)
    data = DataArguments(file_list=listing, resolution=16, shuffle_buffer=1)
    settings = {"output_dir": str(tmp_path / name), "train_batch_size": 4, "max_train_steps": 5, "learning_rate": 0.05,
                "lr_scheduler": "linear", "lr_warmup_steps": 0, "num_workers": 0, "save_steps": 1,
                "logging_steps": 1, "report_to": ["none"], **loop_overrides}
    max_in_row = settings.pop("max_nonfinite_updates", 20)
    run_args = settings.pop("run_args", None) or RunArguments(max_nonfinite_updates=max_in_row)
    return train_objective(LoopArguments(**settings), data, lambda dist, resume, resolved: objective,
                           run_args=run_args)


def test_phase_timing_says_where_each_window_of_updates_spent_its_time(tmp_path):
    """With --phase_timing, each logging step adds the fraction of the window's time in each phase (`ldm.train.phases`):
    all of them, adding up to 1, the ones every update has above 0; off, none is logged."""
    from ldm.config.args import DataArguments, LoopArguments, RunArguments
    from ldm.prepare.synth import synth_corpus
    from ldm.train.loop import train_objective as train_loop
    from ldm.train.phases import PHASES

    listing = synth_corpus(str(tmp_path / "corpus"), num_records=48, resolution=16, records_per_shard=48)
    data = DataArguments(file_list=listing, resolution=16, shuffle_buffer=1)
    for timing in (True, False):
        out = tmp_path / f"timing-{timing}"
        loop = LoopArguments(output_dir=str(out), train_batch_size=4, gradient_accumulation_steps=2, max_train_steps=4,
                             num_workers=0, save_steps=2, logging_steps=2, report_to=["none"])
        train_loop(loop, data, lambda dist, resume, resolved: PixelRegression(),
                   run_args=RunArguments(phase_timing=timing))
        logged = [m for m in metrics_lines(out) if "train/loss" in m]
        phases = [{k[len("train/phase_"):]: v for k, v in m.items() if k.startswith("train/phase_")} for m in logged]
        if not timing:
            assert phases == [{}, {}]
            continue
        assert [sorted(p) for p in phases] == [sorted(PHASES)] * 2
        for window in phases:
            assert abs(sum(window.values()) - 1) < 1e-6, window
            assert all(window[name] > 0 for name in ("data", "forward", "backward", "clip", "vote", "optimizer",
                                                     "ema")), window  # (one process: no gradient to all-reduce)
        assert phases[0]["checkpoint"] == 0 and phases[1]["checkpoint"] > 0  # update 2's save, after its log


def test_profile_steps_write_each_ranks_trace_its_operators_and_where_the_window_went(tmp_path):
    """--profile_steps 2-3: Paddle's profiler from the end of update 1 to the end of update 3; a Chrome trace, Paddle's
    table of operators and the window's phases (adding up to its time), with --phase_timing off."""
    from ldm.config.args import DataArguments, LoopArguments, RunArguments
    from ldm.prepare.synth import synth_corpus
    from ldm.train.loop import train_objective as train_loop
    from ldm.train.phases import PHASES

    listing = synth_corpus(str(tmp_path / "corpus"), num_records=48, resolution=16, records_per_shard=48)
    out = tmp_path / "run"
    loop = LoopArguments(output_dir=str(out), train_batch_size=4, max_train_steps=4, num_workers=0, save_steps=4,
                         logging_steps=1, report_to=["none"])
    train_loop(loop, DataArguments(file_list=listing, resolution=16, shuffle_buffer=1),
               lambda dist, resume, resolved: PixelRegression(), run_args=RunArguments(profile_steps="2-3"))
    folder = out / "profile"
    traces = [name for name in os.listdir(folder) if name.endswith(".paddle_trace.json")]
    assert len(traces) == 1 and traces[0].startswith("rank0")
    events = json.loads((folder / traces[0]).read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfileStep")}
    assert len(steps) >= 2 and any(e.get("name") == "adamw" or "adamw" in e.get("name", "") for e in events)
    assert "Operator Summary" in (folder / "rank0-operators.txt").read_text()
    lines = (folder / "rank0-phases.txt").read_text().splitlines()
    assert lines[0].startswith("updates 2-3 on rank 0: ")
    total = float(lines[0].split(": ")[1].split(" s")[0])
    rows = {line.split()[0]: float(line.split()[1]) for line in lines[2:]}
    assert sorted(rows) == sorted(PHASES) and sum(rows.values()) == pytest.approx(total, abs=1e-3)
    assert min(rows[name] for name in ("data", "forward", "backward", "optimizer")) > 0
    logged = [m for m in metrics_lines(out) if "train/loss" in m]
    assert len(logged) == 4 and not any("train/phase_forward" in m for m in logged)  # --phase_timing is off


def test_a_profile_window_the_run_never_reaches_is_said_at_start_and_a_malformed_one_in_one_line(tmp_path, capfd):
    from ldm.config.args import RunArguments
    from ldm.runtime.errors import UserError

    for malformed in ("²-³", "3-1", "a-b", "5"):
        with pytest.raises(UserError, match="--profile_steps must be A-B"):
            RunArguments(profile_steps=malformed)
    assert RunArguments(profile_steps=" 2 - 3 ").profile_window == (2, 3)
    pixel_run(tmp_path, PixelRegression(), "run", max_train_steps=2, run_args=RunArguments(profile_steps="50-60"))
    err = capfd.readouterr().err  # (the run sets up its own log handlers: read what it printed)
    assert "WARNING ldm.train: --profile_steps 50-60: this run ends at update 2, so nothing is profiled" in err, err
    assert not (tmp_path / "run" / "profile").exists()


def test_the_loop_rescales_gradients_only_when_their_norm_exceeds_the_maximum(tmp_path):
    """One update with `adam_epsilon` 100, so that the update is nearly proportional to the gradient: a binding
    `max_grad_norm` shrinks it by max / norm; a maximum the norm stays within (whose rescaling pass the loop
    leaves out) trains bit-identically to no clipping at all."""
    def update(name, max_grad_norm):
        pixel_run(tmp_path, PixelRegression(), name, max_train_steps=1, max_grad_norm=max_grad_norm,
                  adam_epsilon=100.0, adam_weight_decay=0.0, learning_rate=10.0, report_to=["visualdl"])
        norm = read_scalars(str(tmp_path / name / "visualdl"), "train/grad_norm")[1][0]
        return load_state(str(tmp_path / name / "checkpoint-1"), "net"), norm

    start = {name: value.numpy() for name, value in PixelRegression().model.state_dict().items()}
    free, norm = update("free", 0)
    within, _ = update("within", norm * 1.5)
    clipped, _ = update("clipped", norm / 4)
    for name in start:
        np.testing.assert_array_equal(within[name], free[name], err_msg=name)
        moved, moved_clipped = free[name] - start[name], clipped[name] - start[name]
        assert np.abs(moved).max() > 1e-4, name
        # g / (|g| + 100) per element: a quarter of the gradient moves each weight by a quarter, give or take |g|
        np.testing.assert_allclose(moved_clipped, moved / 4, rtol=0.02, atol=1e-3 * np.abs(moved).max())


def test_a_non_finite_update_is_skipped_whole_and_the_run_goes_on(tmp_path):
    """Update 3's loss is NaN: its weights, optimizer moments, schedule and EMA stay as after update 2; it is
    counted and logged in metrics.jsonl; updates 4 and 5 train as usual."""
    result = pixel_run(tmp_path, PoisonedPixelRegression({3}, use_ema=True), "run")
    assert result["step"] == 5 and result["exit_code"] == 0
    out = tmp_path / "run"
    states = {step: read_training_state(out / f"checkpoint-{step}") for step in (2, 3, 4)}
    nets = {step: load_state(str(out / f"checkpoint-{step}"), "net") for step in (2, 3, 4)}
    optimizer = {step: load_state(str(out / f"checkpoint-{step}"), "optimizer") for step in (2, 3, 4)}
    emas = {step: load_state(str(out / f"checkpoint-{step}"), "ema") for step in (2, 3, 4)}
    for name in nets[2]:
        np.testing.assert_array_equal(nets[3][name], nets[2][name], err_msg=name)  # no step
        assert not np.array_equal(nets[4][name], nets[3][name]), name  # and the next one trained
    for name, value in optimizer[2].items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(optimizer[3][name], value, err_msg=name)  # moments and beta powers
    assert states[3]["lr_scheduler"]["last_epoch"] == states[2]["lr_scheduler"]["last_epoch"]
    assert states[4]["lr_scheduler"]["last_epoch"] == states[2]["lr_scheduler"]["last_epoch"] + 1
    assert emas[3]["num_updates"] == emas[2]["num_updates"] == 2 and emas[4]["num_updates"] == 3
    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert [line["train/nonfinite_skips"] for line in lines] == [0, 0, 1, 0, 0]
    # the skipped update's loss was NaN: null in the strict JSON of metrics.jsonl
    assert lines[2]["train/loss"] is None and all(np.isfinite(line["train/loss"]) for line in lines if
                                                  line["step"] != 3)


def test_updates_non_finite_in_a_row_stop_the_run_naming_the_last_good_checkpoint(tmp_path):
    from ldm.runtime.errors import NonFiniteStop

    with pytest.raises(NonFiniteStop) as stopped:
        pixel_run(tmp_path, PoisonedPixelRegression({3, 4, 5, 6}), "run", max_train_steps=10, save_steps=2,
                  max_nonfinite_updates=3)
    message = str(stopped.value)
    assert "3 updates in a row (the last at update 5)" in message
    assert message.count("\n") == 0 and f"{tmp_path / 'run' / 'checkpoint-4'}" in message
    # checkpoint-4 (update 4 skipped) holds the weights of update 2; nothing later was written
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.startswith("checkpoint-")) == ["checkpoint-2",
                                                                                              "checkpoint-4"]
    two, four = (load_state(str(tmp_path / "run" / f"checkpoint-{s}"), "net") for s in (2, 4))
    assert all(np.array_equal(two[name], four[name]) for name in two)


@pytest.mark.parametrize("launch", [False, pytest.param(True, marks=pytest.mark.distributed)])
def test_an_absurd_learning_rate_is_stopped_by_the_guard_with_one_line(corpus, tmp_path, launch):
    """A learning rate of 1e30: update 1 wrecks the weights, every later loss is NaN and skipped on every rank;
    the third skip in a row ends the run, non-zero, naming the last checkpoint (written before, finite)."""
    out = tmp_path / "run"
    result = run(corpus + ["--max_train_steps", "30", "--save_steps", "2", "--logging_steps", "1", "--num_workers", "0",
                           "--learning_rate", "1e30", "--max_nonfinite_updates", "3", "--report_to", "none",
                           "--output_dir", str(out)], launch=launch, cwd=tmp_path)
    errors = guard_stop_errors(result, tmp_path, launch)
    assert (len(errors) == 1 or launch and errors) and all("3 updates in a row (the last at update 4)" in line
                                                          for line in errors)
    assert all(f"last good checkpoint is {out / 'checkpoint-2'}" in line for line in errors)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2"]
    lines = metrics_lines(out)
    assert [(line["step"], line["train/nonfinite_skips"]) for line in lines] == [(1, 0), (2, 1), (3, 1), (4, 1)]


def test_run_json_records_the_whole_run_and_a_resume_logs_changes_and_refuses_a_new_prediction_type(corpus, tmp_path):
    """--config YAML beneath the command line; run.json, every checkpoint and metrics.jsonl (with --report_to none);
    a resume that changes settings logs one line each and continues the metrics file; the prediction type cannot
    change halfway unless --allow_config_change says so."""
    import dataclasses
    import subprocess

    import paddle

    from ldm.config.args import NO_TRAINER_GROUPS as groups

    out = tmp_path / "run"
    config = {"pretrained_model_name_or_path": "ldm-tiny", "allow_untrained_vae": True,  # the corpus flags
              "file_list": corpus[corpus.index("--file_list") + 1],
              "tokenizer_name": corpus[corpus.index("--tokenizer_name") + 1],
              "model_max_length": 16, "resolution": 32, "train_batch_size": 4, "num_workers": 0,
              "learning_rate": 0.5, "report_to": ["none"], "logging_steps": 1, "save_steps": 2}
    (tmp_path / "run.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in config.items()))
    first = run(["--config", str(tmp_path / "run.yaml"), "--learning_rate", "1e-3", "--max_train_steps", "2",
                 "--output_dir", str(out)])
    assert first.returncode == 0, first.stderr[-3000:]
    recorded = json.loads((out / "run.json").read_text())
    assert set(recorded["arguments"]) == {g.__name__ for g in groups}
    for group in groups:  # every field, defaults included
        assert set(recorded["arguments"][group.__name__]) == {f.name for f in dataclasses.fields(group)}
    loop = recorded["arguments"]["LoopArguments"]
    assert loop["learning_rate"] == 1e-3 and loop["adam_beta2"] == 0.999 and loop["report_to"] == ["none"]
    assert recorded["arguments"]["RunArguments"]["config"] == str(tmp_path / "run.yaml")
    assert recorded["command"][-2:] == ["--output_dir", str(out)]
    assert recorded["world"]["world_size"] == 1 and recorded["world"]["dataloader_workers_per_rank"] == 0
    assert recorded["versions"]["paddle"] == paddle.__version__ and recorded["versions"]["ppdiffusers"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert recorded["git"]["commit"] == head.stdout.strip()
    model = recorded["model"]
    assert model["prediction_type"] == "epsilon" and model["source"].endswith("ldm-tiny")
    assert set(model["autoencoder"]) == {"config_sha256", "weights_sha256"} and model["flops_per_sample"]["total"] > 0
    in_checkpoint = json.loads((out / "checkpoint-2" / "run_config.json").read_text())
    assert in_checkpoint["step"] == 2 and in_checkpoint["arguments"] == recorded["arguments"]
    metrics = metrics_lines(out)
    assert [m["step"] for m in metrics] == [1, 2]
    # the training loss by quarter of the noise schedule, beside the loss
    assert {f"train/loss_q{q}" for q in (1, 2, 3, 4)} <= set(metrics[0])

    again = ["--config", str(tmp_path / "run.yaml"), "--max_train_steps", "3", "--output_dir", str(out),
             "--resume_from_checkpoint", "latest", "--learning_rate", "2e-3"]
    refused = run(again + ["--prediction_type", "v_prediction"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "prediction type: 'epsilon' -> 'v_prediction'" in last
    assert "--allow_config_change" in last

    resumed = run(again + ["--prediction_type", "v_prediction", "--allow_config_change"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    changes = [line.split("WARNING ldm.train: ")[1] for line in resumed.stderr.splitlines() if "resume changes" in line]
    assert "resume changes --learning_rate: 0.001 -> 0.002" in changes
    assert "resume changes --max_train_steps: 2 -> 3" in changes
    assert "resume changes model.prediction_type: 'epsilon' -> 'v_prediction'" in changes
    assert len(changes) == len(set(changes))
    assert [line["step"] for line in metrics_lines(out)] == [1, 2, 3]
    resumes = json.loads((out / "run.json").read_text())["resumes"]
    assert len(resumes) == 1 and resumes[0]["resumed_from"].endswith("checkpoint-2")
    assert resumes[0]["model"]["prediction_type"] == "v_prediction"


@pytest.mark.parametrize("mode", ["bar", "none"])
def test_progress_bar_or_nothing_when_asked(corpus, tmp_path, mode):
    result = run(corpus + ["--max_train_steps", "2", "--logging_steps", "1", "--num_workers", "0", "--report_to",
                           "none", "--progress", mode, "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "progress train: update" not in result.stderr
    if mode == "bar":  # rank 0's bar: speed and data-wait share beside the loss, counted toward the end of the run
        assert "train: 100%" in result.stderr and "samples_s=" in result.stderr and "data_wait=" in result.stderr
    else:
        assert "train:  " not in result.stderr and "upd/s" not in result.stderr and "\r" not in result.stderr


def test_an_update_reads_the_device_once_for_the_guard_and_nowhere_else(tmp_path, monkeypatch):
    """How the guard's cost was checked: every read of a device value into Python (bool, item, float, int,
    numpy, tolist) is counted by where it comes from, in runs of 3 and 6 updates that log and save only at
    their end; the 3 updates more cost exactly 3 reads, all of them the update's vote, which carries the guard's
    verdict (`ldm.runtime.vote`; on a GPU a host synchronisation each; with several ranks the stop vote's read, which
    it replaces), and Paddle's optimizer step reads nothing (the verdict reaches it as a Python bool)."""
    import traceback
    from collections import Counter

    reads = []

    def counting(name, original):
        def read(self, *args, **kwargs):
            frames = traceback.extract_stack(limit=12)[:-1]
            ours = [f for f in frames if "/ldm/" in f.filename]
            reads.append(f"{os.path.basename(ours[-1].filename)}:{ours[-1].name}" if ours else
                         "paddle" if any("/paddle/" in f.filename for f in frames) else "other")
            return original(self, *args, **kwargs)
        return read

    for name in ("__bool__", "item", "__float__", "__int__", "numpy", "tolist"):
        monkeypatch.setattr(paddle.Tensor, name, counting(name, getattr(paddle.Tensor, name)))

    counts = []
    for updates in (3, 6):
        reads.clear()
        result = pixel_run(tmp_path / str(updates), PixelRegression(), "run", max_train_steps=updates,
                           save_steps=100, logging_steps=100)
        assert result["step"] == updates
        counts.append(Counter(reads))
    extra = counts[1] - counts[0]
    assert extra == {"vote.py:cast": 3}, (counts[0], counts[1])


@pytest.mark.slow
def test_validation_loss_is_logged_leaves_training_alone_and_matches_the_offline_tool(corpus, tmp_path):
    """eval/loss, eval/loss_t<t> and the EMA's at updates 2 and 4; the same run without validation ends with the
    same weights (its random state and data position untouched); `python -m ldm.evaluate loss` on checkpoint-4 prints
    the numbers training logged for those weights."""
    from entry import run_python

    listing = corpus[corpus.index("--file_list") + 1]
    common = corpus + ["--max_train_steps", "4", "--save_steps", "4", "--logging_steps", "2", "--num_workers", "0",
                       "--use_ema", "--learning_rate", "1e-3", "--report_to", "none"]
    validated = run(common + ["--validation_file_list", listing, "--validation_steps", "2",
                              "--validation_samples", "10", "--validation_timesteps", "4",
                              "--output_dir", str(tmp_path / "a")])
    assert validated.returncode == 0, validated.stderr[-3000:]
    plain = run(common + ["--output_dir", str(tmp_path / "b")])
    assert plain.returncode == 0, plain.stderr[-3000:]
    got, _ = weights(tmp_path / "a" / "checkpoint-4")
    expected, _ = weights(tmp_path / "b" / "checkpoint-4")
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)

    lines = metrics_lines(tmp_path / "a")
    evals = {line["step"]: line for line in lines if "eval/loss" in line}
    assert sorted(evals) == [2, 4]
    names = {"eval/loss", "eval/ema_loss", "eval/time_fraction"} | {f"eval/{kind}loss_t{t}" for kind in ("", "ema_")
                                                                   for t in (125, 375, 625, 875)}
    assert names <= set(evals[4]), sorted(evals[4])
    assert evals[2]["eval/loss"] != evals[4]["eval/loss"] and evals[4]["eval/loss"] != evals[4]["eval/ema_loss"]
    assert evals[4]["eval/loss"] == pytest.approx(np.mean([evals[4][f"eval/loss_t{t}"] for t in (125, 375, 625, 875)]))

    for kind, prefix in (("raw", "eval/"), ("ema", "eval/ema_")):
        offline = run_python(["-m", "ldm.evaluate", "loss", "--model", str(tmp_path / "a" / "checkpoint-4"),
                              "--file_list", listing, "--validation_samples", "10", "--validation_timesteps", "4",
                              "--weights", kind, "--json"])
        assert offline.returncode == 0, offline.stderr[-3000:]
        printed = json.loads(offline.stdout.strip().splitlines()[-1])
        assert printed["records"] == 10
        for name in ("loss", "loss_t125", "loss_t875"):
            assert printed[name] == pytest.approx(evals[4][prefix + name], rel=1e-6), (kind, name)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_validation_loss_is_the_same_on_one_process_and_two(corpus, tmp_path):
    from entry import run_python

    listing = corpus[corpus.index("--file_list") + 1]
    result = run(corpus + ["--max_train_steps", "1", "--num_workers", "0", "--report_to", "none",
                           "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    args = ["--model", str(tmp_path / "run" / "checkpoint-1"), "--file_list", listing, "--validation_samples", "11",
            "--json"]
    one = run_python(["-m", "ldm.evaluate", "loss", *args])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_entry("ldm/evaluate.py", ["loss", *args], launch=True, cwd=tmp_path)
    assert two.returncode == 0, launch_report(two, tmp_path)
    on_two = [line for line in (tmp_path / "launch_logs" / "workerlog.0").read_text().splitlines()
              if line.startswith("{")]
    a, b = json.loads(one.stdout.strip().splitlines()[-1]), json.loads(on_two[-1])
    assert a["records"] == b["records"] == 11  # 6 on rank 0, 5 on rank 1
    for name, value in a.items():
        if name.startswith("loss"):
            assert b[name] == pytest.approx(value, rel=1e-6), name


class CorruptingPixelRegression(PixelRegression):
    """PixelRegression whose weights turn NaN during update 3 (as a broken kernel or a bad device could make them)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def loss(self, net, batch):
        self.calls += 1
        if self.calls == 3:
            with paddle.no_grad():
                weight = self.model[0].weight
                weight.set_value(paddle.full_like(weight, float("nan")))
        return super().loss(net, batch)


def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path):
    from ldm.runtime.errors import NonFiniteStop

    with pytest.raises(NonFiniteStop) as stopped:
        pixel_run(tmp_path, CorruptingPixelRegression(), "run", max_train_steps=5, save_steps=1)
    assert str(stopped.value).startswith("the weights are not finite at update 3: checkpoint-3 is not written")
    assert str(tmp_path / "run" / "checkpoint-2") in str(stopped.value)
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.startswith("checkpoint")) == ["checkpoint-1",
                                                                                            "checkpoint-2"]


def test_a_32_then_64_curriculum_starts_from_the_checkpoint_records_its_lineage_and_samples_non_square(
        corpus, tmp_path):
    """Stage 1 at 32 px with EMA; stage 2 at 64 px from its checkpoint (`--init_from_checkpoint`): the weights and
    the EMA carry over, the optimizer, schedule and data pass start afresh, run.json names the parent; the stage 2
    pipeline samples 64x96 images. Another architecture, or a resume, do not load it."""
    from entry import run_python

    from ldm.checkpoint.run_folder import MANIFEST, sha256_file

    stage1, stage2 = tmp_path / "s32", tmp_path / "s64"
    common = corpus + ["--num_workers", "0", "--use_ema", "--report_to", "none"]
    first = run(common + ["--max_train_steps", "2", "--output_dir", str(stage1)])
    assert first.returncode == 0, first.stderr[-3000:]
    parent = stage1 / "checkpoint-2"
    args = [a if a != "32" else "64" for a in common] + ["--init_from_checkpoint", str(parent)]
    second = run(args + ["--max_train_steps", "2", "--output_dir", str(stage2)])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "a new stage from" in second.stderr
    lineage = json.loads((stage2 / "run.json").read_text())["lineage"]
    assert lineage["init_from"] == str(parent) and lineage["step"] == 2 and lineage["ema"] == "checkpoint"
    assert lineage["manifest_sha256"] == sha256_file(str(parent / MANIFEST))
    assert lineage["parent_run"]["output_dir"] == str(stage1)
    state = read_training_state(stage2 / "checkpoint-2")
    assert state["step"] == 2 and all(s["pass"] == 0 for r in state["stream"] for s in r["slots"].values())
    assert load_state(str(stage2 / "checkpoint-2"), "ema")["num_updates"] == 4  # 2 of stage 1, then 2 more
    assert load_state(str(stage2 / "checkpoint-2"), "optimizer")  # its own, of 2 updates
    unet = json.loads((stage2 / "pipeline" / "unet" / "config.json").read_text())
    assert unet["sample_size"] == 16  # 64 px: the size the stage trained at is the size it samples at

    sampled = run_python(["-m", "ldm.generate", "--model", str(stage2 / "pipeline"), "--prompt", "a red circle",
                          "--num_inference_steps", "2", "--height", "64", "--width", "96", "--output_dir",
                          str(tmp_path / "samples")])
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    image = next(p for p in (tmp_path / "samples").iterdir() if p.name != "grid.png")
    from PIL import Image

    with Image.open(image) as im:
        assert im.size == (96, 64)
    odd = run_python(["-m", "ldm.generate", "--model", str(stage2 / "pipeline"), "--prompt", "x", "--height", "30",
                      "--output_dir", str(tmp_path / "odd")])
    assert odd.returncode == 2 and "must be a positive multiple of 4" in odd.stderr.strip().splitlines()[-1]

    other = run([a if a != "ldm-tiny" else "ldm-demo" for a in args] + [  # the same autoencoder, another UNet
        "--vae_name_or_path", str(stage1 / "vqvae"), "--max_train_steps", "1", "--output_dir", str(tmp_path / "other")])
    assert other.returncode == 2 and "another architecture" in other.stderr.strip().splitlines()[-1], other.stderr
    assert not (tmp_path / "other").exists()
    resumed = run(args + ["--max_train_steps", "3", "--output_dir", str(stage2), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0 and "is not loaded again" in resumed.stderr, resumed.stderr[-3000:]
    assert "resume changes lineage" not in resumed.stderr
    assert json.loads((stage2 / "checkpoint-3" / "run_config.json").read_text())["lineage"] == lineage
    target = run(args + ["--prediction_type", "v_prediction", "--max_train_steps", "1", "--output_dir",
                         str(tmp_path / "v")])
    assert target.returncode == 2 and "predicts epsilon" in target.stderr.strip().splitlines()[-1], target.stderr
    # a stage that freezes the LDMBert stage 1 trained: the frozen encoder is the checkpoint's, written once apart
    frozen = run(args + ["--train_text_encoder", "false", "--max_train_steps", "1", "--vae_name_or_path",
                         str(stage1 / "vqvae"), "--output_dir", str(tmp_path / "frozen")])
    assert frozen.returncode == 0, frozen.stderr[-3000:]
    from safetensors.numpy import load_file

    trained = load_file(str(parent / "bert" / "model.safetensors"))
    kept = load_file(str(tmp_path / "frozen" / "text_encoder" / "model.safetensors"))
    assert trained.keys() == kept.keys() and all(np.array_equal(kept[k], trained[k]) for k in trained)
    assert not (tmp_path / "frozen" / "checkpoint-1" / "bert").exists()


def test_a_resume_keeps_the_checkpoints_seed_unless_one_is_given(corpus, tmp_path):
    out = tmp_path / "run"
    args = corpus + ["--max_train_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--num_workers", "0",
                     "--output_dir", str(out)]
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["arguments"]["LoopArguments"]["seed"] == 23  # the recipe's, unless given
    (out / "seed.yaml").write_text("seed: 5\n")
    resumed = run(args + ["--max_train_steps", "3", "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {out / 'checkpoint-2'} with its seed 23" in resumed.stderr
    assert "resume changes --seed" not in resumed.stderr
    other = run(args + ["--max_train_steps", "4", "--resume_from_checkpoint", "latest", "--config",
                        str(out / "seed.yaml")])
    assert other.returncode == 0, other.stderr[-3000:]
    assert "--seed 5 is not the seed 23 of" in other.stderr and "the next pass starts in the order of seed 5" in \
        other.stderr
    assert [r["arguments"]["LoopArguments"]["seed"] for r in json.loads((out / "run.json").read_text())["resumes"]] \
        == [23, 5]


def test_a_bin_carrying_code_given_to_init_from_checkpoint_is_one_line_and_never_runs(corpus, tmp_path):
    from interop_models import plant_code

    folder = tmp_path / "pipeline"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "interop", "diffusers-bin"), folder)
    marker = tmp_path / "PWNED"
    plant_code(folder / "unet" / "diffusion_pytorch_model.bin", "conv_in.weight", marker)
    result = run(corpus + ["--max_train_steps", "1", "--init_from_checkpoint", str(folder), "--vae_name_or_path",
                           str(folder), "--output_dir",
                           str(tmp_path / "run")])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("error: "), \
        result.stderr[-3000:]
    assert "can run code" in result.stderr and not marker.exists()
    assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") == []


def test_captions_cut_to_the_caption_length_are_counted_and_said_once_at_the_end(corpus, tmp_path):
    """The corpus's captions ('photo N') are at least two tokens: at --model_max_length 3 ([CLS] one [SEP]) each is
    cut, which the run counts (data_truncated_captions beside data_ok) and says in one line at its end."""
    args = [*corpus, "--model_max_length", "3", "--max_train_steps", "2", "--logging_steps", "1", "--num_workers",
            "0", "--caption_dropout_prob", "0", "--output_dir", str(tmp_path / "run")]
    result = run(args)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f if "train/data_ok" in line][-1]
    assert last["train/data_truncated_captions"] == last["train/data_ok"] >= 8, last
    said = [line for line in result.stderr.splitlines() if "longer than the 3 tokens" in line]
    assert len(said) == 1 and f"{int(last['train/data_ok'])} of the {int(last['train/data_ok'])} captions" in said[0]
