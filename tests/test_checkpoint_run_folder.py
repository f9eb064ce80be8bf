"""The run folder: which checkpoint resumes, what rotation deletes, what starting over removes."""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from ldm.checkpoint.lock import LEASE_SECONDS, LOCK_NAME
from ldm.checkpoint.run_folder import (
    MANIFEST,
    RUN_MARKER,
    CheckpointError,
    RunFolder,
    checkpoint_problem,
    latest_checkpoint,
    resolve_resume,
    write_manifest,
)
from ldm.runtime.distributed import Distributed


def make_checkpoint(output_dir, step, complete=True, payload=b"weights" * 100):
    folder = output_dir / f"checkpoint-{step}"
    (folder / "unet").mkdir(parents=True)
    (folder / "unet" / "model.safetensors").write_bytes(payload + str(step).encode())
    (folder / "optimizer.pdopt").write_bytes(payload * 2)
    if complete:
        write_manifest(str(folder))
    return folder


def test_latest_skips_incomplete_and_damaged_checkpoints_and_names_them(tmp_path, caplog):
    make_checkpoint(tmp_path, 1)
    good = make_checkpoint(tmp_path, 2)
    truncated = make_checkpoint(tmp_path, 3)
    with open(truncated / "optimizer.pdopt", "r+b") as f:
        f.truncate(10)
    flipped = make_checkpoint(tmp_path, 4)
    data = bytearray((flipped / "unet" / "model.safetensors").read_bytes())
    data[5] ^= 0x01  # same size: only the checksum can tell
    (flipped / "unet" / "model.safetensors").write_bytes(bytes(data))
    unfinished = make_checkpoint(tmp_path, 5, complete=False)

    with caplog.at_level(logging.WARNING, logger="ldm.train"):
        assert latest_checkpoint(str(tmp_path)) == str(good)
    skipped = "\n".join(caplog.messages)
    for folder, why in ((unfinished, "damaged: no manifest.json (a sealed checkpoint always has one"),
                        (flipped, "does not match its checksum"), (truncated, "optimizer.pdopt has 10 bytes")):
        assert f"skipping {folder}: " in skipped and why in skipped
    (good / "notes.txt").write_text("added after the seal")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ldm.train"):
        assert resolve_resume(str(tmp_path), "latest") == str(good)
    assert "holds 1 file(s) its manifest does not name (notes.txt)" in caplog.text
    with pytest.raises(CheckpointError, match="checkpoint-4: not a usable checkpoint: .*checksum"):
        resolve_resume(str(tmp_path), str(flipped))


def test_latest_with_no_complete_checkpoint_is_an_error(tmp_path):
    make_checkpoint(tmp_path, 7, complete=False)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path), "latest")


def test_rotation_keeps_the_newest_complete_ones_and_reports_failed_deletes(tmp_path, monkeypatch, caplog):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 4, complete=False)  # a newer, interrupted one does not count
    RunFolder(str(tmp_path), Distributed(), save_total_limit=1).rotate()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4"]
    assert checkpoint_problem(str(tmp_path / "checkpoint-3")) is None

    make_checkpoint(tmp_path, 5)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="ldm.train"):
        RunFolder(str(tmp_path), Distributed(), save_total_limit=1).rotate()
    assert any("could not delete" in m and "checkpoint-3" in m for m in caplog.messages)


def test_starting_over_empties_only_a_folder_this_project_made(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    folder = RunFolder(str(out), Distributed())
    with pytest.raises(CheckpointError, match="is not empty"):
        folder.check(None, overwrite=False)
    with pytest.raises(CheckpointError, match="did not write"):
        folder.check(None, overwrite=True)
    assert (out / "notes.txt").exists()

    (out / RUN_MARKER).write_text(json.dumps({}))
    make_checkpoint(out, 3)
    (out / "visualdl").mkdir()
    (out / "visualdl" / "vdlrecords.1.log").write_text("old curves")
    assert folder.check(None, overwrite=True) is None
    folder.create(resume=None)
    assert sorted(os.listdir(out)) == [LOCK_NAME, RUN_MARKER]  # the lock survives the emptying, held
    folder.release()
    assert os.listdir(out) == [RUN_MARKER]


def test_create_removes_what_a_killed_save_left(tmp_path):
    out = tmp_path / "run"
    (out / ".tmp-checkpoint-9-abc").mkdir(parents=True)
    (out / RUN_MARKER).write_text("{}")
    good = make_checkpoint(out, 8)
    folder = RunFolder(str(out), Distributed())
    assert folder.check("latest", overwrite=False) == str(good)
    folder.create(resume=str(good))
    folder.release()
    assert sorted(os.listdir(out)) == ["checkpoint-8", RUN_MARKER]


def test_resuming_an_older_checkpoint_sets_newer_ones_aside_and_the_next_save_survives_rotation(tmp_path):
    """checkpoint-300 is damaged, latest resumes 100: the run's next save (200) must not be rotated away
    in favour of 300, and 300 must not come back as `latest`."""
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text("{}")
    make_checkpoint(out, 100)
    damaged = make_checkpoint(out, 300)
    (damaged / "optimizer.pdopt").write_bytes(b"x" * len((damaged / "optimizer.pdopt").read_bytes()))  # same size
    folder = RunFolder(str(out), Distributed(), save_total_limit=1)
    resume = folder.check("latest", overwrite=False)
    assert resume == str(out / "checkpoint-100")
    folder.create(resume=resume)
    assert (out / "checkpoint-300.abandoned").is_dir()

    temp = folder.begin_save(200)
    (tmp_path / "payload").write_bytes(b"new")
    shutil.copy(tmp_path / "payload", os.path.join(temp, "unet.safetensors"))
    saved = folder.seal(200, temp)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-200",
                                                                                 "checkpoint-300.abandoned"]
    assert latest_checkpoint(str(out)) == saved


def test_auto_resumes_when_it_can_and_starts_afresh_when_it_cannot(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text("{}")
    (out / "visualdl").mkdir()  # a requeued job preempted before its first checkpoint was renamed into place
    (out / ".tmp-checkpoint-5-x").mkdir()
    folder = RunFolder(str(out), Distributed())
    assert folder.check("auto", overwrite=False) is None
    folder.create(resume=None)
    folder.release()
    assert os.listdir(out) == [RUN_MARKER]
    good = make_checkpoint(out, 7)
    assert folder.check("auto", overwrite=False) == str(good)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="did not write"):
        RunFolder(str(tmp_path / "theirs"), Distributed()).check("auto", overwrite=False)


def test_checkpoints_of_runs_before_manifests_still_resume(tmp_path, caplog):
    legacy = make_checkpoint(tmp_path, 40, complete=False)
    (legacy / "training_state.pkl").write_bytes(b"state")
    make_checkpoint(tmp_path, 50, complete=False)  # interrupted: no training state
    with caplog.at_level(logging.WARNING, logger="ldm.train"):
        assert resolve_resume(str(tmp_path), "latest") == str(legacy)
    assert any("predates checkpoint manifests" in m for m in caplog.messages)
    (tmp_path / RUN_MARKER).write_text("{}")  # a run of this version: a manifest is required
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path), "latest")


@pytest.mark.parametrize("damage", ["appended", "no_manifest"])
def test_auto_never_deletes_a_run_whose_only_checkpoint_fails_verification(tmp_path, damage):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text("{}")
    only = make_checkpoint(out, 5)
    if damage == "appended":
        with open(only / "unet" / "model.safetensors", "ab") as f:
            f.write(b"x")
    else:
        (only / MANIFEST).unlink()  # what an interrupted upgrade of an earlier version left
    folder = RunFolder(str(out), Distributed())
    with pytest.raises(CheckpointError) as error:
        folder.check("auto", overwrite=False)
    message = str(error.value)
    assert str(only) in message and "nothing was deleted" in message and "--overwrite_output_dir" in message
    assert "\n" not in message
    assert (only / "unet" / "model.safetensors").is_file()
    assert folder.check("auto", overwrite=True) is None  # asked for explicitly: the folder is emptied


def test_latest_with_only_damaged_checkpoints_names_a_way_out_that_works(tmp_path):
    make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(CheckpointError) as error:
        resolve_resume(str(tmp_path), "latest")
    assert "nothing was deleted" in str(error.value) and "'auto'" not in str(error.value)  # auto refuses them too


HOLD = """
import sys, time
from ldm.checkpoint.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(folder):
    """Another process holding the folder's lock, as a live run does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_start_into_a_folder_in_use_is_refused_naming_the_holder_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({}))
    make_checkpoint(out, 3)
    holder = hold_lock(out)
    before = sorted(os.listdir(out))
    try:
        for resume, overwrite in ((None, False), (None, True), ("latest", False), ("auto", True)):
            with pytest.raises(CheckpointError, match=rf"in use by another run \(host {socket.gethostname()}, "
                                                      rf"pid {holder.pid}, since"):
                RunFolder(str(out), Distributed()).check(resume, overwrite)
        assert sorted(os.listdir(out)) == before  # --overwrite_output_dir emptied nothing
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_whose_process_is_gone_does_not_block_the_retry(tmp_path, caplog):
    out = tmp_path / "run"
    holder = hold_lock(out)
    holder.send_signal(signal.SIGKILL)  # a killed run: its lock file stays
    holder.wait()
    assert os.listdir(out) == [LOCK_NAME]
    folder = RunFolder(str(out), Distributed())
    with caplog.at_level(logging.WARNING, logger="ldm.train"):
        assert folder.check(None, overwrite=False) is None  # the lock file alone does not make the folder "not empty"
    assert "taking over the lock of a run that is gone (its process is not running" in caplog.text
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    folder.release()
    assert os.listdir(out) == []  # a start that wrote nothing else leaves nothing behind


@pytest.mark.parametrize("age, refused", [(5, True), (LEASE_SECONDS + 60, False)])
def test_a_lock_of_another_host_holds_while_its_lease_is_renewed(tmp_path, age, refused):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": "node-17", "pid": 4242, "since": "then",
                                             "renewed": time.time() - age}))
    folder = RunFolder(str(out), Distributed())
    if refused:
        with pytest.raises(CheckpointError, match="host node-17, pid 4242, since then, lease renewed"):
            folder.check(None, overwrite=False)
    else:
        assert folder.check(None, overwrite=False) is None
        folder.release()
        assert os.listdir(out) == []


def test_a_refused_check_gives_the_lock_back(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not empty"):
        RunFolder(str(out), Distributed()).check(None, overwrite=False)
    assert os.listdir(out) == ["notes.txt"]


def test_a_pipeline_named_for_a_resume_is_sent_to_init_from_checkpoint(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "model_index.json").write_text("{}")
    assert "--init_from_checkpoint" in checkpoint_problem(str(tmp_path / "pipeline"))
    with pytest.raises(CheckpointError, match="an exported pipeline, not a training checkpoint"):
        resolve_resume(str(tmp_path), str(tmp_path / "pipeline"))


def test_a_checkpoint_that_disappears_while_read_says_so(tmp_path, monkeypatch):
    from ldm.inference import load

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()

    def rotated_away(path, use_ema):
        shutil.rmtree(path)
        raise FileNotFoundError(2, "No such file or directory", os.path.join(path, "unet", "config.json"))

    monkeypatch.setattr(load, "_load_for_inference", rotated_away)
    with pytest.raises(FileNotFoundError, match="disappeared while being read"):
        load.load_for_inference(str(folder))
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="no such checkpoint or pipeline folder"):
        load.load_for_inference(str(folder))


RACE = """
import os, sys, time
from ldm.checkpoint.lock import FolderInUse, RunLock
folder, starters, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(trials):
    go_read, go_write = os.pipe()
    results_read, results_write = os.pipe()
    children = []
    for _ in range(starters):
        pid = os.fork()
        if pid == 0:  # a starter: waits for the start signal, then takes the (stale) lock
            os.close(go_write)
            os.read(go_read, 1)
            try:
                RunLock(folder).acquire()
                outcome = b"H"
            except FolderInUse:
                outcome = b"R"
            os.write(results_write, outcome)
            time.sleep(0.3)  # hold it while the others try; then die without releasing: the lock is stale again
            os._exit(0)
        children.append(pid)
    time.sleep(0.2)
    os.write(go_write, b"x" * starters)  # every starter at the same instant
    outcomes = b"".join(os.read(results_read, 1) for _ in range(starters))
    for pid in children:
        os.waitpid(pid, 0)
    print(outcomes.decode(), flush=True)
"""


def test_starters_taking_over_a_stale_lock_at_the_same_instant_leave_exactly_one_holder(tmp_path):
    out = tmp_path / "run"
    holder = hold_lock(out)
    holder.send_signal(signal.SIGKILL)  # a crashed run: a stale lock the next starters all take over
    holder.wait()
    done = subprocess.run([sys.executable, "-c", RACE, str(out), "4", "12"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    trials = done.stdout.split()
    assert len(trials) == 12
    assert all(trial.count("H") == 1 for trial in trials), trials  # exactly one winner, every time


def test_a_lock_that_is_a_folder_or_an_output_dir_that_cannot_be_written_is_one_line(tmp_path):
    out = tmp_path / "run"
    (out / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(CheckpointError, match=rf"{LOCK_NAME} is a folder, not a lock this project wrote: remove it"):
        RunFolder(str(out), Distributed()).check(None, overwrite=False)
    assert os.listdir(out) == [LOCK_NAME]
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"cannot be written \(Not a directory\): make it writable"):
        RunFolder(str(tmp_path / "a-file" / "run"), Distributed()).check(None, overwrite=False)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("root writes into a read-only folder")
        with pytest.raises(CheckpointError, match=r"cannot be written \(Permission denied\): make it writable"):
            RunFolder(str(read_only / "run"), Distributed()).check(None, overwrite=False)
        assert os.listdir(read_only) == []
    finally:
        read_only.chmod(0o755)


@pytest.mark.parametrize("lease, says", [("ahead", r"lease renewed \d+ s ahead of this host's clock"),
                                          ("nan", r"no usable lease time \(nan\)")])
def test_a_lock_of_another_host_with_a_lease_time_that_cannot_be_judged_says_how_to_remove_it(tmp_path, lease, says):
    renewed = time.time() + 1e12 if lease == "ahead" else float("nan")  # a clock set 31,000 years ahead
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": "node-17", "pid": 4242, "since": "then", "renewed": renewed}))
    with pytest.raises(CheckpointError, match=says) as error:
        RunFolder(str(out), Distributed()).check(None, overwrite=False)
    assert f"if no run on node-17 uses this folder any more, remove {out / LOCK_NAME}" in str(error.value)


def test_a_takeover_waits_a_bounded_time_for_a_lock_held_on_the_folder(tmp_path, monkeypatch):
    """Something else holding a flock on the output folder (a `flock out/ cmd` wrapper) delays a takeover of a stale
    lock by at most TAKEOVER_SECONDS, then it is one line; it never hangs the start."""
    import fcntl

    from ldm.checkpoint import lock

    out = tmp_path / "run"
    holder = hold_lock(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    monkeypatch.setattr(lock, "TAKEOVER_SECONDS", 0.3)
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="another start has been taking over its stale .run.lock"):
            RunFolder(str(out), Distributed()).check(None, overwrite=False)
        assert time.monotonic() - started < 5
    finally:
        os.close(fd)
    folder = RunFolder(str(out), Distributed())
    assert folder.check(None, overwrite=False) is None  # the folder's lock released: taken over
    folder.release()


def test_written_folders_keep_a_shared_folders_setgid_bit(tmp_path):
    from ldm.runtime.files import temporary_folder

    shared = tmp_path / "project"
    shared.mkdir()
    shared.chmod(0o2775)
    made = temporary_folder(str(shared), "x-")
    assert os.stat(made).st_mode & 0o7777 == 0o2755  # umask 022 (conftest), the group's setgid kept
