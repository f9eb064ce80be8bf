"""Stream state save/restore, the Paddle DataLoader over 2 workers, caption dropout, bad input."""

import json
import multiprocessing
import os
import shutil
import threading
import time
from collections import Counter
from itertools import islice

import numpy as np
import pytest
from corpus import write_corpus
from test_data_plan import text_shards

from ldm.data.dataset import CaptionImageStream, StreamState, build_dataloader
from ldm.data.filelist import read_file_list
from ldm.data.record import ImageTransform, SkipRecord
from ldm.data.stream import NoUsableData, SlotStream
from ldm.data.tokenize import CaptionTokenizer, load_tokenizer
from ldm.runtime.compat import stop_loader


def skip_every_fifth(record):
    if record.line_number % 5 == 0:
        raise SkipRecord("bad_image")
    return (record.shard, record.line_number, record.pass_index)


@pytest.mark.parametrize("cut", [0, 1, 7, 23, 40, 61])
def test_restored_slot_stream_continues_exactly(tmp_path, cut):
    shards = text_shards(tmp_path, [9, 4, 13, 6])
    total = 70  # more than two passes of this slot
    reference = SlotStream(shards, 1, 3, seed=2, shuffle_buffer=5)
    expected = list(islice(reference.samples(skip_every_fifth), total))

    first = SlotStream(shards, 1, 3, seed=2, shuffle_buffer=5)
    stream = first.samples(skip_every_fifth)
    got = [next(stream) for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))  # must survive serialisation
    resumed = SlotStream(shards, 1, 3, seed=2, shuffle_buffer=5, state=state)
    got += list(islice(resumed.samples(skip_every_fifth), total - cut))
    assert got == expected
    assert resumed.counts["bad_image"] == reference.counts["bad_image"]


def test_state_for_another_slot_is_refused(tmp_path):
    shards = text_shards(tmp_path, [3])
    state = SlotStream(shards, 0, 2).state_dict()
    with pytest.raises(ValueError, match="slot 0 of 2"):
        SlotStream(shards, 1, 2, state=state)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return write_corpus(str(folder), num_records=60, records_per_shard=7, kinds=("jpeg", "png", "rgba"), bad_every=9)


def make_stream(corpus, vocab_dir, state=None, num_workers=2, length=16, **kw):
    options = dict(batch_size=4, caption_dropout_prob=0.1, seed=3, shuffle_buffer=8)
    options.update(kw)
    return CaptionImageStream(
        read_file_list(corpus),
        tokenize=CaptionTokenizer(load_tokenizer(vocab_dir), length),
        transform=ImageTransform(32),
        num_workers=num_workers,
        state=state,
        **options,
    )


def consume(loader, tracker, n):
    out = []
    iterator = iter(loader)
    try:
        for batch in iterator:
            batch = tracker.update(batch)
            out.append((np.asarray(batch["pixel_values"]).copy(), np.asarray(batch["input_ids"]).copy()))
            if len(out) == n:
                break
    finally:
        stop_loader(iterator)  # no reader thread may outlive its loader: later loaders fork workers
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_captions_cut_to_the_caption_length_are_counted_across_workers(corpus, vocab_dir, num_workers):
    """Every corpus caption ('photo N') is at least two tokens: at 3 ([CLS] one [SEP]) each is cut, at 64 none is.
    The count crosses from the loader's workers with the stream state, as the skipped records' do."""
    for length, cut in ((3, True), (64, False)):
        tracker = StreamState(num_workers)
        stream = make_stream(corpus, vocab_dir, num_workers=num_workers, length=length, caption_dropout_prob=0.0)
        consume(build_dataloader(stream, num_workers), tracker, 10)
        counts = tracker.counts()
        assert counts["ok"] == 40 and counts["truncated_captions"] == (40 if cut else 0), counts


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_sees_exactly_the_uninterrupted_batches(corpus, vocab_dir, num_workers):
    total, cut = 14, 5  # 56 samples: past the first pass (~53 usable records)
    tracker = StreamState(num_workers)
    expected = consume(build_dataloader(make_stream(corpus, vocab_dir, num_workers=num_workers), num_workers),
                       tracker, total)
    # pixels cross from the workers as uint8 (a quarter of float32's bytes); the model scales them
    assert expected[0][0].shape == (4, 3, 32, 32) and expected[0][0].dtype == np.uint8
    assert expected[0][1].shape == (4, 16) and expected[0][1].dtype == np.int64
    assert max(p.max() for p, _ in expected) > 128 and min(p.min() for p, _ in expected) < 128  # not [-1, 1]

    first = StreamState(num_workers)
    got = consume(build_dataloader(make_stream(corpus, vocab_dir, num_workers=num_workers), num_workers), first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    second = StreamState(num_workers)
    second.load_state_dict(state)
    got += consume(build_dataloader(make_stream(corpus, vocab_dir, state, num_workers), num_workers), second,
                   total - cut)
    for (p1, i1), (p2, i2) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(p1, p2)
    assert len(tracker.slots) == max(1, num_workers)
    assert second.counts() == tracker.counts()
    assert sum(v for k, v in tracker.counts().items() if k != "ok") > 0


@pytest.mark.parametrize("saved_world, resumed_world", [(1, 1), (2, 1)])
def test_resume_with_another_layout_reads_the_rest_of_the_pass_exactly_once(corpus, vocab_dir, tmp_path, monkeypatch,
                                                                            saved_world, resumed_world):
    """Saved with 2 loader workers (on 1 or 2 ranks), resumed with 0 workers on 1 rank: the rest of pass 0 is read
    first, and over both runs every usable record of pass 0 reaches the trainer once (the workers' prefetched
    batches and shuffle buffers count as not consumed)."""
    from ldm.data.dataset import CONSUMED_LOG, rank_stream_state

    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    saved = []
    for rank in range(saved_world):
        tracker = StreamState(2)
        stream = make_stream(corpus, vocab_dir, num_workers=2, world_size=saved_world, rank=rank)
        consume(build_dataloader(stream, 2), tracker, 3)
        saved.append(json.loads(json.dumps(tracker.state_dict())))
    assert max(s["pass"] for rank_state in saved for s in rank_state["slots"].values()) == 0
    before = len(log.read_text().splitlines())

    state = rank_stream_state(saved, 0, resumed_world)
    stream = make_stream(corpus, vocab_dir, state, num_workers=0, world_size=resumed_world)
    assert stream.resumes_exactly and [s.pass_index for s in stream.schedule.plan] == [0]
    resumed = StreamState(0)
    resumed.load_state_dict(state)
    iterator = iter(build_dataloader(stream, 0))
    try:
        while not resumed.slots or resumed.slots[0]["pass"] == 0:
            resumed.update(next(iterator))
    finally:
        stop_loader(iterator)
    lines = [line.split() for line in log.read_text().splitlines()]
    pass0 = Counter((shard, line) for p, _, shard, line, *_ in lines if p == "0")
    assert before == 3 * 4 * saved_world and max(pass0.values()) == 1
    assert len(pass0) == 60  # every good record of the corpus (its bad ones are skipped)
    assert resumed.counts()["ok"] >= 60  # the counts of the first run's slots are carried over


@pytest.mark.parametrize("num_workers", [0, 2])
def test_closing_the_batches_stops_the_loader_workers_and_threads(corpus, num_workers):
    from ldm.config.args import DataArguments
    from ldm.runtime.distributed import Distributed
    from ldm.train.batches import build_batches

    before, children = set(threading.enumerate()), set(multiprocessing.active_children())
    data = DataArguments(file_list=corpus, resolution=32)
    batches = iter(build_batches(data, None, batch_size=4, seed=0, dist=Distributed(), num_workers=num_workers))
    next(batches)
    assert set(threading.enumerate()) - before  # Paddle's reader thread runs
    workers = set(multiprocessing.active_children()) - children
    assert len(workers) == num_workers
    batches.close()
    # nothing left for interpreter exit to stop: the reader thread and the workers have ended, and
    # the queues' feeder threads end on their own once the queues are closed
    assert not any("_thread_loop" in t.name for t in set(threading.enumerate()) - before)
    assert not any(w.is_alive() for w in workers)
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) - before == set()


def test_the_data_wait_counts_from_the_first_update_not_from_the_loaders_start(corpus):
    """The first batch is read at the start (loader workers spawned), before any update: the first window's
    data_wait_fraction measures the updates' waits only, as --phase_timing's phase_data does."""
    from ldm.config.args import DataArguments
    from ldm.runtime.distributed import Distributed
    from ldm.train.batches import build_batches

    batches = build_batches(DataArguments(file_list=corpus, resolution=32), None, batch_size=4, seed=0,
                            dist=Distributed(), num_workers=2)
    try:
        batches.start()
        next(iter(batches))
        time.sleep(0.3)  # an update
        _, wait_fraction, _, _ = batches.window(Distributed())
    finally:
        batches.close()
    assert wait_fraction < 0.05, wait_fraction


def test_caption_dropout_uses_the_stream_seed(corpus, vocab_dir):
    def empty_fraction(seed):
        tracker = StreamState(0)
        stream = make_stream(corpus, vocab_dir, num_workers=0, caption_dropout_prob=0.5, seed=seed)
        ids = np.concatenate([i for _, i in consume(build_dataloader(stream, 0), tracker, 25)])
        return ids, float(np.mean(ids[:, 2] == 0))  # [CLS] [SEP] [PAD]... for the empty caption

    ids_a, fraction = empty_fraction(1)
    assert 0.35 < fraction < 0.65
    ids_b, _ = empty_fraction(1)
    np.testing.assert_array_equal(ids_a, ids_b)


def test_a_corpus_copied_elsewhere_gives_the_same_batches(corpus, vocab_dir, tmp_path):
    """Caption dropout and random crops are seeded by the shards as the lists name them, not by the folder
    the corpus sits in: two clones of a project train alike (the demo's LDM drifted between clones)."""
    copy = shutil.copytree(os.path.dirname(corpus), tmp_path / "elsewhere")
    listing = os.path.join(copy, os.path.basename(corpus))
    paths = [{s.path for s in read_file_list(f)} for f in (corpus, listing)]
    assert paths[0].isdisjoint(paths[1])  # the copy's shards are read from the copy

    def batches(file_list):
        stream = make_stream(file_list, vocab_dir, num_workers=0, caption_dropout_prob=0.5)
        return consume(build_dataloader(stream, 0), StreamState(0), 10)

    for (pixels_a, ids_a), (pixels_b, ids_b) in zip(batches(corpus), batches(listing), strict=True):
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(pixels_a, pixels_b)


def test_fewer_records_than_slots_fails_at_start(tmp_path, vocab_dir):
    listing = write_corpus(str(tmp_path), num_records=3, records_per_shard=2)
    with pytest.raises(ValueError, match="3 record.*4 .rank, dataloader worker. slots"):
        make_stream(listing, vocab_dir, num_workers=2, world_size=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_data_error_reaches_the_training_loop_as_itself(tmp_path, num_workers):
    """Paddle's DataLoader loses dataset exceptions (num_workers=0 hung forever): they must arrive."""
    from ldm.config.args import DataArguments
    from ldm.runtime.distributed import Distributed
    from ldm.train.batches import build_batches

    for i in range(2):
        (tmp_path / f"bad{i}.gz").write_bytes(b"no tabs here\n" * 10)
    (tmp_path / "f").write_text("bad0.gz\nbad1.gz\nmissing.gz\n")
    (tmp_path / "list").write_text("f\n")
    data = DataArguments(file_list=str(tmp_path / "list"), resolution=32, data_timeout=60)
    batches = iter(build_batches(data, None, batch_size=2, seed=0, dist=Distributed(), num_workers=num_workers))
    with pytest.raises(NoUsableData, match="no usable record.*missing_columns") as caught:
        next(batches)
    assert "raised in the data loader" in "\n".join(caught.value.__notes__)


STALL_SCRIPT = """
import sys
from ldm.config.args import DataArguments
from ldm.runtime.distributed import Distributed
from ldm.train.batches import build_batches
data = DataArguments(file_list=sys.argv[1], resolution=32, data_timeout=float(sys.argv[3]))
batches = build_batches(data, None, batch_size=2, seed=0, dist=Distributed(), num_workers=int(sys.argv[2]))
for batch in batches:
    print("got a batch", flush=True)
"""


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stalled_shard_ends_the_run_with_stacks_and_where_it_stalled(tmp_path, num_workers):
    """A shard whose read never returns (a named pipe nobody writes, like a hung object-store request)."""
    import os

    from entry import run_python

    for i in range(2):
        os.mkfifo(tmp_path / f"stuck{i}.gz")
    (tmp_path / "f").write_text("stuck0.gz\nstuck1.gz\n")
    (tmp_path / "list").write_text("f\n")
    # (a hang fails by run_python's timeout; how long the 3 s watchdog takes on a loaded machine is not the test's)
    result = run_python(["-c", STALL_SCRIPT, tmp_path / "list", num_workers, "3"], timeout=240)
    assert result.returncode == 124, result.stderr[-3000:]
    assert "no data batch for 3 s (--data_timeout)" in result.stderr
    assert "slot 0 of " in result.stderr and ("stuck0.gz" in result.stderr or "stuck1.gz" in result.stderr)
    assert "open_shard" in result.stderr  # the stack of the reader, wherever it runs
    if num_workers:
        assert "slot 1 of 2" in result.stderr
        assert result.stderr.count("Current thread") + result.stderr.count("Thread 0x") >= 2


def test_closing_stops_a_worker_stuck_inside_a_record_in_bounded_time(tmp_path, monkeypatch):
    """A worker blocked in a read never looks at its queue again: closing must kill it, not wait forever."""
    import os

    from ldm.config.args import DataArguments
    from ldm.data.plan import slot_units
    from ldm.runtime import compat
    from ldm.runtime.distributed import Distributed
    from ldm.train.batches import build_batches

    monkeypatch.setattr(compat, "WORKER_EXIT_SECONDS", 2)
    write_corpus(str(tmp_path / "good"), num_records=8, records_per_shard=8)
    good = str(tmp_path / "good" / "train-00000.gz")
    os.mkfifo(tmp_path / "stuck.gz")
    listing = tmp_path / "f"
    listing.write_text(f"{good}\n{tmp_path / 'stuck.gz'}\n")
    (tmp_path / "list").write_text(f"{listing}\n")
    shards = read_file_list(str(tmp_path / "list"))
    if shards[slot_units(shards, 0, 2, 0, 0)[0].shard].path != good:  # worker 0 (first batch) reads the good one
        listing.write_text(f"{tmp_path / 'stuck.gz'}\n{good}\n")
        assert read_file_list(str(tmp_path / "list"))[slot_units(shards, 0, 2, 0, 0)[0].shard].path == good
    # the stuck worker's slot is never waited for (the first batch comes from worker 0); the watchdog only
    # bounds a hang of the test itself
    data = DataArguments(file_list=str(tmp_path / "list"), resolution=32, data_timeout=60)
    batches = iter(build_batches(data, None, batch_size=2, seed=0, dist=Distributed(), num_workers=2))
    next(batches)
    workers = multiprocessing.active_children()
    start = time.monotonic()
    batches.close()
    assert time.monotonic() - start < 15
    assert not any(w.is_alive() for w in workers)


def test_loader_workers_die_with_a_killed_training_process(tmp_path):
    """kill -9 of the training process while its workers hang in a read must not leave them running."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    for i in range(2):
        os.mkfifo(tmp_path / f"stuck{i}.gz")
    (tmp_path / "f").write_text("stuck0.gz\nstuck1.gz\n")
    (tmp_path / "list").write_text("f\n")
    trainer = subprocess.Popen([sys.executable, "-c", STALL_SCRIPT, str(tmp_path / "list"), "2", "0"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children():
        found = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/status") as f:
                    if any(line.split()[1:] == [str(trainer.pid)] for line in f if line.startswith("PPid:")):
                        found.append(int(name))
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 60
    while len(children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = children()
    assert len(workers) >= 2
    time.sleep(1)  # the workers are blocked opening their shards by now
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    def running(pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                return "zombie" not in f.read()
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in workers if running(pid)]
    for pid in alive:  # do not leave them behind if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive


@pytest.mark.parametrize("edit", ["append", "remove_first"])
def test_a_resume_over_an_edited_file_list_is_refused_unless_asked_and_plan_says_the_same(tmp_path, vocab_dir, edit):
    """The data position is a position in the shard order it was made for: another set of shards is refused in one
    line (by training and by `plan --from_checkpoint`); asked for, the interrupted pass ends and pass 1 starts."""
    from ldm.checkpoint.serialization import save_state
    from ldm.data.dataset import DataChanged, rank_stream_state
    from ldm.data.filelist import shard_set
    from ldm.prepare import tools

    listing = write_corpus(str(tmp_path / "corpus"), num_records=64, records_per_shard=8)
    extra = write_corpus(str(tmp_path / "more"), num_records=8, records_per_shard=8)
    shards = read_file_list(listing)
    tracker = StreamState(2, shard_set(shards))
    consume(build_dataloader(make_stream(listing, vocab_dir, num_workers=2, seed=5), 2), tracker, 3)
    saved = [json.loads(json.dumps(tracker.state_dict()))]
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    save_state(str(checkpoint), "training_state", {"stream": saved})
    plan_args = ["plan", "--file_list", listing, "--world_size", "1", "--num_workers", "2",
                 "--from_checkpoint", str(checkpoint)]
    assert tools.main(plan_args) == 0  # unchanged: plans the rest of pass 0

    filelist = tmp_path / "corpus" / "train.filelist"
    names = filelist.read_text().splitlines()
    if edit == "append":
        names.append(os.path.relpath(read_file_list(extra)[0].path, filelist.parent))
    else:
        names = names[1:]
    filelist.write_text("\n".join(names) + "\n")

    with pytest.raises(DataChanged, match="--allow_data_change") as refused:
        make_stream(listing, vocab_dir, rank_stream_state(saved, 0, 1), num_workers=2, seed=5)
    assert ("8 shards when it was saved, now 9" if edit == "append" else "now 7") in str(refused.value)
    stream = make_stream(listing, vocab_dir, rank_stream_state(saved, 0, 1), num_workers=2, seed=5,
                         allow_data_change=True)
    assert stream.schedule.plan == [] and stream.schedule.next_pass == 1

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert tools.main(plan_args) == 2
    assert err.getvalue().startswith("error: the file list names other shards") and err.getvalue().count("\n") == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tools.main(plan_args + ["--allow_data_change"]) == 0
    assert out.getvalue() == ""  # nothing of the interrupted pass is left to plan: pass 1 is a fresh one


@pytest.mark.parametrize("what", ["run_folder", "pipeline", "missing", "pickle", "damaged"])
def test_plan_from_something_that_is_no_checkpoint_is_one_line(tmp_path, what, capsys):
    from ldm.prepare import tools

    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    target = tmp_path / what
    if what == "run_folder":
        (target / "checkpoint-2").mkdir(parents=True)
        (target / "run.json").write_text("{}")
    elif what == "pipeline":
        target.mkdir()
        (target / "model_index.json").write_text("{}")
    elif what == "pickle":
        target.mkdir()
        (target / "training_state.pkl").write_bytes(b"old")
    elif what == "damaged":  # files that no longer match its manifest: a resume refuses it, plan too
        from ldm.checkpoint.run_folder import write_manifest

        target.mkdir()
        (target / "training_state.json").write_text("{}")
        write_manifest(str(target))
        (target / "training_state.json").write_text("{} ")
    assert tools.main(["plan", "--file_list", listing, "--world_size", "1", "--num_workers", "0",
                       "--from_checkpoint", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
