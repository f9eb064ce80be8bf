"""Which records each (rank, worker) slot reads in a pass.

Every pass, the shards (each repeated by its weight: floor(w) times plus once more with
probability frac(w), drawn from the pass's seed) are shuffled with a generator seeded by
(seed, pass) — the same on every slot — and cut into units. Unit i goes to slot i mod S. With
fewer shards than slots, each shard is split into `parts` interleaved line sets (line n belongs
to part (n - 1) mod parts), so no slot is idle. Across all slots every record of a pass is read
exactly once (times its weight).

The list of a pass's shard copies depends on (seed, pass) only; the units are that list with each
copy cut into `parts`, fixed by the layout the pass started with. That canonical order is what
`ldm.data.resume` describes the rest of an interrupted pass against, whatever layout reads it next.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from ldm.data.filelist import Shard


@dataclass(frozen=True)
class Unit:
    shard: int  # index into the shard list
    part: int = 0
    parts: int = 1
    copy: int = 0  # repetition of a weighted shard within the pass
    after: int = 0  # lines up to this one were read before a resume (ldm.data.resume)

    def owns(self, line_number: int) -> bool:
        return (line_number - 1) % self.parts == self.part

    def split(self, sub: int, subs: int) -> Unit:
        """Part `sub` of `subs` of this unit's lines: part p of P becomes part p + P*sub of P*subs."""
        return replace(self, part=self.part + self.parts * sub, parts=self.parts * subs)


def pass_copies(shards: list[Shard], seed: int, pass_index: int) -> list[tuple[int, int]]:
    """(shard index, copy) of every shard copy a pass reads, in the pass's shuffled order."""
    rng = random.Random(f"{seed}/plan/{pass_index}")
    copies = []
    for index, shard in enumerate(shards):
        whole, frac = divmod(shard.weight, 1.0)
        repeats = int(whole) + (1 if frac and rng.random() < frac else 0)
        copies.extend((index, copy) for copy in range(repeats))
    rng.shuffle(copies)
    return copies


def pass_parts(num_copies: int, num_slots: int) -> int:
    """Into how many line sets each shard copy is cut so that `num_slots` slots all have a unit."""
    return max(1, math.ceil(num_slots / num_copies)) if num_copies else 1


def copies_units(copies: list[tuple[int, int]], parts: int, start: int = 0) -> list[Unit]:
    """The units of `copies` cut into `parts`, from unit `start` on."""
    return [Unit(index, unit % parts, parts, copy)
            for unit, (index, copy) in ((u, copies[u // parts]) for u in range(start, len(copies) * parts))]


def pass_units(shards: list[Shard], num_slots: int, seed: int, pass_index: int) -> list[Unit]:
    copies = pass_copies(shards, seed, pass_index)
    return copies_units(copies, pass_parts(len(copies), num_slots))


def slot_units(shards: list[Shard], slot: int, num_slots: int, seed: int, pass_index: int) -> list[Unit]:
    return pass_units(shards, num_slots, seed, pass_index)[slot::num_slots]
