"""What each rank holds, in bytes, before activations: the trained weights and their gradients (on every rank), the
AdamW moments and the EMA (the owned share under sharding, else every weight's), and the frozen parts.

Recorded in `run.json` as `memory: {"ranks": [{"weights", "gradients", "optimizer", "ema", "frozen"}, ...]}` and the
largest rank's total logged at start, so that a layout can be sized before the cards are rented
(docs/hardware.md). The partition is the sharding optimizer's own when it exists (the loop), else the same rule
fleet uses (largest first to the least loaded rank; the Trainer path makes its optimizer after the record).
"""

from __future__ import annotations

import logging

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
                   owners: dict[str, int] | None = None) -> dict:
    """The bytes every rank holds of `model`'s state (see the module's doc). `owners`: the sharding optimizer's
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
