"""What each rank holds, in bytes, before activations: the trained weights and their gradients (on every rank), the
AdamW moments, the EMA and the post-hoc EMA's profiles (the owned share under sharding, else every weight's), and
the frozen parts.

Recorded in `run.json` as `memory: {"ranks": [{"weights", "gradients", "optimizer", "ema", "frozen"}, ...]}` (and
"ema_profiles" with --ema_sigma_rels) and the
largest rank's total logged at start, so that a layout can be sized before the cards are rented
(docs/hardware.md). The partition is the sharding optimizer's own when it exists (the loop), else the same rule
fleet uses (largest first to the least loaded rank; the Trainer path makes its optimizer after the record).
"""

from __future__ import annotations

import logging
import os
import socket

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.train")

ADAM_SCALARS = 2  # beta1_pow and beta2_pow: one element each, per parameter


def nbytes(tensor) -> int:
    return int(tensor.numel()) * tensor.element_size()


def fleet_partition(sizes: list[tuple[str, int]], degree: int) -> dict[str, int]:
    """{parameter name: sharding rank} as fleet's `DygraphShardingOptimizer._partition_parameters` deals them:
    sorted by size, largest first (a stable sort of the parameter order), each to the least loaded rank."""
    loads, owners = [0] * degree, {}
    for name, size in sorted(sizes, key=lambda item: -item[1]):
        rank = loads.index(min(loads))
        owners[name] = rank
        loads[rank] += size
    return owners


def memory_by_rank(model, *, world_size: int, sharding_degree: int = 1, stage: int = 1, ema: bool = False,
                   owners: dict[str, int] | None = None, ema_profiles: int = 0) -> dict:
    """The bytes every rank holds of `model`'s state (see the module's doc); `ema_profiles`: post-hoc EMA profiles,
    each an fp32 average of every trained weight, sharded as the EMA is. `owners`: the sharding optimizer's
    {parameter name: sharding rank}; global rank g is sharding rank g % degree (fleet's order puts the sharding
    axis inside data parallel). `stage` 2 shards the gradients too, 3 the weights as well."""
    trained = [p for p in model.parameters() if not p.stop_gradient]
    frozen = sum(nbytes(p) for p in model.parameters() if p.stop_gradient)
    degree = max(1, sharding_degree)
    partition = "optimizer" if owners is not None or degree == 1 else "rule"
    if degree > 1 and owners is None:
        owners = fleet_partition([(p.name, int(p.numel())) for p in trained], degree)
    every, ranks = sum(nbytes(p) for p in trained), []
    for rank in range(world_size):
        owned = [p for p in trained if degree == 1 or owners[p.name] == rank % degree]
        mine = sum(nbytes(p) for p in owned)
        ranks.append({
            "weights": mine if stage >= 3 else every,
            "gradients": mine if stage >= 2 else every,
            # moment1 and moment2 in the parameter's dtype, and the two bias-correction scalars (fp32)
            "optimizer": sum(2 * nbytes(p) + 4 * ADAM_SCALARS for p in owned),
            "ema": sum(4 * int(p.numel()) for p in owned) if ema else 0,  # fp32 averages
            **({"ema_profiles": ema_profiles * sum(4 * int(p.numel()) for p in owned)} if ema_profiles else {}),
            "frozen": frozen,
        })
    return {"ranks": ranks, "sharding_degree": degree, "stage": stage if degree > 1 else 0, "partition": partition}


def readable(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def log_largest(memory: dict) -> None:
    ranks = memory["ranks"]
    totals = [sum(rank.values()) for rank in ranks]
    worst = max(range(len(ranks)), key=totals.__getitem__)
    parts = ", ".join(f"{name} {readable(value)}" for name, value in ranks[worst].items())
    logger.info("memory before activations: %s on the largest rank (rank %d: %s)", readable(totals[worst]), worst,
                parts)


class HostMemoryError(UserError, MemoryError):
    """A host whose memory cannot hold what its ranks are about to allocate: refused at the start, before any work,
    rather than killed by the kernel at the first update or the first save."""


def _read_number(path: str) -> int | None:
    """A cgroup file's number; None when the file is absent or says there is no limit ("max", or v1's near 2**63)."""
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() and int(text) < 2**60 else None


def _inactive_file(path: str) -> int:
    """Page cache the kernel reclaims before it kills (`memory.stat`'s inactive_file), which a cgroup's usage counts."""
    try:
        with open(path) as f:
            fields = dict(line.split() for line in f if line.strip())
    except (OSError, ValueError):
        return 0
    return int(fields.get("total_inactive_file", fields.get("inactive_file", 0)))


def available_memory(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """How much more host memory this process can take, and from where that was read: the kernel's MemAvailable, or
    the headroom of its cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, less the usage and plus the page cache
    it reclaims) when that is lower. None when neither can be read (not Linux)."""
    found = []
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        found.append((meminfo["MemAvailable"], "MemAvailable"))
    except (OSError, KeyError, ValueError):
        pass
    for limit_file, usage_file, stat_file in (("memory.max", "memory.current", "memory.stat"),
                                              ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                               "memory/memory.stat")):
        limit = _read_number(os.path.join(cgroup, limit_file))
        usage = _read_number(os.path.join(cgroup, usage_file))
        if limit is not None and usage is not None:
            headroom = max(0, limit - usage + _inactive_file(os.path.join(cgroup, stat_file)))
            found.append((headroom, f"cgroup {limit_file.split('/')[-1]} {readable(limit)}, {readable(usage)} used"))
            break
    return min(found) if found else None


def to_allocate(memory: dict, rank: int, *, reserve: int, on_host: bool) -> tuple[int, int]:
    """(the checkpoint snapshot's reservation, the state still to be allocated) in host memory for `rank` at the
    start: gradients and AdamW moments come at the first update (or the resume), where the state is on the host;
    the weights, the EMA and the frozen parts are already there."""
    mine = memory["ranks"][rank]
    return reserve, (mine["gradients"] + mine["optimizer"]) if on_host else 0


def host_memory_problem(hosts: list[tuple[str, int, int, tuple[int, str] | None]], *, sharded: bool) -> str | None:
    """The first host whose ranks (`hosts`: every rank's host name, reservation, state still to come and the memory
    it saw available) need more than it has, said in one line with what to change; None when every host fits."""
    by_host: dict[str, list] = {}
    for host, reserve, state, available in hosts:
        by_host.setdefault(host, []).append((reserve, state, available))
    for host, ranks in by_host.items():
        seen = [available for _, _, available in ranks if available is not None]
        if not seen:
            continue
        available, source = min(seen)
        reserved, state = sum(r for r, _, _ in ranks), sum(s for _, s, _ in ranks)
        if reserved + state <= available:
            continue
        count = f"{len(ranks)} ranks need" if len(ranks) > 1 else "1 rank needs"
        need = " and ".join(part for part in (
            f"{readable(reserved)} reserved for asynchronous checkpoint snapshots" if reserved else "",
            f"{readable(state)} of gradients and optimizer state still to be allocated" if state else "") if part)
        stage1 = [] if sharded else ["--sharding stage1 (each rank keeps and writes only its share of the optimizer "
                                     "state and EMA)"]
        if reserved and state <= available:
            ways = ", ".join(["--async_save false (a save then waits for its writing and reserves nothing)", *stage1])
        elif reserved:
            ways = " and ".join(["--async_save false", *stage1])
        else:
            ways = ", ".join(stage1)
        return (f"host {host} cannot hold this run: its {count} at least {readable(reserved + state)} more host "
                f"memory ({need}) and {readable(available)} is available ({source}); use "
                + (f"{ways}, or " if ways else "") + "fewer ranks per host")
    return None


def check_host_memory(memory: dict, dist, *, async_save: bool, on_host: bool) -> None:
    """Refuse, on every rank, a run some host cannot hold (`host_memory_problem`): each rank's reservation for
    asynchronous saves (`ldm.checkpoint.manager.snapshot_bytes`) and state still to come, against the memory its
    host has. A collective."""
    from ldm.checkpoint.manager import snapshot_bytes

    reserve = snapshot_bytes(memory, dist.rank, dist.world_size) if async_save else 0
    mine = (socket.gethostname(), *to_allocate(memory, dist.rank, reserve=reserve, on_host=on_host),
            available_memory())
    problem = host_memory_problem(dist.gather(mine), sharded=memory.get("sharding_degree", 1) > 1)
    if problem:
        raise HostMemoryError(problem)
