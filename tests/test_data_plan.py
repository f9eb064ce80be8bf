"""Exact-once coverage and disjointness of the (rank, worker) split, and weighted sampling."""

from collections import Counter

import pytest

from ldm.data.filelist import Shard
from ldm.data.stream import SlotStream


def text_shards(folder, sizes):
    shards = []
    for i, size in enumerate(sizes):
        path = folder / f"s{i}"
        path.write_bytes(b"".join(b"c\t_\t%d-%d\n" % (i, n) for n in range(size)))
        shards.append(Shard(str(path)))
    return shards


def read_pass(shards, world, workers, seed=0, pass_index=0, buffer=4):
    per_slot = {}
    for slot in range(world * workers):
        stream = SlotStream(shards, slot, world * workers, seed, buffer)
        stream.pass_index = pass_index
        per_slot[slot] = [(r.shard, r.line_number) for r in stream.pass_records()]
    return per_slot


@pytest.mark.parametrize("world, workers, sizes", [
    (1, 1, [5, 3]),
    (1, 0, [5, 3]),           # num_workers=0 still splits by rank
    (2, 1, [4, 4, 4]),
    (2, 2, [3, 7, 1]),        # fewer shards than slots: shards split by lines
    (4, 2, [9]),              # one shard, eight slots
    (3, 2, [2, 5, 0, 8, 1, 6, 3, 4, 7, 2, 9]),  # an empty shard, leftovers
    (2, 3, [1] * 6 + [50]),
])
def test_every_record_is_read_exactly_once_per_pass(tmp_path, world, workers, sizes):
    shards = text_shards(tmp_path, sizes)
    everything = Counter((s.path, n) for s, size in zip(shards, sizes, strict=True) for n in range(1, size + 1))
    for pass_index in (0, 1):
        per_slot = read_pass(shards, world, max(1, workers), pass_index=pass_index)
        got = Counter(key for keys in per_slot.values() for key in keys)
        assert got == everything  # exactly once: nothing missed, nothing twice, so slots are disjoint
        if sum(sizes) >= len(per_slot) and len(shards) < len(per_slot):
            assert all(per_slot.values()), "a slot is idle although there are enough records"


def test_order_is_deterministic_and_changes_between_passes(tmp_path):
    shards = text_shards(tmp_path, [20] * 6)
    assert read_pass(shards, 2, 1, seed=5) == read_pass(shards, 2, 1, seed=5)
    assert read_pass(shards, 2, 1, seed=5, pass_index=0) != read_pass(shards, 2, 1, seed=5, pass_index=1)
    assert read_pass(shards, 2, 1, seed=5) != read_pass(shards, 2, 1, seed=6)


def test_weights_are_honoured_in_expectation(tmp_path):
    shards = text_shards(tmp_path, [10] * 8)
    weighted = [Shard(s.path, w) for s, w in zip(shards, [2.0, 2.0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0], strict=True)]
    totals = Counter()
    passes = 60
    for p in range(passes):
        for keys in read_pass(weighted, 1, 2, pass_index=p, buffer=1).values():
            totals.update(path for path, _ in keys)
    per_pass = [totals[s.path] / passes / 10 for s in weighted]
    assert per_pass[:2] == [2.0, 2.0] and per_pass[6:] == [1.0, 1.0]
    assert all(0.3 < w < 0.7 for w in per_pass[2:6]), per_pass
    again = Counter()
    for p in range(passes):
        for keys in read_pass(weighted, 1, 2, pass_index=p, buffer=1).values():
            again.update(path for path, _ in keys)
    assert again == totals
