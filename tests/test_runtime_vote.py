"""The update's vote (`ldm.runtime.vote`): every rank gets each ballot's largest value under its name, device and host
ballots alike, from one collective; one process reads its device ballots at once."""

import json

import paddle
import pytest
from entry import launch_ranks

from ldm.runtime.vote import UpdateVote

# each rank casts ballots that differ by rank: device tensors (what the guard casts) and host numbers (the stop's,
# the checkpoint manager's), in the order the run casts them
RANKS = """
import json, sys
import paddle
import paddle.distributed as dist
from ldm.runtime.vote import UpdateVote

dist.init_parallel_env()
rank = dist.get_rank()
ballots = {"nonfinite": paddle.to_tensor([float(rank == 1)]), "negated_clip_factor": paddle.to_tensor([-0.5 - rank]),
           "signalled": float(rank == 0), "writer_busy": 0.0, "write_failed": float(rank + 1 if rank == 1 else 0)}
votes = UpdateVote(dist.get_world_size()).cast(ballots)
print("VOTES", rank, json.dumps(votes), flush=True)
"""


@pytest.mark.distributed
def test_two_ranks_agree_on_every_ballots_largest_value(tmp_path):
    result = launch_ranks(["-c", RANKS], tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    seen = {}
    for rank in range(2):
        log = (tmp_path / "launch_logs" / f"workerlog.{rank}").read_text()
        line = next(line for line in log.splitlines() if line.startswith("VOTES"))
        _, got_rank, votes = line.split(" ", 2)
        seen[int(got_rank)] = json.loads(votes)
    assert seen[0] == seen[1] == {"nonfinite": 1.0, "negated_clip_factor": -0.5, "signalled": 1.0,
                                  "writer_busy": 0.0, "write_failed": 2.0}


def test_one_process_reads_its_device_ballots_and_keeps_its_host_ones():
    votes = UpdateVote(1).cast({"nonfinite": paddle.to_tensor([0.0]), "clip": paddle.to_tensor(-0.25),
                                "signalled": True, "busy": 0.0})
    assert votes == {"nonfinite": 0.0, "clip": -0.25, "signalled": 1.0, "busy": 0.0}
    assert all(isinstance(value, float) for value in votes.values())
    assert UpdateVote(1).cast({"signalled": False}) == {"signalled": 0.0}  # no device ballot: nothing read
