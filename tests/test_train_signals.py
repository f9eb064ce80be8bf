"""GracefulStop (`ldm/train/signals.py`) in real processes with real signals: repeats, a second signal, the
deadline, and a rank that learns of the stop from another rank before (or without) its own signal."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT
from entry import launch_report, run_python

# argv: deadline in seconds, then the pauses before each SIGTERM the process sends itself, then a last pause
ONE_PROCESS = """
import os, signal, sys, time, types
from ldm.train import signals
signals.STOP_GRACE_SECONDS = float(sys.argv[1])
*gaps, wait = [float(x) for x in sys.argv[2:]]
with signals.GracefulStop(types.SimpleNamespace(world_size=1)) as stop:
    for gap in gaps:
        time.sleep(gap)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(wait)
    print("requested", stop.requested(), flush=True)
sys.exit(stop.exit_code)
"""

TWO_RANKS = """
import os, signal, sys, time
import paddle.distributed as pdist
from ldm.runtime.distributed import Distributed
from ldm.train import signals
signals.STOP_GRACE_SECONDS = 4
pdist.init_parallel_env()
rank = pdist.get_rank()
with signals.GracefulStop(Distributed(rank, 2)) as stop:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    agreed = stop.requested()  # rank 1 learns of the stop here, before any signal of its own
    if rank == 1:
        time.sleep(2.5)  # its own first signal, later than a repeat: still part of the same stop
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    print(f"rank {rank} agreed {agreed}", flush=True)
    pdist.barrier()
sys.exit(stop.exit_code)
"""


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return run_python(["-c", script, *args], timeout=60)


def test_repeats_within_two_seconds_are_one_request():
    """The launcher passes SIGTERM on three times, 0.2 s apart: the process must still save and stop."""
    result = run(ONE_PROCESS, "600", "0", "0.2", "0.2", "0.1")
    assert "requested True" in result.stdout, result.stderr
    assert result.returncode == 128 + signal.SIGTERM


def test_a_second_signal_later_ends_the_process_at_once():
    result = run(ONE_PROCESS, "600", "0", "2.5", "5")
    assert "requested" not in result.stdout
    assert "SIGTERM again: exiting now, without a checkpoint" in result.stderr
    assert result.returncode == 128 + signal.SIGTERM


def test_a_process_that_does_not_stop_prints_its_stacks_and_exits_after_the_deadline():
    result = run(ONE_PROCESS, "1", "0", "6")
    assert "requested" not in result.stdout
    assert "not stopped 1.0 s after SIGTERM: stacks follow, then exit" in result.stderr
    assert "most recent call first" in result.stderr
    assert result.returncode == 128 + signal.SIGTERM


@pytest.mark.distributed
def test_a_rank_told_by_another_stops_with_it_and_counts_its_deadline_from_then(tmp_path):
    """Rank 0 is signalled; rank 1 learns it from the vote, then gets its own signal 2.5 s later (a scheduler
    signalling ranks one by one). Rank 1 must neither take that for a second signal nor expire at once."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    result = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                             "--log_dir", str(tmp_path / "launch_logs"), str(script)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = launch_report(result, tmp_path)
    for rank in (0, 1):
        log = (tmp_path / "launch_logs" / f"workerlog.{rank}").read_text()
        assert f"rank {rank} agreed True" in log, report
        assert "not stopped" not in log and "again" not in log, report
    assert result.returncode != 0, report  # both ranks exited 143: the launcher reports the run as stopped
