"""Which records each (rank, worker) slot reads in a pass.

Every pass, the shards (each repeated by its weight: floor(w) times plus once more with
probability frac(w), drawn from the pass's seed) are shuffled with a generator seeded by
(seed, pass) — the same on every slot — and cut into units. Unit i goes to slot i mod S. With
fewer shards than slots, each shard is split into `parts` interleaved line sets (line n belongs
to part (n - 1) mod parts), so no slot is idle. Across all slots every record of a pass is read
exactly once (times its weight).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ldm.data.filelist import Shard


@dataclass(frozen=True)
class Unit:
    shard: int  # index into the shard list
    part: int = 0
    parts: int = 1
    copy: int = 0  # repetition of a weighted shard within the pass

    def owns(self, line_number: int) -> bool:
        return (line_number - 1) % self.parts == self.part


def pass_units(shards: list[Shard], num_slots: int, seed: int, pass_index: int) -> list[Unit]:
    rng = random.Random(f"{seed}/plan/{pass_index}")
    copies = []
    for index, shard in enumerate(shards):
        whole, frac = divmod(shard.weight, 1.0)
        repeats = int(whole) + (1 if frac and rng.random() < frac else 0)
        copies.extend((index, copy) for copy in range(repeats))
    rng.shuffle(copies)
    parts = max(1, math.ceil(num_slots / len(copies))) if copies else 1
    return [Unit(index, part, parts, copy) for index, copy in copies for part in range(parts)]


def slot_units(shards: list[Shard], slot: int, num_slots: int, seed: int, pass_index: int) -> list[Unit]:
    return pass_units(shards, num_slots, seed, pass_index)[slot::num_slots]
