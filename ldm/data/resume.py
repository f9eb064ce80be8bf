"""Elastic exact resume: the rest of an interrupted pass, read by any (ranks x workers) layout.

What a pass reads is fixed before any slot reads it: the pass's shard copies in their shuffled
order (`plan.pass_copies`, a function of seed and pass only), each cut into `parts` interleaved
line sets (`parts` from the number of slots the pass *started* with). That is the pass's
**canonical unit list**; a layout of S slots only decides who reads what (item i -> slot i mod S).
MosaicML Streaming makes the same separation: the epoch's sample order is fixed by the seed and
the number of "canonical nodes" (not the physical ones), and physical nodes, ranks and workers
only partition it, which is why its mid-epoch resume survives a change of layout. What fits here
is that separation (and keeping `parts` fixed for the pass, as Streaming keeps its canonical node
count). Its mechanics do not: Streaming's order is over sample IDs, read by random access (shard
index files), and its position is one global sample counter because its partition hands every
rank the same number of samples per step in a fixed interleaving. Our shards are streams of lines
(gzip text; tar/parquet) read front to back, slots read units of different sizes at their own
pace and shuffle locally, so the position is per slot, the unit of order a shard copy's line set.

**The remainder of a pass** (`Segment`) is described in those canonical terms, not by records:

  pass, parts      which canonical unit list (pass_copies(seed, pass) cut into parts)
  frontier f       canonical units f, f+1, ... are unread (none of their lines consumed)
  extras           what else is unread, read before the canonical units:
                     units: [shard, copy, part, parts, after] = that line set, lines > after
                            (a unit cut short, or a canonical unit below f a slot never reached)
                     picked: explicit (shard, copy, line) records, stored as runs of one shard
                            copy (what sat in shuffle buffers, in partly filled aspect-ratio
                            buckets, or was prefetched: consumed means "in a batch the trainer
                            took", so everything else at the last consumed batch of a slot is
                            unread)
  resumes          how many layout changes produced it (its shuffle draws' seed namespace)

A fresh pass is the segment (pass, parts from S, frontier 0, no extras). A segment read by S slots
is the list extras + canonical[f:] (cut into interleaved sub-parts when it has fewer items than
slots: part p of P cut in Q gives parts p + P*q of P*Q, picked lists records[q::Q]); item i goes to
slot i mod S, exactly as a fresh pass. A slot's saved state (last consumed batch: item index,
last line, buffer pointers) therefore says precisely which items of the segment it consumed.

`remainder` turns the saved states of every slot of the old layout into the list of segments
still to read (the **plan**): for each phase (segment) between the furthest-behind and the
furthest-ahead slot, the items below the highest position any slot reached that are not fully
consumed become extras (the partly read ones with their `after` cursor), the buffered records
become picked lists, and the new frontier is that highest position. The plan depends only on
what was consumed, never on the next layout, and the next layout reads the plan as its first
phases, then fresh passes from the one after the last. Because the plan is made of segments and
segments are what a slot reads, a resume of a resumed run composes: 2x2 -> 1x3 -> 2x1 -> ...

Cost: nothing is read to find a position. The plan holds O(S x spread) units (slots a few units
apart; degenerate cases where slots are whole passes apart hold more) and at most S x buffer
picked records, independent of the number of shards and records; resuming recomputes the pass's
copy order (one shuffle of the shard list, as every pass start does) and re-reads only the lines
of the picked records (as a same-layout resume re-reads its buffer). Measured figures:
scripts/bench_resume.py and docs/elastic-resume.md.

Augmentations and caption dropout are seeded by the record (seed, pass, shard name, line, copy),
so a record reads the same under any layout; shuffle draws of a resumed segment use the namespace
`seed/shuffle/pass/resumeN/slot/draw`, a fresh pass the unchanged `seed/shuffle/pass/slot/draw`:
a same-layout resume stays bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ldm.data.filelist import Shard
from ldm.data.plan import Unit, copies_units, pass_copies, pass_parts


@dataclass(frozen=True)
class Picked:
    """Explicit records, read in this order: (shard index, copy, line number) each."""

    records: tuple[tuple[int, int, int], ...]

    def split(self, sub: int, subs: int) -> Picked:
        return Picked(self.records[sub::subs])


Item = Unit | Picked


def item_after(item: Item, position: int) -> Item | None:
    """What is left of `item` after a slot read it up to `position` (a line, or a count of picked records);
    None when nothing is."""
    if isinstance(item, Picked):
        rest = item.records[position:]
        return Picked(rest) if rest else None
    return Unit(item.shard, item.part, item.parts, item.copy, max(item.after, position))


def item_record(item: Item, key: int) -> tuple[int, int, int]:
    """(shard, copy, line) of the record a slot's buffer points at as (item, key)."""
    if isinstance(item, Picked):
        return item.records[key - 1]
    return item.shard, item.copy, key


def _item_json(item: Item) -> Any:
    if isinstance(item, Picked):  # runs of records of one shard copy: [shard, copy, line, line, ...]
        runs: list[list[int]] = []
        for shard, copy, line in item.records:
            if runs and runs[-1][:2] == [shard, copy]:
                runs[-1].append(line)
            else:
                runs.append([shard, copy, line])
        return {"runs": runs}
    return [item.shard, item.copy, item.part, item.parts, item.after]


def _item_from_json(data: Any) -> Item:
    if isinstance(data, dict):
        return Picked(tuple((run[0], run[1], line) for run in data["runs"] for line in run[2:]))
    shard, copy, part, parts, after = data
    return Unit(shard, part, parts, copy, after)


@dataclass
class Segment:
    """What a phase of a slot stream reads: a whole pass, or the rest of one (see the module docstring)."""

    pass_index: int
    parts: int | None = None  # None: a fresh pass, cut for the slots that read it
    frontier: int = 0
    extras: list[Item] = field(default_factory=list)
    resumes: int = 0

    @property
    def fresh(self) -> bool:
        return self.resumes == 0

    def shuffle_key(self, seed: int) -> str:
        key = f"{seed}/shuffle/{self.pass_index}"
        return key if self.fresh else f"{key}/resume{self.resumes}"

    def layout(self, shards: list[Shard], seed: int, num_slots: int) -> tuple[list[tuple[int, int]], int]:
        """(the pass's shard copies, parts each is cut into)."""
        copies = pass_copies(shards, seed, self.pass_index)
        return copies, self.parts if self.parts is not None else pass_parts(len(copies), num_slots)

    def items(self, shards: list[Shard], seed: int, num_slots: int,
              layout: tuple[list[tuple[int, int]], int] | None = None) -> list[Item]:
        """The segment's items in reading order for `num_slots` slots (item i goes to slot i mod num_slots)."""
        copies, parts = layout or self.layout(shards, seed, num_slots)
        items = list(self.extras) + copies_units(copies, parts, self.frontier)
        if 0 < len(items) < num_slots:
            subs = math.ceil(num_slots / len(items))
            items = [item.split(sub, subs) for item in items for sub in range(subs)]
        return items

    def to_json(self) -> dict[str, Any]:
        return {"pass": self.pass_index, "parts": self.parts, "frontier": self.frontier,
                "extras": [_item_json(item) for item in self.extras], "resumes": self.resumes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Segment:
        return cls(data["pass"], data["parts"], data["frontier"], [_item_from_json(i) for i in data["extras"]],
                   data["resumes"])


class Schedule:
    """The phases a run's slots read: the plan it resumed with (segments), then fresh passes from `next_pass`."""

    def __init__(self, plan: list[Segment] | None = None, next_pass: int = 0, num_shards: int | None = None):
        self.plan, self.next_pass = list(plan or []), next_pass
        self.num_shards = num_shards  # of the file list the plan was made over (its units index it)

    def segment(self, phase: int) -> Segment:
        if phase < len(self.plan):
            return self.plan[phase]
        return Segment(self.next_pass + phase - len(self.plan))

    def pass_of(self, phase: int) -> int:
        return self.plan[phase].pass_index if phase < len(self.plan) else self.next_pass + phase - len(self.plan)

    def phase_of(self, pass_index: int) -> int:
        """The phase reading fresh pass `pass_index` (a pass after the plan)."""
        return len(self.plan) + pass_index - self.next_pass

    def to_json(self) -> dict[str, Any]:
        return {"plan": [s.to_json() for s in self.plan], "next_pass": self.next_pass, "shards": self.num_shards}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Schedule:
        if not data:
            return cls()
        return cls([Segment.from_json(s) for s in data["plan"]], data["next_pass"], data.get("shards"))


def slot_phase(state: dict[str, Any]) -> int:
    return state.get("phase", state["pass"])  # states written before plans existed: phase = pass


def remainder(shards: list[Shard], seed: int, schedule: Schedule, num_slots: int,
              slots: dict[int, dict[str, Any]]) -> Schedule:
    """What is left to read after the trainer consumed up to the saved `slots` states of a run of
    `num_slots` slots that read `schedule`: the plan of the next run, whatever its layout.

    A slot missing from `slots` consumed nothing (its worker's first batch never reached the trainer).
    """
    position: dict[int, tuple[int, int, int, list]] = {}  # slot -> (phase, item, line, buffer pointers)
    for slot in range(num_slots):
        state = slots.get(slot)
        position[slot] = (0, 0, 0, []) if state is None else (
            slot_phase(state), state["unit"], state["line"], state["buffer"] + state.get("held", []))
    first = min(p[0] for p in position.values())
    last = max(p[0] for p in position.values())
    resumes = 1 + max((s.resumes for s in schedule.plan), default=0)
    plan: list[Segment] = []
    for phase in range(first, last + 1):
        segment = schedule.segment(phase)
        copies, parts = layout = segment.layout(shards, seed, num_slots)
        items = segment.items(shards, seed, num_slots, layout)
        reached: dict[int, tuple[int, int]] = {}  # slot -> (first item not fully consumed, its line)
        picked: list[Picked] = []
        for slot, (at, unit, line, buffer) in position.items():
            mine = len(range(slot, len(items), num_slots))
            if at < phase:
                reached[slot] = (0, 0)
            elif at > phase:
                reached[slot] = (mine, 0)
            else:
                reached[slot] = (unit, line)
                records = tuple(item_record(items[slot + u * num_slots], n) for u, n in buffer)
                if records:
                    picked.append(Picked(records))
        # every item from `top` on is untouched; below it, what a slot has not finished is an extra
        top = min(len(items), max(slot + (unit + 1) * num_slots for slot, (unit, _) in reached.items()))
        extras: list[Item] = []
        for i in range(top):
            unit, line = reached[i % num_slots]
            if i // num_slots > unit:
                extras.append(items[i])
            elif i // num_slots == unit and (rest := item_after(items[i], line)) is not None:
                extras.append(rest)
        canonical = len(copies) * parts  # canonical units of the pass
        canonical_start = len(segment.extras)
        if len(items) != canonical_start + canonical - segment.frontier:
            # a small segment cut into sub-parts: all of it is described item by item
            extras.extend(items[top:])
            frontier = canonical
        else:
            extras.extend(items[top:max(top, canonical_start)])  # old extras no slot reached
            frontier = segment.frontier + max(0, top - canonical_start)
        extras.extend(picked)
        if extras or frontier < canonical:
            plan.append(Segment(segment.pass_index, parts, frontier, extras, resumes))
    plan.extend(schedule.plan[last + 1:])
    next_pass = schedule.next_pass if last < len(schedule.plan) else schedule.pass_of(last) + 1
    return Schedule(plan, next_pass, len(shards))


def counts_of(slots: dict[int, dict[str, Any]]) -> Counter:
    """The slots' record counts; a record waiting in a bucket is not counted `ok` yet (a resume reads it again)."""
    total: Counter = Counter()
    for state in slots.values():
        total.update(state["counts"])
        total["ok"] -= len(state.get("held", []))
    return total
