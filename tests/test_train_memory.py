"""A host that cannot hold a run's state and the asynchronous save's reservation is refused at the start in one line
(issue 58: such a run was killed by the kernel right after reserving), and how much memory a host has is read from the
kernel and the cgroup (`ldm.train.memory`)."""

from __future__ import annotations

import pytest

from ldm.checkpoint.manager import snapshot_bytes
from ldm.models.build import build_components
from ldm.models.diffusion import LatentDiffusion
from ldm.runtime.distributed import Distributed
from ldm.runtime.errors import UserError
from ldm.train.memory import (
    HostMemoryError,
    available_memory,
    check_host_memory,
    host_memory_problem,
    memory_by_rank,
    to_allocate,
)

GIB = 2**30


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def meminfo(tmp_path, available_kib: int):
    write(tmp_path / "proc" / "meminfo", f"MemTotal:       24000000 kB\nMemFree:  1000 kB\n"
                                         f"MemAvailable:   {available_kib} kB\nBuffers:  10 kB\n")
    return str(tmp_path / "proc")


def test_the_memory_available_is_the_lower_of_the_kernels_and_the_cgroups(tmp_path):
    proc = meminfo(tmp_path, 18 * 2**20)  # 18 GiB
    assert available_memory(proc, str(tmp_path / "no-cgroup")) == (18 * GIB, "MemAvailable")
    v2 = tmp_path / "v2"
    write(v2 / "memory.max", f"{8 * GIB}\n")
    write(v2 / "memory.current", f"{3 * GIB}\n")
    write(v2 / "memory.stat", f"anon {2 * GIB}\nfile {GIB}\ninactive_file {GIB}\n")  # cache it would reclaim first
    headroom, source = available_memory(proc, str(v2))
    assert headroom == 6 * GIB and source.startswith("cgroup memory.max 8.00 GiB")
    write(v2 / "memory.max", "max\n")  # no limit: the kernel's figure
    assert available_memory(proc, str(v2)) == (18 * GIB, "MemAvailable")
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", f"{4 * GIB}\n")
    write(v1 / "memory" / "memory.usage_in_bytes", f"{GIB}\n")
    write(v1 / "memory" / "memory.stat", "cache 0\ntotal_inactive_file 0\n")
    assert available_memory(proc, str(v1))[0] == 3 * GIB
    write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert available_memory(proc, str(v1)) == (18 * GIB, "MemAvailable")
    assert available_memory(str(tmp_path / "nowhere"), str(tmp_path / "nowhere")) is None


@pytest.fixture(scope="module")
def memory():
    """What each of 2 ranks of ldm-tiny with EMA holds (unsharded)."""
    parts = build_components("ldm-tiny", vocab_size=64, model_max_length=16)
    model = LatentDiffusion(parts.unet, parts.text_encoder, parts.vae, parts.noise_scheduler)
    return memory_by_rank(model, world_size=2, ema=True)


def ranks_of(memory, available: int, *, async_save: bool = True, on_host: bool = True):
    """Both ranks on one host that has `available` bytes, as `check_host_memory` gathers them."""
    return [("node-1", *to_allocate(memory, rank, reserve=snapshot_bytes(memory, rank, 2) if async_save else 0,
                                    on_host=on_host), (available, "MemAvailable")) for rank in range(2)]


def needs(memory, **kwargs) -> tuple[int, int]:
    ranks = ranks_of(memory, 0, **kwargs)
    return sum(r[1] for r in ranks), sum(r[2] for r in ranks)


def test_a_host_that_cannot_hold_the_state_and_the_reservation_is_refused_in_one_line(memory):
    reserved, state = needs(memory)
    assert reserved == sum(snapshot_bytes(memory, rank, 2) for rank in range(2)) > 0
    assert state == sum(memory["ranks"][rank]["gradients"] + memory["ranks"][rank]["optimizer"] for rank in range(2))
    assert host_memory_problem(ranks_of(memory, reserved + state), sharded=False) is None  # it fits: nothing said
    problem = host_memory_problem(ranks_of(memory, reserved + state - 1), sharded=False)
    assert problem.startswith("host node-1 cannot hold this run: its 2 ranks need at least ")
    assert "reserved for asynchronous checkpoint snapshots" in problem and "is available (MemAvailable)" in problem
    # without the reservation it would fit: --async_save false is the first way out
    assert "use --async_save false (a save then waits for its writing and reserves nothing), --sharding stage1" \
        in problem and problem.endswith("or fewer ranks per host") and "\n" not in problem
    # the state alone does not fit: both, or fewer ranks
    problem = host_memory_problem(ranks_of(memory, state - 1), sharded=False)
    assert "use --async_save false and --sharding stage1 (" in problem and "false (a save" not in problem
    # already sharded, saving synchronously: fewer ranks per host is what is left
    problem = host_memory_problem(ranks_of(memory, state - 1, async_save=False), sharded=True)
    assert "reserved" not in problem and problem.endswith("; use fewer ranks per host")


def test_state_on_a_gpu_asks_the_host_only_for_the_reservation(memory):
    reserved, state = needs(memory, on_host=False)
    assert state == 0 and host_memory_problem(ranks_of(memory, reserved, on_host=False), sharded=False) is None
    assert host_memory_problem(ranks_of(memory, reserved, on_host=False, async_save=False), sharded=False) is None


def test_ranks_on_other_hosts_do_not_count_and_a_host_that_cannot_tell_is_not_refused(memory):
    reserved, state = needs(memory)
    one, two = ranks_of(memory, (reserved + state) // 2 + 1)
    assert host_memory_problem([one, ("node-2", *two[1:])], sharded=False) is None
    assert host_memory_problem([(*one[:3], None), (*two[:3], None)], sharded=False) is None


def test_the_check_on_this_machine_passes_for_a_tiny_model_and_its_error_is_a_user_error(memory):
    check_host_memory({**memory, "ranks": memory["ranks"][:1]}, Distributed(), async_save=True, on_host=True)
    assert issubclass(HostMemoryError, UserError)  # one line and exit 2 at the entry points


def test_the_gradients_are_freed_once_the_updates_are_over():
    """The export at the end of a run loads a copy of the model: into the gradients' memory, not beside it (Paddle
    keeps them allocated, zeroed, between updates)."""
    import paddle

    from ldm.train.gradients import release_gradients

    layer = paddle.nn.Linear(64, 64)
    optimizer = paddle.optimizer.AdamW(parameters=layer.parameters())
    layer(paddle.ones([2, 64])).sum().backward()
    optimizer.step()
    optimizer.clear_grad()
    assert all(p.grad is not None for p in layer.parameters())
    release_gradients(layer.parameters())
    assert all(p.grad is None for p in layer.parameters())
