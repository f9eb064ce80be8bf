"""The records of one (rank, worker) slot, shuffled, with a position that can be saved and restored.

The state is small and explicit: phase (`ldm.data.resume.Schedule`: the rest of a pass left by a
run of another layout, or a whole pass) and its pass number, unit index, last line read in that
unit, number of shuffle draws, and the shuffle buffer as (unit, line) pointers. Restoring re-reads only the
buffered lines (a few shards at most), never replays the pass. Shuffle draws use a generator
seeded by (seed, pass, slot, draw), and each record's augmentations one seeded by the record
itself, so the stream after a restore is exactly the stream an uninterrupted run would read.

A consumer that holds records back after taking them (the bucketed batches of `ldm.data.dataset`) saves
them with the state as `held` pointers, like the buffer's; `held_records()` reads them again after a
restore, and `ldm.data.resume` counts them as unread.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ldm.data.filelist import Shard
from ldm.data.plan import Unit
from ldm.data.readers import Sample, ShardFormatError, iter_records
from ldm.data.record import SkipRecord
from ldm.data.resume import Item, Schedule, Segment, item_record, slot_phase
from ldm.data.shard import LineTooLong, ShardError, ShardTruncated
from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.data")

LOGGED_PER_REASON = 5
MAX_EMPTY_PASSES = 1000
TRUNCATED_CAPTIONS = "truncated_captions"  # records trained on whose caption the tokenizer's length cut short
NOT_PROBLEMS = ("ok", "short_batch_records", TRUNCATED_CAPTIONS)  # counts that are not skipped records
PHASE_END = None  # what `records(phase_ends=True)` yields when a phase is read to its end


class NoUsableData(UserError, RuntimeError):
    """A slot went through a whole pass without one usable record."""


class Record(NamedTuple):
    shard: str
    line_number: int
    copy: int
    pass_index: int
    line: bytes | Sample  # a text shard's line, or a tar's / parquet's sample (`ldm.data.readers`)
    seed_key: str  # the shard's `Shard.seed_key`: what seeds this record's randomness
    pointer: tuple[int, int]  # (item of the phase, key in it): what a saved state points at it by


def shard_error_reason(error: ShardError) -> str:
    if isinstance(error, ShardTruncated):
        return "truncated_shard"
    if isinstance(error, LineTooLong):
        return "line_too_long"
    if isinstance(error, ShardFormatError):
        return "unknown_format"
    return "unreadable_shard"


class SlotStream:
    def __init__(
        self,
        shards: list[Shard],
        slot: int = 0,
        num_slots: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 256,
        state: dict[str, Any] | None = None,
        schedule: Schedule | None = None,
    ):
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot {slot} out of range for {num_slots} slots")
        self.shards, self.slot, self.num_slots = shards, slot, num_slots
        self.seed, self.shuffle_buffer = seed, max(1, shuffle_buffer)
        self.schedule = schedule or Schedule()
        self.phase = self.unit_pos = self.line_pos = self.pops = self.pass_ok = 0
        self.buffer: list[tuple[int, int, bytes | Sample]] = []
        self.counts: Counter[str] = Counter()
        self._logged: Counter[str] = Counter()
        self._to_reload: list[tuple[int, int]] = []
        self._held: list[tuple[int, int]] = []  # pointers a restored state says the consumer held
        self._units_in_pass = 0  # units of the fresh pass `pass_records` last finished
        self._phase_had_items = False
        self.on_open: Callable[[str], None] | None = None  # told each shard path before it is opened
        self._reading = ""
        if state is not None:
            self.load_state_dict(state)

    @property
    def pass_index(self) -> int:
        return self.schedule.pass_of(self.phase)

    @pass_index.setter
    def pass_index(self, pass_index: int) -> None:
        """Start at fresh pass `pass_index` (after the plan)."""
        self.phase = self.schedule.phase_of(pass_index)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self, held: list[tuple[int, int]] | None = None) -> dict[str, Any]:
        """The position; `held`: pointers (`Record.pointer`) of records of this phase the consumer took but has not
        used yet (they are read again after a restore)."""
        state = {
            "slot": self.slot,
            "num_slots": self.num_slots,
            "pass": self.pass_index,
            "phase": self.phase,
            "seed": self.seed,
            "unit": self.unit_pos,
            "line": self.line_pos,
            "pops": self.pops,
            "pass_ok": self.pass_ok,
            "buffer": [[u, n] for u, n, _ in self.buffer] + [list(p) for p in self._to_reload],
            "counts": dict(self.counts),
        }
        if held:
            state["held"] = [list(p) for p in held]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["slot"], state["num_slots"]) != (self.slot, self.num_slots):
            raise ValueError(
                f"stream state is for slot {state['slot']} of {state['num_slots']}, "
                f"not slot {self.slot} of {self.num_slots}"
            )
        self.phase, self.unit_pos, self.line_pos = slot_phase(state), state["unit"], state["line"]
        self.pops, self.pass_ok = state["pops"], state["pass_ok"]
        self.counts = Counter(state["counts"])
        self.buffer = []
        self._to_reload = [(u, n) for u, n in state["buffer"]]
        self._held = [(u, n) for u, n in state.get("held", [])]

    # -- reading ---------------------------------------------------------------------------
    def reading(self) -> str:
        """Where the stream reads now, for messages: the shard and the last line taken from it."""
        return f"reading {self._reading} (line {self.line_pos}, pass {self.pass_index})" if self._reading else "idle"

    def count_skip(self, reason: str, where: str, detail: str = "") -> None:
        """Count a skipped record (or shard) by reason; the first few of each reason are logged."""
        self.counts[reason] += 1
        if self._logged[reason] < LOGGED_PER_REASON:
            self._logged[reason] += 1
            suffix = " (further ones are counted, not logged)" if self._logged[reason] == LOGGED_PER_REASON else ""
            logger.warning("skipped %s: %s %s%s", where, reason, detail, suffix)

    def _unit_lines(self, unit: Unit, after: int = 0, until: int | None = None) -> Iterator[tuple[int, bytes | Sample]]:
        """The records of `unit` after record `after` (up to `until`), of a shard of any kind (`ldm.data.readers`):
        the reader skips the others without decoding them."""
        path = self.shards[unit.shard].path
        number = 0
        self._reading = path
        if self.on_open is not None:
            self.on_open(path)
        try:
            for number, line in iter_records(path, lambda n: n > after and unit.owns(n)):
                if until is not None and number > until:
                    return
                yield number, line
        except ShardError as e:
            self.count_skip(shard_error_reason(e), f"{path}:{number + 1}" if number else path, str(e))

    def _read_records(self, records: list[tuple[int, int]]) -> dict[tuple[int, int], bytes | Sample]:
        """The lines of (shard, line) records, each shard read once up to the last line wanted."""
        wanted: dict[int, set[int]] = {}
        for shard, n in records:
            wanted.setdefault(shard, set()).add(n)
        found: dict[tuple[int, int], bytes | Sample] = {}
        for shard, numbers in wanted.items():
            for n, line in self._unit_lines(Unit(shard), after=min(numbers) - 1, until=max(numbers)):
                if n in numbers:
                    found[(shard, n)] = line
        return found

    def _item_lines(self, item: Item, after: int) -> Iterator[tuple[int, bytes | Sample]]:
        """(key, line) of an item's records after `after`: the line number in a unit, the 1-based index in a
        picked list."""
        if isinstance(item, Unit):
            yield from self._unit_lines(item, after=max(after, item.after))
            return
        records = item.records[after:]
        found = self._read_records([(shard, n) for shard, _, n in records])
        for key, (shard, _, n) in enumerate(records, after + 1):
            if (shard, n) in found:
                yield key, found[(shard, n)]
            else:
                self.count_skip("unreadable_record", f"{self.shards[shard].path}:{n}", "(a record left by a resume)")

    def _reread(self, items: list[Item], pointers: list[tuple[int, int]]) -> list[tuple[int, int, bytes | Sample]]:
        """(item, key, line) of the records saved as pointers, in their order; a line gone is warned about."""
        records = [(u, n, item_record(items[u], n)) for u, n in pointers]
        found = self._read_records([(shard, line) for _, _, (shard, _, line) in records])
        lines = []
        for u, n, (shard, _, line) in records:
            if (shard, line) in found:
                lines.append((u, n, found[(shard, line)]))
            else:
                logger.warning("shard %s changed since the checkpoint: line %d is gone", self.shards[shard].path, line)
        return lines

    def _reload_buffer(self, items: list[Item]) -> None:
        self.buffer.extend(self._reread(items, self._to_reload))
        self._to_reload = []

    def held_records(self) -> list[Record]:
        """The records a restored state says its consumer held, read again (once: the consumer holds them now)."""
        if not self._held:
            return []
        _, items = self._phase_items()
        held, self._held = self._reread(items, self._held), []
        return [self._record(items, u, n, line) for u, n, line in held]

    def _record(self, items: list[Item], unit_pos: int, key: int, line: bytes | Sample) -> Record:
        shard_index, copy, number = item_record(items[unit_pos], key)
        shard = self.shards[shard_index]
        return Record(shard.path, number, copy, self.pass_index, line, shard.seed_key, (unit_pos, key))

    def _pop(self, items: list[Item], shuffle_key: str) -> Record:
        draw = random.Random(f"{shuffle_key}/{self.slot}/{self.pops}")
        i = draw.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        unit_pos, key, line = self.buffer.pop()
        self.pops += 1
        return self._record(items, unit_pos, key, line)

    def _phase_items(self) -> tuple[Segment, list[Item]]:
        """(the current phase's segment, this slot's items of it)."""
        segment = self.schedule.segment(self.phase)
        return segment, segment.items(self.shards, self.seed, self.num_slots)[self.slot::self.num_slots]

    def pass_records(self) -> Iterator[Record]:
        """The rest of the current phase (a pass, or what a resume left of one); the state after a yield is
        the state to resume from."""
        segment, items = self._phase_items()
        shuffle_key = segment.shuffle_key(self.seed)
        if self._to_reload:
            self._reload_buffer(items)
        while self.unit_pos < len(items):
            for key, line in self._item_lines(items[self.unit_pos], after=self.line_pos):
                self.line_pos = key
                self.buffer.append((self.unit_pos, key, line))
                if len(self.buffer) >= self.shuffle_buffer:
                    yield self._pop(items, shuffle_key)
            self.unit_pos, self.line_pos = self.unit_pos + 1, 0
        while self.buffer:
            yield self._pop(items, shuffle_key)
        # a fresh pass with units must give a usable record; the rest of one may hold only bad ones
        self._units_in_pass = len(items) if segment.fresh else 0
        self._phase_had_items = bool(items)

    def next_pass(self) -> None:
        self.phase, self.unit_pos, self.line_pos, self.pops, self.pass_ok = self.phase + 1, 0, 0, 0, 0

    def records(self, phase_ends: bool = False) -> Iterator[Record | None]:
        """Records forever, pass after pass; stops with NoUsableData rather than spin on bad input. With
        `phase_ends`, `PHASE_END` after the last record of each phase (the state is then the phase's end)."""
        empty_passes = 0
        while True:
            yield from self.pass_records()
            units = self._units_in_pass
            if units and not self.pass_ok:
                problems = {reason: n for reason, n in self.counts.items() if reason not in NOT_PROBLEMS}
                found = (f"problems counted: {problems}" if problems else
                         "they hold no record at all (empty shards?); use fewer loader workers or more data")
                raise NoUsableData(
                    f"slot {self.slot} of {self.num_slots} read no usable record in pass {self.pass_index} "
                    f"from its {units} shard unit(s); {found}. "
                    "Check the file list and the shards (python -m ldm.prepare stats --file_list ...)."
                )
            empty_passes = 0 if units or self._phase_had_items else empty_passes + 1
            if empty_passes > MAX_EMPTY_PASSES:
                raise NoUsableData(f"{MAX_EMPTY_PASSES} passes in a row drew no shard: weights too small?")
            if phase_ends:
                yield PHASE_END
            self.next_pass()

    def samples(self, make_sample: Callable[[Record], Any], phase_ends: bool = False) -> Iterator[Any]:
        """`make_sample(record)` for every record, skipping and counting those it rejects (and `PHASE_END`s, see
        `records`)."""
        for record in self.records(phase_ends):
            if record is PHASE_END:
                yield PHASE_END
                continue
            try:
                sample = make_sample(record)
            except SkipRecord as e:
                self.count_skip(e.reason, f"{record.shard}:{record.line_number}", e.detail)
                continue
            self.pass_ok += 1
            self.counts["ok"] += 1
            yield sample
