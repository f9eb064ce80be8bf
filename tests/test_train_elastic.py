"""Resuming on another number of processes or loader workers: the data of the interrupted pass end to end
(the hand-written loop under paddle.distributed.launch), and what the rest of the run does (ldm.train.elastic)."""

import json
import os
import re
from collections import Counter

import pytest
from conftest import ROOT
from corpus import write_corpus
from entry import launch_report, run_entry, run_python

from ldm.checkpoint.format import read_training_state
from ldm.data.dataset import CONSUMED_LOG
from ldm.train.elastic import describe_resize

SCRIPT = "train_txt2img_laion400m_no_trainer.py"


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_then_one_then_two_read_every_record_of_the_pass_once(tmp_path, vocab_dir, monkeypatch):
    """2 ranks x 2 workers -> 1 rank, no workers -> 2 ranks x 1 worker: every record of the interrupted pass
    reaches a trainer exactly once over the three runs (each run's taken records are logged by the loop), and
    `python -m ldm.prepare plan --from_checkpoint` tells beforehand what the second run reads of it."""
    listing = write_corpus(str(tmp_path / "corpus"), num_records=48, records_per_shard=8, kinds=("jpeg", "png"))
    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    out = tmp_path / "run"
    common = ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
              "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32",
              "--train_batch_size", "4", "--logging_steps", "1", "--output_dir", str(out), "--seed", "7",
              "--shuffle_buffer", "3"]  # small: slots stop inside shards (the Trainer test: all in buffers)

    def taken():
        return [line.split() for line in log.read_text().splitlines()] if log.exists() else []

    first = run_entry(SCRIPT, common + ["--num_workers", "2", "--max_train_steps", "2", "--save_steps", "2"],
                      launch=True, cwd=tmp_path)
    assert first.returncode == 0, launch_report(first, tmp_path)
    assert len(taken()) == 2 * 2 * 4  # ranks x updates x batch: what the trainers took, not what was prefetched
    saved = read_training_state(out / "checkpoint-2")
    assert saved["world_size"] == 2 and all(s["pass"] == 0 for r in saved["stream"] for s in r["slots"].values())

    plan = run_python(["-m", "ldm.data", "plan", "--from_checkpoint", out / "checkpoint-2", "--file_list", listing,
                       "--world_size", "1", "--num_workers", "0"])
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned = Counter((shard, line) for _, _, shard, line in (row.split() for row in plan.stdout.splitlines()))
    assert len(planned) + len(taken()) == 48 and not planned & Counter((s, n) for _, _, s, n, *_ in taken())

    before = len(taken())
    second = run_entry(SCRIPT, common + ["--num_workers", "0", "--max_train_steps", "4", "--save_steps", "2",
                                         "--resume_from_checkpoint", "latest"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "read the rest first: pass(es) [0]" in second.stderr
    # global batch 8 -> 4: the 2 x 8 samples left of --max_train_steps 4 are 4 updates of 4 (ldm.train.elastic)
    assert "global batch 8 -> 4" in second.stderr and "max_steps 4 -> 6" in second.stderr
    assert read_training_state(out / "checkpoint-6")["samples"]["samples"] == 32
    assert int(re.search(r"\((\d+) partly read", second.stderr).group(1)) >= 1  # slots stopped inside units
    second_taken = taken()[before:]
    assert len(second_taken) == 4 * 4
    assert Counter((s, n) for _, _, s, n, *_ in second_taken) <= planned  # from the rest of the pass, as planned

    third = run_entry(SCRIPT, common + ["--num_workers", "1", "--max_train_steps", "12", "--save_steps", "12",
                                        "--resume_from_checkpoint", "latest"], launch=True, cwd=tmp_path)
    assert third.returncode == 0, launch_report(third, tmp_path)
    final = read_training_state(out / "checkpoint-12")
    assert all(s["pass"] >= 1 for r in final["stream"] for s in r["slots"].values())  # every slot is past pass 0
    records = Counter((shard, line) for p, _, shard, line, *_ in taken() if p == "0")
    print(f"pass 0: {sum(records.values())} records taken over 2x2 -> 1x0 -> 2x1, {len(records)} distinct of 48")
    assert len(records) == 48 and set(records.values()) == {1}
    shards = {shard for shard, _ in records}
    assert len(shards) == 6 and all(os.path.isfile(s) for s in shards)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_entry_point_resumes_two_processes_on_one_reading_the_pass_once(tmp_path, vocab_dir,
                                                                                     monkeypatch):
    """The PaddleNLP Trainer path, 2 ranks x 2 workers -> 1 rank in-process, the default shuffle buffer (every
    record read so far sits in a buffer): the rest of pass 0 is read first, each record once over both runs."""
    listing = write_corpus(str(tmp_path / "corpus"), num_records=48, records_per_shard=8, kinds=("jpeg",))
    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    common = ["--do_train", "--model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
              "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32",
              "--per_device_train_batch_size", "4", "--logging_steps", "1", "--output_dir", str(tmp_path / "out"),
              "--seed", "7"]
    script = "train_txt2img_laion400m_trainer.py"
    first = run_entry(script, common + ["--dataloader_num_workers", "2", "--max_steps", "2", "--save_steps", "2"],
                      launch=True, cwd=tmp_path)
    assert first.returncode == 0, launch_report(first, tmp_path)
    second = run_entry(script, common + ["--dataloader_num_workers", "0", "--max_steps", "10", "--save_steps", "10",
                                         "--resume_from_checkpoint", "latest"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "read the rest first: pass(es) [0]" in second.stderr
    assert "max_steps 10 -> 18" in second.stderr  # 80 samples asked for, 16 seen: 16 updates of 4 left
    records = Counter((shard, line) for p, _, shard, line, *_ in (row.split() for row in log.read_text().splitlines())
                      if p == "0")
    assert len(records) == 48 and set(records.values()) == {1}


def test_keeping_the_schedule_in_samples_seen():
    message, max_steps = describe_resize(8, 256, 4, 128, step=1000, max_steps=5000)
    assert max_steps == 1000 + 4000 * 2  # the remaining 4000 x 256 samples in updates of 128
    assert "global batch 256 -> 128" in message and "max_steps 5000 -> 9000" in message
    assert "learning-rate schedule" in message

    message, max_steps = describe_resize(4, 128, 8, 256, step=1000, max_steps=9001)
    assert max_steps == 1000 + 4001  # ceil(8001 x 128 / 256): never fewer samples than asked for


def test_the_same_global_batch_changes_nothing():
    message, max_steps = describe_resize(2, 64, 4, 64, step=10, max_steps=100)
    assert max_steps == 100 and "same global batch" in message and "2 -> 4 ranks" in message


def test_a_run_at_or_past_its_end_and_a_run_with_no_practical_end():
    assert describe_resize(2, 64, 1, 32, step=100, max_steps=100)[1] == 100
    _, max_steps = describe_resize(2, 64, 1, 32, step=10, max_steps=10**9)
    assert max_steps == 10**9  # the original recipe's "no end": kept as it is


@pytest.mark.parametrize("bad", [dict(saved_global_batch=0), dict(new_global_batch=-1), dict(step=-1)])
def test_nonsense_is_refused(bad):
    args = dict(saved_world_size=2, saved_global_batch=64, new_world_size=1, new_global_batch=32, step=10,
                max_steps=100)
    args.update(bad)
    with pytest.raises(ValueError):
        describe_resize(**args)


def test_the_sample_clock_keeps_the_schedule_in_samples_and_changes_nothing_on_the_same_batch():
    from ldm.train.elastic import SampleClock

    clock = SampleClock(global_batch=8, world_size=2, max_steps=10)
    for _ in range(3):
        clock.advance()
    assert clock.position == 3 and isinstance(clock.position, int)  # the schedule's own whole steps
    saved = clock.state_dict()

    halved = SampleClock(global_batch=4, world_size=1, max_steps=10)
    halved.load_state_dict(saved)
    assert halved.max_steps == 3 + (80 - 24) // 4 and "global batch 8 -> 4" in halved.message
    halved.advance()
    assert halved.position == 3.5  # half an update of the first batch per update of the new one

    same = SampleClock(global_batch=8, world_size=2, max_steps=12)  # a longer run asked for, same layout
    same.load_state_dict(saved)
    assert same.max_steps == 12 and same.message == ""

    unrecorded = SampleClock(global_batch=8, world_size=2, max_steps=10)
    unrecorded.assume(3)  # a checkpoint written before the clock existed
    assert unrecorded.state_dict() == saved


def test_a_run_resized_and_resized_back_keeps_planning_in_samples():
    """1000 updates of 64 planned; 500 done on 64, 100 on 128, 100 on 64 again: 200 updates of 64 are left,
    whatever the layout of the next resume (the shortcut for an unchanged batch must not forget the resize)."""
    from ldm.train.elastic import SampleClock

    def resumed(state, global_batch, world_size, updates):
        clock = SampleClock(global_batch, world_size, max_steps=1000)
        clock.load_state_dict(state)
        for _ in range(updates):
            clock.advance()
        return clock

    first = SampleClock(64, 1, max_steps=1000)
    for _ in range(500):
        first.advance()
    wider = resumed(first.state_dict(), 128, 2, 100)
    assert wider.max_steps == 500 + 500 * 64 // 128
    back = resumed(wider.state_dict(), 64, 1, 100)
    assert back.max_steps == 600 + (1000 * 64 - 500 * 64 - 100 * 128) // 64
    again = resumed(back.state_dict(), 64, 1, 0)
    assert again.max_steps == back.max_steps == 900 and again.message == ""


def test_skipped_updates_count_as_consumed_and_leave_the_schedule_where_it_was():
    from ldm.train.elastic import SampleClock

    clock = SampleClock(8, 1, max_steps=10)
    clock.advance()
    clock.skip()
    clock.advance()
    assert clock.updates == 3 and clock.position == 2  # the schedule stepped for the two applied updates
    same = SampleClock(8, 1, max_steps=10)
    same.load_state_dict(clock.state_dict())
    assert same.max_steps == 10  # as an uninterrupted run: skipped updates are not made up


def test_a_scaler_state_from_a_run_without_fp16_leaves_the_fresh_scaler():
    import paddle

    from ldm.checkpoint.manager import scaler_part

    scaler = paddle.amp.GradScaler(enable=True, init_loss_scaling=1024.0)
    scaler._enable = True  # Paddle disables fp16 scaling on a CPU; an enabled scaler refuses an empty state
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    part = scaler_part(scaler)
    part.load({})  # what a disabled scaler saves (a run in fp32, bf16, or on a device without fp16)
    part.missing({"step": 3})  # a Trainer-path checkpoint, which has no scaler part then
    assert scaler._enable  # and nothing raised


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_nodes_on_one_machine_train_and_checkpoint_once_then_one_node_resumes_reading_the_pass_once(
        tmp_path, vocab_dir, monkeypatch):
    """Two launchers (`--nnodes 2 --master 127.0.0.1:PORT --rank 0` and `--rank 1`, one process each), as a
    two-node job starts; one writer of the checkpoint; then one process resumes and reads the rest of pass 0."""
    import subprocess
    import sys

    listing = write_corpus(str(tmp_path / "corpus"), num_records=24, records_per_shard=6)
    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    out = tmp_path / "run"
    common = ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
              "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32",
              "--train_batch_size", "2", "--output_dir", str(out), "--seed", "3", "--report_to", "none"]
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2", "--master",
                               f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", "1", "--log_dir",
                               str(tmp_path / f"node{node}"), str(ROOT / SCRIPT), *common, "--num_workers", "1",
                               "--max_train_steps", "2", "--save_steps", "2"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    logs = [(tmp_path / f"node{node}" / "workerlog.0").read_text() for node in (0, 1)]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs + logs)
    assert "saved" in logs[0] and "saved" not in logs[1]  # rank 0 (node 0) writes; node 1 writes nothing
    record = json.loads((out / "run.json").read_text())
    assert record["world"]["world_size"] == 2 and record["world"]["nodes"] == 2
    saved = read_training_state(out / "checkpoint-2")
    assert saved["world_size"] == 2 and len(saved["stream"]) == 2
    first = len(log.read_text().splitlines())
    assert first == 2 * 2 * 2  # nodes x updates x batch

    resumed = run_entry(SCRIPT, common + ["--num_workers", "0", "--max_train_steps", "12", "--save_steps", "12",
                                          "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "read the rest first: pass(es) [0]" in resumed.stderr
    taken = [line.split() for line in log.read_text().splitlines()]
    records = Counter((shard, line) for p, _, shard, line, *_ in taken if p == "0")
    assert len(records) == 24 and set(records.values()) == {1}
