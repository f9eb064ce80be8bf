"""`python -m ldm.launch`: Paddle's real launcher, run again when a rank dies, not when the run stops on purpose."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from corpus import write_corpus
from entry import rank_pid

from ldm.checkpoint.run_folder import latest_checkpoint
from ldm.launch import diagnosis
from ldm.launch.command import LaunchError, flag_value, parse, with_flag
from ldm.launch.ledger import RestartLedger
from ldm.runtime.heartbeat import read_try

# A stand-in for a training script, for what needs no model: it counts updates as a run does and fails as told.
FAILING = """
import os, sys, time
from ldm.runtime import heartbeat
from ldm.runtime.distributed import run_main
from ldm.runtime.errors import UserError
from ldm.train.errors import user_errors

def main():
    with open(os.path.join(sys.argv[sys.argv.index("--output_dir") + 1], "argv.txt"), "a") as f:
        f.write(" ".join(sys.argv[1:]) + "\\n")
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    heartbeat.started(0)
    for step in (1, 2):
        time.sleep(0.2)
        heartbeat.beat(step)
    if rank == int(os.environ["FAIL_RANK"]):
        with user_errors():
            if os.environ["FAIL_HOW"] == "user":
                raise UserError("--file_list names no shard")
            raise RuntimeError("the decoder crashed on shard 17")
    time.sleep(60)  # the other rank: ended by the launcher

run_main(main)
"""


def launch_failing(tmp_path, *own, rank: int, how: str):
    """FAILING under ldm.launch on 2 ranks: rank `rank` fails after update 2, by a crash or a user error."""
    (tmp_path / "fail.py").write_text(FAILING)
    (tmp_path / "out").mkdir()
    return launch(tmp_path, ["fail.py", "--output_dir", "out"], *own, env={"FAIL_RANK": str(rank), "FAIL_HOW": how})


def launch(tmp_path, script_args, *own, env=None, timeout=300):
    command = [sys.executable, "-m", "ldm.launch", *own, "--nproc_per_node", "2", "--log_dir",
               str(tmp_path / "logs"), *script_args]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_the_command_is_split_and_resumes_with_auto():
    args, launcher, script, script_args = parse(["--max_restarts", "2", "--nproc_per_node", "8", "--log_dir", "l",
                                                 "train.py", "--output_dir", "out", "--resume_from_checkpoint=latest"])
    assert (args.max_restarts, launcher, script) == (2, ["--nproc_per_node", "8", "--log_dir", "l"], "train.py")
    assert flag_value(script_args, "--resume_from_checkpoint") == "latest"
    again = with_flag(script_args, "--resume_from_checkpoint", "auto")
    assert again == ["--output_dir", "out", "--resume_from_checkpoint", "auto"]
    with pytest.raises(LaunchError, match="no training script"):
        parse(["--max_restarts", "1", "--nproc_per_node", "2"])
    with pytest.raises(LaunchError, match="needs --output_dir"):
        parse(["--max_restarts", "1", "train.py", "--seed", "1"])


def report(code, step, local, cause=None):
    return {"exit_code": code, "cause": cause, "step": step, "local_rank": local, "started": None, "beat_at": None}


def test_the_verdict_on_how_the_ranks_ended(tmp_path):
    """Which ends are restarted, which rank is named (the launcher's, mapped from its place in the node to the global
    rank), and the crash loop: the same update and the same cause."""
    def verdict(code, reports, signalled=False, several_nodes=False):
        return diagnosis.verdict(code, reports, signalled=signalled, several_nodes=several_nodes)[0]

    assert verdict(0, {}) == 0
    exit_code, why = diagnosis.verdict(1, {2: report(2, 5, 0, "UserError: no shard"), 3: report(None, 5, 1)},
                                       signalled=False, several_nodes=True)
    assert (exit_code, why) == (2, "rank 2 stopped the run on purpose (UserError: no shard): not restarted")
    assert verdict(143, {0: report(143, 5, 0), 1: report(130, 5, 1)}) == 143  # a stop they agreed on
    # on several nodes, a peer's failure on another node looks the same: restarted
    assert verdict(143, {0: report(143, 5, 0), 1: report(130, 5, 1)}, several_nodes=True) is None

    # node 1 of two: its ranks 2 and 3; the launcher names its second rank (local 1), killed at update 8
    reports = {2: report(1, 7, 0, "RuntimeError: Connection reset by peer"), 3: report(None, 7, 1)}
    failure = diagnosis.failure(247, {1: -9}, reports)
    assert failure == {"rank": 3, "exit_code": -9, "cause": "killed by SIGKILL", "update": 8}
    assert diagnosis.give_up(failure, None, 0, 3) == (None, 0)
    ledger = RestartLedger(str(tmp_path))
    ledger.add(failure)
    why, code = diagnosis.give_up(failure, ledger.previous(), len(ledger.restarts), 3)
    assert "failed twice at update 8 (rank 3: killed by SIGKILL)" in why and code == 4
    # another cause at the same update
    assert diagnosis.give_up({**failure, "cause": "exit 1"}, ledger.previous(), 1, 3) == (None, 0)
    why, code = diagnosis.give_up({**failure, "cause": "exit 1"}, ledger.previous(), 3, 3)
    assert why == "rank 3 failed at update 8 (exit 1) after 3 restart(s), the --max_restarts given" and code == 3

    # a hung rank: the launcher names rank 0, whose collective timed out waiting; rank 1 stopped answering (no
    # report, the older heartbeat): rank 1 is named
    lost = "lost its peers (TIMEOUT in a collective): another rank or its launcher stopped first; its log says why"
    hung = {0: {**report(1, 22, 0, lost), "beat_at": 110.0}, 1: {**report(None, 22, 1), "beat_at": 100.0}}
    failure = diagnosis.failure(1, {0: 1}, hung)
    assert (failure["rank"], failure["update"]) == (1, 23), failure
    assert failure["cause"] == "stopped answering after update 22: rank 0's collective waited for it and timed out"
    closed = {0: {**report(1, 22, 0, lost.replace("TIMEOUT", "closed by peer")), "beat_at": 110.0},
              1: {**report(None, 22, 1), "beat_at": 109.0}}
    assert diagnosis.failure(1, {0: 1}, closed)["cause"] == "ended without a report (killed, or its node lost)"
    # a launcher that was killed: its ranks stopped with it (143 each), which is a failure, not a stop
    stopped = {0: report(143, 5, 0), 1: report(143, 5, 1)}
    assert verdict(-9, stopped) is None
    assert diagnosis.failure(-9, {}, stopped)["cause"] == ("paddle.distributed.launch was killed by SIGKILL (its "
                                                           "ranks stopped with it)")
    # the checkpoint a restart resumed is the one its ranks report, not the newest folder that looks complete
    ledger.restarts[-1].update({"update": 21, "resumed_from": 20, "updates_lost": 0})
    said = ledger.resumed({0: {**report(None, 12, 0), "started": 10}, 1: {**report(None, 12, 1), "started": 10}},
                          None)
    assert (ledger.restarts[-1]["resumed_from"], ledger.restarts[-1]["updates_lost"]) == (10, 10)
    assert said == "restart 1 resumed from checkpoint-10, 10 update(s) done again"
    assert verdict(0, {}, signalled=True) == 0 and verdict(143, {}, signalled=True) == 143  # a stop asked for


def test_a_lost_peer_is_judged_by_what_its_peers_saw_of_it_not_by_gloos_words():
    """Rank 0 lost rank 1 in a collective: rank 1 already ended (a signal's exit code, if Linux still held it) is a
    death, whatever gloo called it; alive, it stopped answering. The update is rank 1's own heartbeat + 1."""
    for words in ("TIMEOUT", "closed by peer"):
        lost = f"lost its peers ({words} in a collective): another rank or its launcher stopped first; its log says why"
        for seen, cause, code in (({"alive": False, "exit_code": -9}, "killed by SIGKILL", -9),
                                  ({"alive": False, "exit_code": None}, "ended without a report (killed, or its node "
                                                                        "lost)", None),
                                  ({"alive": True, "exit_code": None}, "stopped answering after update 6: rank 0's "
                                   f"collective {'waited for it and timed out' if words == 'TIMEOUT' else 'lost it'}",
                                   None)):
            reports = {0: {**report(1, 7, 0, lost), "peers": {"1": seen}}, 1: report(None, 6, 1)}
            # Paddle's launcher saw rank 0 fail first
            assert diagnosis.failure(1, {0: 1}, reports) == {"rank": 1, "exit_code": code, "cause": cause, "update": 7}


def test_logs_inside_the_run_folder_are_refused(tmp_path):
    with pytest.raises(LaunchError, match="inside --output_dir"):
        parse(["--log_dir", str(tmp_path / "run" / "logs"), "t.py", "--output_dir", str(tmp_path / "run")])
    args, launcher, _, _ = parse(["--max_restart", "2", "t.py", "--output_dir", "x"])
    assert args.max_restarts == 3 and launcher == ["--max_restart", "2"]  # Paddle's own flag passes through


@pytest.mark.distributed
def test_a_crash_at_the_same_update_stops_after_the_second_try_in_one_line(tmp_path):
    result = launch_failing(tmp_path, "--max_restarts", "5", "--restart_pause", "0.2", rank=1, how="crash")
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == ("error: ldm.launch: the run failed twice at update 3 (rank 1: RuntimeError: the decoder crashed "
                    "on shard 17): not restarted again (a crash loop: the same failure would repeat)"), last
    assert "restart 1 of 5 in 0.2 s, from the newest complete checkpoint" in result.stderr
    assert "restart 1 resumed from the start" in result.stderr  # as the restarted ranks reported it
    assert result.returncode == 4  # a crash loop (python -m ldm.launch --help)
    tries = (tmp_path / "out" / "argv.txt").read_text().splitlines()
    assert len(tries) == 4  # two ranks, two tries: the second resumes whatever the first saved
    assert all("--resume_from_checkpoint auto" in line for line in tries[2:])
    assert "--resume_from_checkpoint" not in tries[0]
    assert read_try(str(tmp_path / "logs" / "ldm-launch" / "try-1"))[1]["exit_code"] == 1


@pytest.mark.distributed
def test_a_user_error_is_not_restarted(tmp_path):
    result = launch_failing(tmp_path, "--max_restarts", "3", "--restart_pause", "0", rank=0, how="user")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "rank 0 stopped the run on purpose (UserError: --file_list names no shard): not restarted" in result.stderr
    assert len((tmp_path / "out" / "argv.txt").read_text().splitlines()) == 2  # one try
    assert not (tmp_path / "logs" / "ldm-launch" / "try-1").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)  # two tries of real interpreters
def test_a_run_whose_rank_is_killed_heals_itself_and_reads_every_record_once(tmp_path, vocab_dir):
    """A killed rank's run restarts from its last checkpoint and reads each record once over both tries (restarts
    after restarts, and the crash loop: test_a_killed_rank_is_recorded_as_killed_whatever_its_peer_saw_first)."""
    listing = write_corpus(str(tmp_path / "corpus"), num_records=48, records_per_shard=8)
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = [str(ROOT / "train_txt2img_laion400m_no_trainer.py"), "--pretrained_model_name_or_path", "ldm-tiny",
            "--allow_untrained_vae", "--file_list", listing, "--tokenizer_name", vocab_dir, "--model_max_length", "16",
            "--resolution", "32", "--train_batch_size", "4", "--max_train_steps", "9", "--save_steps", "2",
            "--logging_steps", "1", "--num_workers", "0", "--output_dir", str(out), "--report_to", "none"]
    command = [sys.executable, "-m", "ldm.launch", "--max_restarts", "2", "--restart_pause", "0.5",
               "--nproc_per_node", "2", "--log_dir", str(logs), *args]
    ledger = str(tmp_path / "ledger-{restarts}.log")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LDM_DATA_CONSUMED_LOG": ledger}
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []
    try:
        for attempt, at in ((0, 3),):  # SIGKILL rank 1 once it finished update `at`
            status = str(logs / "ldm-launch" / f"try-{attempt}")
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and job.poll() is None:
                step = read_try(status).get(1, {}).get("step")
                pid = rank_pid(status, 1) if step is not None and step >= at else None  # a look at every process
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)  # no further update on any rank: the one it failed in is known
                    time.sleep(0.5)
                    killed.append((attempt, read_try(status)[1]["step"]))
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.05)
        output, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0 and len(killed) == 1, output[-4000:]

    run = json.loads((out / "run.json").read_text())
    restarts = run["restarts"]
    assert [r["restart"] for r in restarts] == [1] and {r["rank"] for r in restarts} == {1}, restarts
    # as Paddle's launcher saw it die, or, when rank 0 (whose collective with it failed) is named first, as rank 0
    # saw it then: ended, by SIGKILL (stopped, then killed: gloo may call it a timeout or a closed connection)
    assert all((r["cause"], r["exit_code"]) == ("killed by SIGKILL", -9) for r in restarts), restarts
    assert [r["update"] for r in restarts] == [step + 1 for _, step in killed]
    for r in restarts:
        assert r["resumed_from"] <= r["update"] - 1 and r["updates_lost"] == r["update"] - 1 - r["resumed_from"]
        # Paddle's launcher names the killed rank and stops the other at once (the run is back within two minutes,
        # on a loaded machine too)
        assert 0 < r["seconds_to_next_update"] < min(r["seconds_lost"], 120)
    assert len(run["resumes"]) == 1
    assert latest_checkpoint(str(out)).endswith("checkpoint-9")
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(line.get("train/restarts", 0) for line in logged) == 1

    # every record once: each try's ledger cut where the next try resumed
    kept = []
    starts = [0] + [r["resumed_from"] for r in restarts]
    for attempt, start in enumerate(starts):
        kept = [entry for entry in kept if entry[0] <= start]
        with open(ledger.replace("{restarts}", str(attempt))) as f:
            for row in f:
                pass_index, _, shard, line, _, _, batch = row.split()
                kept.append((start + int(batch) + 1, pass_index, shard, int(line)))
    records = [(pass_index, shard, line) for _, pass_index, shard, line in kept]
    assert len(records) == 9 * 2 * 4 and len(set(records)) == len(records)


# A stand-in that stops as a run does, slowly: on SIGTERM (its launcher gone) it "saves" the update it is in, taking
# STOP_SECONDS, while rank 0 holds the run folder's real lock; a restarted try reports the update it resumed.
SLOW_STOP = """
import os, signal, sys, time
from ldm.checkpoint.lock import RunLock
from ldm.runtime import heartbeat
from ldm.runtime.distributed import run_main
from ldm.train.errors import user_errors

def main():
    out = sys.argv[sys.argv.index("--output_dir") + 1]
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with user_errors():
        lock = RunLock(out)
        if rank == 0:
            lock.acquire()
    saved = os.path.join(out, "saved")
    step = int(open(saved).read()) if os.path.exists(saved) else 0
    heartbeat.started(step)
    last = int(os.environ["LAST_STEP"]) if os.environ.get("LDM_LAUNCH_RESTARTS") != "0" else 10**6
    while step < last and not stop:
        time.sleep(0.1)
        step += 1
        heartbeat.beat(step)
    if stop:
        time.sleep(float(os.environ["STOP_SECONDS"]))
        if rank == 0:
            open(saved, "w").write(str(step))
        with open(os.path.join(out, "ended.txt"), "a") as f:
            f.write(f"{rank} {time.time()}\\n")
        lock.release()
        return 143
    with open(os.path.join(out, "started.txt"), "a") as f:
        f.write(f"{rank} {os.environ['LDM_LAUNCH_RESTARTS']} {step}\\n")
    lock.release()
    return 0

run_main(main)
"""


def paddle_launcher_pid(job_pid: int) -> int | None:
    from ldm.launch.processes import children

    found = children(job_pid)
    return found[0] if found else None


@pytest.mark.distributed
def test_a_restart_waits_for_every_rank_of_the_killed_launcher_and_records_what_they_did(tmp_path):
    """SIGKILL of Paddle's launcher: its ranks outlive it and stop slowly (saving while rank 0 holds the run lock).
    The restart waits for them, so it neither meets their lock nor records a checkpoint they had not yet saved."""
    (tmp_path / "slow.py").write_text(SLOW_STOP)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    command = [sys.executable, "-m", "ldm.launch", "--max_restarts", "2", "--restart_pause", "0",
               "--nproc_per_node", "2", "--log_dir", str(logs), "slow.py", "--output_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STOP_SECONDS": "4", "LAST_STEP": "3"}
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            reports = read_try(str(logs / "ldm-launch" / "try-0"))
            if len(reports) == 2 and min(r["step"] or 0 for r in reports.values()) >= 5:
                break
            time.sleep(0.1)
        os.kill(paddle_launcher_pid(job.pid), signal.SIGKILL)
        output, _ = job.communicate(timeout=180)
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]
    assert "waiting for 2 process(es) of try 0 to end" in output, output[-4000:]
    saved = int((out / "saved").read_text())
    ended = [float(line.split()[1]) for line in (out / "ended.txt").read_text().splitlines()]
    assert len(ended) == 2
    started = (out / "started.txt").read_text().splitlines()
    assert sorted(line.split()[:2] for line in started) == [["0", "1"], ["1", "1"]]  # restart 1, no lock refused
    assert f"restart 1 resumed from checkpoint-{saved}" in output, output[-4000:]
    assert "paddle.distributed.launch was killed by SIGKILL" in output
    # every rank of the first try ended before the second try began (its reports' folder was made after)
    assert max(ended) <= os.path.getmtime(logs / "ldm-launch" / "try-1" / "rank-0.start")


@pytest.mark.distributed
def test_a_second_job_given_the_same_log_dir_is_refused_before_it_touches_the_first_ones_files(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_STOP)
    out, other, logs = tmp_path / "out", tmp_path / "other", tmp_path / "logs"
    out.mkdir()
    other.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STOP_SECONDS": "0", "LAST_STEP": "2"}

    def command(folder):
        return [sys.executable, "-m", "ldm.launch", "--max_restarts", "1", "--restart_pause", "0",
                "--nproc_per_node", "2", "--log_dir", str(logs), "slow.py", "--output_dir", str(folder)]

    job = subprocess.Popen(command(out), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        status = logs / "ldm-launch" / "try-0"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(read_try(str(status))) < 2:
            time.sleep(0.1)
        before = {name: (status / name).stat().st_mtime_ns for name in os.listdir(status)}
        workerlog = (logs / "workerlog.0").stat().st_size
        second = subprocess.run(command(other), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: --log_dir {logs} is in use by another job (pid {job.pid} on {os.uname().nodename}): give each "
            "job a --log_dir of its own (the SLURM script names it after the job and its requeue)"], second.stderr
        assert set(os.listdir(status)) == set(before) and (logs / "workerlog.0").stat().st_size >= workerlog
        # the first job still heals: its rank 1 killed, it restarts and ends
        os.kill(rank_pid(str(status), 1), signal.SIGKILL)
        output, _ = job.communicate(timeout=180)
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]
    assert "rank 1 failed at" in output and "killed by SIGKILL" in output, output[-4000:]


def test_a_command_that_cannot_run_is_refused_at_once_in_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "logs").symlink_to(tmp_path / "run")
    (tmp_path / "t.py").write_text("")
    for argv, message in ((["missing.py", "--output_dir", "o"], "missing.py: no such training script"),
                          (["--restart_pause", "nan", "t.py", "--output_dir", "o"], "must be finite numbers >= 0"),
                          (["--log_dir", str(tmp_path / "logs" / "x"), "t.py", "--output_dir", str(tmp_path / "run")],
                           "inside --output_dir")):
        result = subprocess.run([sys.executable, "-m", "ldm.launch", *argv], cwd=tmp_path, capture_output=True,
                                text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert message in result.stderr and not (tmp_path / "log").exists()
    result = subprocess.run([sys.executable, "-m", "ldm.launch", "--help"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "--max_restarts" in result.stdout and "Exit codes" in result.stdout


@pytest.mark.distributed
def test_a_stop_during_the_restart_pause_says_the_restart_was_cancelled_and_spent_restarts_exit_3(tmp_path):
    (tmp_path / "fail.py").write_text(FAILING)
    (tmp_path / "out").mkdir()
    command = [sys.executable, "-m", "ldm.launch", "--max_restarts", "1", "--restart_pause", "60",
               "--nproc_per_node", "2", "--log_dir", str(tmp_path / "logs"), "fail.py", "--output_dir", "out"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAIL_RANK": "1", "FAIL_HOW": "crash"}
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in job.stderr:
            lines.append(line)
            if "restart 1 of 1 in 60 s" in line:
                job.send_signal(signal.SIGTERM)
                break
        _, rest = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 143
    assert "ldm.launch: restart 1 cancelled by SIGTERM" in "".join(lines) + rest
    # restarts spent: exit 3, documented (a crash at another update each time is not a crash loop)
    spent = tmp_path / "spent"
    spent.mkdir()
    result = launch_failing(spent, "--max_restarts", "0", rank=1, how="crash")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "after 0 restart(s), the --max_restarts given" in result.stderr


# A stand-in of real collectives: gloo's all_reduce at every update, as a run's gradients are.
COLLECTIVES = """
import os, time
import paddle
import paddle.distributed as dist
from ldm.runtime import heartbeat
from ldm.runtime.distributed import run_main

def main():
    dist.init_parallel_env()
    heartbeat.started(0)
    x = paddle.ones([4])
    for step in range(1, (10**6 if os.environ["LDM_LAUNCH_RESTARTS"] == "0" else 3) + 1):
        dist.all_reduce(x)
        time.sleep(0.05)
        heartbeat.beat(step)
    return 0

run_main(main)
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)  # gloo times out after 30 s, then a second try
def test_a_hung_rank_is_named_not_the_peer_whose_collective_timed_out_waiting_for_it(tmp_path):
    """SIGSTOP rank 1: rank 0's gloo collective times out (about 30 s, gloo's default), says in one line that it lost
    its peers, and the restart's record names rank 1."""
    (tmp_path / "coll.py").write_text(COLLECTIVES)
    (tmp_path / "out").mkdir()
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "ldm.launch", "--max_restarts", "1", "--restart_pause", "0", "--stop_grace", "60",
               "--nproc_per_node", "2", "--log_dir", str(logs), "coll.py", "--output_dir", "out"]
    job = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    status = str(logs / "ldm-launch" / "try-0")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and job.poll() is None:
            if min((r["step"] or 0 for r in read_try(status).values()), default=0) >= 3:
                break
            time.sleep(0.1)
        os.kill(rank_pid(status, 1), signal.SIGSTOP)
        _, err = job.communicate(timeout=240)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    said = [line for line in err.splitlines() if "restart 1 of 1" in line]
    assert len(said) == 1 and said[0].startswith("ldm.launch: rank 1 failed at update "), err[-3000:]
    assert "stopped answering after update" in said[0] and "rank 0's collective waited for it" in said[0]
    first = read_try(status)
    assert first[0]["exit_code"] == 1 and first[0]["cause"].startswith("lost its peers (")
    assert first[1]["exit_code"] is None


# Gloo's all_reduce at every update; at one update per try (MOMENTS, by the try's number) the ranks named by the
# moment sit before their collective, so that rank 1's kill finds each rank where the moment says: "waiting" (rank 0
# in the collective, rank 1 before it: rank 0 sees the connection close at once), "computing" (both before it),
# "alone" (rank 1 in the collective, rank 0 before it: rank 0 sees nothing until its launcher stops it).
KILLED = """
import json, os, sys, time
import paddle
import paddle.distributed as dist
from ldm.runtime import heartbeat
from ldm.runtime.distributed import run_main

def main():
    dist.init_parallel_env()
    out = sys.argv[sys.argv.index("--output_dir") + 1]
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(out, "run.json")):
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump({"created": "stand-in"}, f)
    heartbeat.started(0)
    moment, at = os.environ["MOMENTS"].split(",")[int(os.environ["LDM_LAUNCH_RESTARTS"])].split(":")
    before = {"waiting": {1}, "computing": {0, 1}, "alone": {0}}[moment]
    x = paddle.ones([4])
    for step in range(1, int(at) + 1):
        if step == int(at) and dist.get_rank() in before:
            time.sleep(600)  # ended by the kill, or by its launcher
        dist.all_reduce(x)
        heartbeat.beat(step)
    return 0

run_main(main)
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)  # three tries of two real ranks
def test_a_killed_rank_is_recorded_as_killed_whatever_its_peer_saw_first(tmp_path):
    """SIGKILL of rank 1 at several moments of a real gloo run: whichever rank Paddle's launcher sees fail first, and
    whether gloo says the connection closed or timed out, the restart names rank 1, killed by SIGKILL, at the
    update it was in (its own heartbeat + 1); the same kill at the same update twice is a crash loop."""
    (tmp_path / "killed.py").write_text(KILLED)
    (tmp_path / "out").mkdir()
    logs = tmp_path / "logs"
    moments = [("computing", 4), ("alone", 5), ("waiting", 5)]
    command = [sys.executable, "-m", "ldm.launch", "--max_restarts", "5", "--restart_pause", "0", "--stop_grace", "60",
               "--nproc_per_node", "2", "--log_dir", str(logs), "killed.py", "--output_dir", "out"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOMENTS": ",".join(f"{m}:{at}" for m, at in moments)}
    job = subprocess.Popen(command, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    killed = []
    try:
        for attempt, (_, at) in enumerate(moments):
            status = str(logs / "ldm-launch" / f"try-{attempt}")
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and job.poll() is None:
                reports = read_try(status)
                if len(reports) == 2 and all(r["step"] == at - 1 for r in reports.values()):
                    time.sleep(0.5)  # each rank where the moment puts it: in its collective, or before it
                    os.kill(rank_pid(status, 1), signal.SIGKILL)
                    killed.append(attempt)
                    break
                time.sleep(0.05)
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert killed == [0, 1, 2], err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == ("error: ldm.launch: the run failed twice at update 5 (rank 1: killed by SIGKILL): not restarted "
                    "again (a crash loop: the same failure would repeat)"), err[-3000:]
    assert job.returncode == 4
    restarts = json.loads((tmp_path / "out" / "run.json").read_text())["restarts"]
    assert [(r["rank"], r["exit_code"], r["cause"], r["update"]) for r in restarts] == [
        (1, -9, "killed by SIGKILL", at) for _, at in moments[:2]], restarts
    assert [r["updates_lost"] for r in restarts] == [at - 1 for _, at in moments[:2]]


# Rank 1 a heartbeat ahead of rank 0 when rank 0 dies by a signal, as a rank that passed the update's vote while
# its peer faulted in the optimizer step after it (no collective follows the vote).
SEGFAULT = """
import os, signal, sys, time
from ldm.runtime import heartbeat
from ldm.runtime.distributed import run_main

def main():
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    heartbeat.started(0)
    for step in range(1, 5 + (rank == 1)):
        heartbeat.beat(step)
    if rank == 1:
        time.sleep(120)  # ended by the launcher
    status = os.environ["LDM_LAUNCH_STATUS"]
    while heartbeat.read_try(status).get(1, {}).get("step") != 5:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGSEGV)

run_main(main)
"""


@pytest.mark.distributed
def test_the_failed_update_is_the_failed_ranks_own(tmp_path):
    """Rank 0 dies in update 5 (its heartbeat 4) while rank 1 finished update 5: update 5 is named, not 6, and the
    updates done again are counted from it."""
    (tmp_path / "segv.py").write_text(SEGFAULT)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text(json.dumps({"created": "stand-in"}))
    result = launch(tmp_path, ["segv.py", "--output_dir", "out"], "--max_restarts", "2", "--restart_pause", "0")
    assert result.returncode == 4, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: ldm.launch: the run failed twice at update 5 (rank 0: killed by SIGSEGV): not restarted again (a "
        "crash loop: the same failure would repeat)"), result.stderr[-3000:]
    restart, = json.loads((tmp_path / "out" / "run.json").read_text())["restarts"]
    assert (restart["rank"], restart["exit_code"], restart["update"], restart["updates_lost"]) == (0, -11, 5, 4)
