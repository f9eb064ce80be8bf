"""Elastic exact resume in the data layer: a pass interrupted and resumed under other (ranks x workers)
layouts reads each of its records exactly once over the union of its segments.

Consumption is simulated as the training loop does it: per rank, the stream's batches (each carrying its
slot's state) are taken round-robin from the loader's workers (`CaptionImageStream.batches(worker)`),
each taken batch goes through the loop's `StreamState.update`, workers have batches in flight that are
never taken, and a checkpoint is every rank's `StreamState.state_dict()` through JSON.
"""

import json
import random
from collections import Counter

import numpy as np
import pytest
from test_data_plan import text_shards

from ldm.data.dataset import CaptionImageStream, StreamState, rank_stream_state
from ldm.data.filelist import Shard
from ldm.data.plan import pass_copies
from ldm.data.record import ImageTransform
from ldm.data.resume import slot_phase


class KeyStream(CaptionImageStream):
    """The real stream with a sample that is the record's identity: (pass, shard index, copy, line)."""

    def make_sample(self, record, counts=None):
        self.kind = True  # batched as latents: any array
        index = self.index[record.shard]
        key = np.array([record.pass_index, index, record.copy, record.line_number])
        # bucketed: one of three shapes, a function of the record as an image's bucket is
        return (np.tile(key, (1 + (7 * record.line_number + index) % 3, 1)) if self.bucketed else key), None


class ImageKeyStream(KeyStream):
    """The real stream with real images cropped to their aspect-ratio buckets: a sample is its record's identity
    spread over the crop's shape, so batches group by the real buckets."""

    def make_sample(self, record, counts=None):
        self.kind = False  # the record is an image; its sample is batched as an array of keys
        image, *_ = CaptionImageStream.make_sample(self, record)
        self.kind = True
        key = np.array([record.pass_index, self.index[record.shard], record.copy, record.line_number])
        CROPS[(key[1], key[3])] = image.shape[:2]
        return np.broadcast_to(key, (*image.shape[:2], 4)).copy(), None


CROPS = {}  # (shard index, line) -> (height, width) of the record's crop


def start_run(shards, saved, world, workers, batch_size, buffer, seed, bucketed=False):
    ranks = []
    for rank in range(world):
        state = rank_stream_state(saved, rank, world) if saved else None
        if isinstance(bucketed, ImageTransform):
            stream = ImageKeyStream(shards, tokenize=None, transform=bucketed, batch_size=batch_size, seed=seed,
                                    rank=rank, world_size=world, num_workers=workers, shuffle_buffer=buffer,
                                    state=state)
        else:
            stream = KeyStream(shards, tokenize=None, transform=None, batch_size=batch_size, seed=seed, rank=rank,
                               world_size=world, num_workers=workers, shuffle_buffer=buffer, state=state)
            stream.bucketed = bucketed
        stream.index = {s.path: i for i, s in enumerate(shards)}
        tracker = StreamState(workers)
        if stream.resumes_exactly:
            tracker.load_state_dict(state)
        ranks.append({"stream": stream, "tracker": tracker, "taken": 0,
                      "workers": [stream.batches(w) for w in range(max(1, workers))]})
    return ranks


def take(rank):
    """The next batch of a rank's loader (its workers in strict round-robin order), through the loop's tracker."""
    batch = next(rank["workers"][rank["taken"] % len(rank["workers"])])
    rank["taken"] += 1
    batch = rank["tracker"].update(batch)
    return [tuple(int(v) for v in row.reshape(-1, 4)[0]) for row in batch["latent_moments"]]


def run(shards, saved, world, workers, *, steps=None, until_pass=None, batch_size=2, buffer=4, seed=0,
        in_flight=2, bucketed=False):
    """One run (a layout) from `saved`: `steps` updates (every rank takes one batch each), or until every slot's
    last taken batch is past pass `until_pass`. Returns (records taken, in order; the checkpoint's states)."""
    ranks = start_run(shards, saved, world, workers, batch_size, buffer, seed, bucketed)
    taken = []
    step = 0
    while True:
        if steps is not None and step == steps:
            break
        if until_pass is not None and all(
                len(r["tracker"].slots) == len(r["workers"])
                and min(s["pass"] for s in r["tracker"].slots.values()) > until_pass for r in ranks):
            break
        assert step < 10_000, "the run never got past the pass"
        for rank in ranks:
            taken.extend(take(rank))
        step += 1
    for rank in ranks:  # batches made but never taken: prefetched by the workers when the run stopped
        for worker in rank["workers"]:
            for _ in range(in_flight):
                next(worker)
    return taken, json.loads(json.dumps([r["tracker"].state_dict() for r in ranks]))


def expected_pass(shards, sizes, seed, pass_index):
    return Counter((pass_index, index, copy, line) for index, copy in pass_copies(shards, seed, pass_index)
                   for line in range(1, sizes[index] + 1))


def check_exactly_once(shards, sizes, seed, taken, passes):
    """(read, skipped, repeated) over `passes`: taken records against each pass's records."""
    got = Counter(taken)
    read = skipped = repeated = 0
    for p in passes:
        want = expected_pass(shards, sizes, seed, p)
        have = Counter({k: v for k, v in got.items() if k[0] == p})
        read += sum(have.values())
        skipped += sum((want - have).values())
        repeated += sum((have - want).values())
    return read, skipped, repeated


def elastic_case(tmp_path, rng, layouts, sizes, weights, buffer, seed, bucketed=False):
    shards = [Shard(s.path, w) for s, w in zip(text_shards(tmp_path, sizes), weights, strict=True)]
    taken, saved = [], None
    for world, workers in layouts[:-1]:
        got, saved = run(shards, saved, world, workers, steps=rng.randrange(0, 12), batch_size=rng.randint(1, 3),
                         buffer=buffer, seed=seed, in_flight=rng.randint(0, 3), bucketed=bucketed)
        taken += got
    # the last layout reads until every slot is past every pass the earlier ones touched
    last_pass = max([k[0] for k in taken], default=0)
    world, workers = layouts[-1]
    got, saved = run(shards, saved, world, workers, until_pass=last_pass, batch_size=rng.randint(1, 3),
                     buffer=buffer, seed=seed, bucketed=bucketed)
    taken += got
    return shards, taken, last_pass


LAYOUTS = [(w, k) for w in (1, 2, 3) for k in (0, 1, 2, 3)]


def random_case(tmp_path, case, bucketed=False):
    rng = random.Random(case)
    num_shards = rng.choice([1, 2, 3, 5, 8])  # often fewer shards than slots
    # at least 9 lines a shard: every part of a shard cut for up to 9 slots has a record (a fresh pass's slot
    # with only empty units stops with NoUsableData, as before)
    sizes = [rng.choice([9, 12, 17, 30]) for _ in range(num_shards)]
    weights = [rng.choice([1.0, 1.0, 0.5, 2.0, 1.5]) for _ in range(num_shards)]
    layouts = [rng.choice(LAYOUTS) for _ in range(rng.choice([2, 3, 4]))]
    buffer = rng.choice([1, 3, 8])
    shards, taken, last_pass = elastic_case(tmp_path, rng, layouts, sizes, weights, buffer, seed=case,
                                            bucketed=bucketed)
    return layouts, check_exactly_once(shards, sizes, case, taken, range(last_pass + 1))


@pytest.mark.parametrize("case", range(60))
def test_exact_once_over_random_layout_changes(tmp_path, case):
    layouts, (read, skipped, repeated) = random_case(tmp_path, case)
    assert (skipped, repeated) == (0, 0), (layouts, read, skipped, repeated)


def test_exact_once_summary_over_many_random_chains(tmp_path):
    totals, chains = Counter(), Counter()
    for case in range(60, 200):
        folder = tmp_path / str(case)
        folder.mkdir()
        layouts, (read, skipped, repeated) = random_case(folder, case)
        assert (skipped, repeated) == (0, 0), (case, layouts, read, skipped, repeated)
        totals.update(read=read, skipped=skipped, repeated=repeated)
        chains[len(layouts)] += 1
    print(f"140 random chains (by length {dict(chains)}) of layouts {LAYOUTS}: {dict(totals)}")


def test_the_issues_chain_2x2_1x3_2x1_with_weights_fewer_shards_and_a_shuffle_buffer(tmp_path):
    rng = random.Random(0)
    sizes, weights = [9, 14, 5], [1.0, 2.0, 0.5]  # 3 shards, 4 slots: shards cut in parts
    totals = Counter()
    for seed in range(20):
        folder = tmp_path / str(seed)
        folder.mkdir()
        shards, taken, last_pass = elastic_case(folder, rng, [(2, 2), (1, 3), (2, 1)], sizes, weights, 8, seed)
        read, skipped, repeated = check_exactly_once(shards, sizes, seed, taken, range(last_pass + 1))
        totals.update(read=read, skipped=skipped, repeated=repeated)
    print(f"2x2 -> 1x3 -> 2x1, 20 seeds: {dict(totals)}")
    assert totals["skipped"] == totals["repeated"] == 0 and totals["read"] > 0


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1)])
def test_same_layout_resume_takes_exactly_the_uninterrupted_batches(tmp_path, world, workers):
    shards = text_shards(tmp_path, [9, 4, 13, 6, 1])
    straight, _ = run(shards, None, world, workers, steps=40, batch_size=3, buffer=5)
    first, saved = run(shards, None, world, workers, steps=17, batch_size=3, buffer=5)
    second, _ = run(shards, saved, world, workers, steps=23, batch_size=3, buffer=5)
    assert first + second == straight
    assert max(k[0] for k in straight) >= 2  # across passes


def test_a_resumed_run_resumed_with_its_own_layout_is_bit_identical_too(tmp_path):
    shards = text_shards(tmp_path, [9, 4, 13, 6, 1])
    _, saved = run(shards, None, 2, 2, steps=5, batch_size=3, buffer=5)
    straight, _ = run(shards, saved, 1, 3, steps=30, batch_size=3, buffer=5)
    first, again = run(shards, saved, 1, 3, steps=11, batch_size=3, buffer=5)
    assert again[0]["schedule"]["plan"]  # the plan travels with the checkpoint
    second, _ = run(shards, again, 1, 3, steps=19, batch_size=3, buffer=5)
    assert first + second == straight


def test_the_next_pass_after_the_rest_is_the_new_layouts_pass(tmp_path):
    """After the rest of the interrupted pass, pass 1 is read exactly as a run that started with this layout."""
    shards = text_shards(tmp_path, [9, 4, 13, 6])
    _, saved = run(shards, None, 2, 1, steps=3, batch_size=2, buffer=1)
    taken, states = run(shards, saved, 1, 3, until_pass=1, batch_size=2, buffer=1)
    fresh, _ = run(shards, None, 1, 3, until_pass=1, batch_size=2, buffer=1)
    assert Counter(k for k in taken if k[0] == 1) == Counter(k for k in fresh if k[0] == 1)
    assert all(slot_phase(s) >= 1 for s in states[0]["slots"].values())


def test_state_and_resume_stay_small_for_a_large_plan():
    """60,000 shards: a checkpoint's data state and its resume do not grow with the shards or their records."""
    import time

    from ldm.data.resume import Schedule, remainder

    shards = [Shard(f"/data/laion/{i:05d}.gz") for i in range(60_000)]
    num_slots, buffer = 64, 256
    slots = {}
    rng = random.Random(0)
    for slot in range(num_slots):  # every slot ~300 units into the pass, a full shuffle buffer each
        unit = 300 + rng.randrange(3)
        slots[slot] = {"slot": slot, "num_slots": num_slots, "pass": 0, "phase": 0, "unit": unit, "line": 4000,
                       "pops": 0, "pass_ok": 1, "counts": {"ok": 1},
                       "buffer": [[unit, 3000 + i] for i in range(buffer)]}
    start = time.perf_counter()
    plan = remainder(shards, 0, Schedule(), num_slots, slots)
    elapsed = time.perf_counter() - start
    size = len(json.dumps(plan.to_json()))
    print(f"plan of the rest of a pass over 60,000 shards, 64 slots x 256 buffered: {size} bytes in {elapsed:.3f} s")
    assert len(plan.plan) == 1 and plan.plan[0].frontier > 300 * num_slots
    assert size < 64 * buffer * 25 + 64 * 40 * 4  # the buffers' records and a few units per slot
    assert elapsed < 5


@pytest.mark.parametrize("second", [(1, 3), (2, 2), (3, 0)])
def test_the_plan_from_a_checkpoint_is_what_the_resumed_run_reads(tmp_path, second):
    """`python -m ldm.prepare plan --from_checkpoint` (its function): the rest of the interrupted pass, per slot of
    the next layout (here another one, and the same), is exactly what that run then reads of the pass."""
    from ldm.prepare.tools import resumed_slot_plan

    sizes = [9, 14, 5, 11]
    shards = [Shard(s.path, w) for s, w in zip(text_shards(tmp_path, sizes), [1.0, 2.0, 0.5, 1.0], strict=True)]
    first, saved = run(shards, None, 2, 2, steps=4, batch_size=2, buffer=4, seed=3)
    interrupted = max(s["pass"] for rank in saved for s in rank["slots"].values())
    world, workers = second
    plan = list(resumed_slot_plan(shards, saved, world, workers, None, 1))  # the seed: the checkpoint's
    assert {(rank, worker) for rank, worker, _, _ in plan} <= {(r, w) for r in range(world)
                                                               for w in range(max(1, workers))}
    taken, _ = run(shards, saved, world, workers, until_pass=interrupted, batch_size=2, buffer=4, seed=3)
    path = {i: s.path for i, s in enumerate(shards)}
    rest = Counter((path[index], line) for p, index, _, line in taken if p <= interrupted)
    assert Counter((shard, line) for _, _, shard, line in plan) == rest
    read, skipped, repeated = check_exactly_once(shards, sizes, 3, first + [k for k in taken if k[0] <= interrupted],
                                                 range(interrupted + 1))
    assert (skipped, repeated) == (0, 0) and read > len(first)


def test_another_seed_starts_the_next_pass_with_a_warning_and_other_shards_are_refused(tmp_path, caplog):
    from ldm.data.dataset import DataChanged

    shards = text_shards(tmp_path, [9, 4, 13, 6])
    _, saved = run(shards, None, 2, 1, steps=3, seed=1)
    _, again = run(shards, saved, 1, 2, steps=1, seed=1)  # a plan, made over 4 shards
    with caplog.at_level("WARNING", logger="ldm.data"):
        taken, _ = run(shards, saved, 1, 1, steps=2, seed=2)
    assert "cannot resume the interrupted pass" in caplog.text and "starting pass 1" in caplog.text
    assert {k[0] for k in taken} == {1}
    with pytest.raises(DataChanged, match="4 shards when it was saved, now 3"):  # a state of before shard digests
        run(shards[:3], again, 1, 1, steps=2, seed=1)


def test_the_plan_command_reads_the_checkpoint_through_read_training_state(tmp_path, monkeypatch, capsys):
    import ldm.checkpoint.format
    from ldm.prepare.tools import main, resumed_slot_plan

    shards = text_shards(tmp_path, [9, 4, 13, 6])
    (tmp_path / "f").write_text("".join(f"{s.path}\n" for s in shards))
    (tmp_path / "list").write_text("f\n")
    _, saved = run(shards, None, 2, 2, steps=3, buffer=4, seed=5)
    asked = []
    (tmp_path / "checkpoint-3").mkdir()
    monkeypatch.setattr(ldm.checkpoint.format, "read_training_state",
                        lambda folder: asked.append(folder) or {"stream": saved, "world_size": 2})
    assert main(["plan", "--from_checkpoint", str(tmp_path / "checkpoint-3"), "--file_list", str(tmp_path / "list"),
                 "--world_size", "3", "--num_workers", "1"]) == 0
    assert asked == [str(tmp_path / "checkpoint-3")]
    printed = capsys.readouterr().out.splitlines()
    expected = [f"{r} {w} {s} {n}" for r, w, s, n in resumed_slot_plan(shards, saved, 3, 1, None, 1)]
    assert printed == expected and {line.split()[0] for line in printed} == {"0", "1", "2"}


# -- aspect-ratio buckets: records wait in partly filled buckets, which are part of the data position --------


@pytest.mark.parametrize("case", range(40))
def test_exact_once_over_random_layout_changes_with_buckets(tmp_path, case):
    layouts, (read, skipped, repeated) = random_case(tmp_path, case, bucketed=True)
    assert (skipped, repeated) == (0, 0), (layouts, read, skipped, repeated)


def test_the_issues_chain_2x2_1x3_2x1_with_buckets(tmp_path):
    rng = random.Random(1)
    sizes, weights = [9, 14, 5], [1.0, 2.0, 0.5]
    totals = Counter()
    for seed in range(20):
        folder = tmp_path / str(seed)
        folder.mkdir()
        shards, taken, last_pass = elastic_case(folder, rng, [(2, 2), (1, 3), (2, 1)], sizes, weights, 8, seed,
                                                bucketed=True)
        read, skipped, repeated = check_exactly_once(shards, sizes, seed, taken, range(last_pass + 1))
        totals.update(read=read, skipped=skipped, repeated=repeated)
    print(f"bucketed 2x2 -> 1x3 -> 2x1, 20 seeds: {dict(totals)}")
    assert totals["skipped"] == totals["repeated"] == 0 and totals["read"] > 0


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1)])
def test_a_bucketed_same_layout_resume_takes_exactly_the_uninterrupted_batches(tmp_path, world, workers):
    shards = text_shards(tmp_path, [9, 4, 13, 6, 1])
    straight, _ = run(shards, None, world, workers, steps=40, batch_size=3, buffer=5, bucketed=True)
    for cut in (5, 17, 26):
        first, saved = run(shards, None, world, workers, steps=cut, batch_size=3, buffer=5, bucketed=True)
        second, _ = run(shards, saved, world, workers, steps=40 - cut, batch_size=3, buffer=5, bucketed=True)
        assert first + second == straight, cut
    held = [s for _, saved in [run(shards, None, world, workers, steps=17, batch_size=3, buffer=5, bucketed=True)]
            for rank in saved for s in rank["slots"].values() if s.get("held")]
    assert held  # the cut fell where records waited in partly filled buckets


def test_partly_filled_buckets_end_with_their_pass_as_counted_short_batches(tmp_path):
    """A slot's pass ends with the buckets it left partly filled, sent as short batches (and counted): no record of
    pass 0 is trained in a batch of pass 1, and every batch holds one shape."""
    shards = text_shards(tmp_path, [9, 4, 13, 6, 1])
    (rank,) = start_run(shards, None, 1, 0, 4, 5, 0, bucketed=True)
    batches = [rank["tracker"].update(next(rank["workers"][0])) for _ in range(40)]
    passes = [{int(p) for p in b["latent_moments"][:, 0, 0]} for b in batches]
    assert all(len(p) == 1 for p in passes)  # a batch never mixes passes
    sizes = [len(b["latent_moments"]) for b in batches]
    short = [i for i, n in enumerate(sizes) if n < 4]
    assert short and all(passes[i + 1] != passes[i] or sizes[i + 1] < 4 for i in short)  # only at a pass's end
    assert 0 < len([i for i in short if passes[i] == {0}]) <= 3  # at most one per bucket
    shapes = {b["latent_moments"].shape[1] for b in batches}
    assert shapes == {1, 2, 3}
    assert rank["tracker"].counts()["short_batch_records"] == sum(n for n in sizes if n < 4)


@pytest.mark.parametrize("second", [(1, 3), (2, 2)])
def test_the_plan_from_a_bucketed_checkpoint_lists_the_held_records(tmp_path, second):
    from ldm.prepare.tools import resumed_slot_plan

    sizes = [9, 14, 5, 11]
    shards = text_shards(tmp_path, sizes)
    first, saved = run(shards, None, 2, 2, steps=4, batch_size=3, buffer=4, seed=3, bucketed=True)
    assert any(s.get("held") for rank in saved for s in rank["slots"].values())
    interrupted = max(s["pass"] for rank in saved for s in rank["slots"].values())
    world, workers = second
    plan = list(resumed_slot_plan(shards, saved, world, workers, None, 1))
    taken, _ = run(shards, saved, world, workers, until_pass=interrupted, batch_size=3, buffer=4, seed=3,
                   bucketed=True)
    path = {i: s.path for i, s in enumerate(shards)}
    rest = Counter((path[index], line) for p, index, _, line in taken if p <= interrupted)
    assert Counter((shard, line) for _, _, shard, line in plan) == rest
    read, skipped, repeated = check_exactly_once(shards, sizes, 3, first + [k for k in taken if k[0] <= interrupted],
                                                 range(interrupted + 1))
    assert (skipped, repeated) == (0, 0)


def test_the_chain_2x2_1x3_2x1_on_real_images_of_random_aspect_ratios(tmp_path):
    """The real bucketed transform on real JPEG and PNG records of random aspect ratios: every batch holds one
    bucket, several buckets are trained, and every record of the interrupted passes is read exactly once."""
    from corpus import aspect_sizes, write_aspect_corpus

    from ldm.data.filelist import read_file_list
    from ldm.models.buckets import auto_buckets, nearest_bucket

    listing = write_aspect_corpus(str(tmp_path / "corpus"), 40, 8, seed=3)
    shards = read_file_list(listing)
    sizes = [8] * 5
    buckets = auto_buckets(32, 8)
    transform = ImageTransform(32, buckets=buckets)
    rng = random.Random(4)
    taken, saved, shapes = [], None, Counter()
    for world, workers in [(2, 2), (1, 3)]:
        got, saved = run(shards, saved, world, workers, steps=rng.randrange(2, 6), batch_size=3, buffer=4, seed=2,
                         in_flight=2, bucketed=transform)
        taken += got
    last_pass = max(k[0] for k in taken)
    got, _ = run(shards, saved, 2, 1, until_pass=last_pass, batch_size=3, buffer=4, seed=2, bucketed=transform)
    taken += got
    read, skipped, repeated = check_exactly_once(shards, sizes, 2, taken, range(last_pass + 1))
    assert (skipped, repeated) == (0, 0) and read >= 40
    # each record went to the bucket of its image's aspect ratio
    size_of = aspect_sizes(40, seed=3)
    for _, shard, _, line in taken:
        bucket = nearest_bucket(buckets, *size_of[shard * 8 + line - 1])
        assert CROPS[(shard, line)] == bucket
        shapes[bucket] += 1
    assert len(shapes) >= 4, shapes


@pytest.mark.parametrize("change", ["buckets_off", "smaller_batch", "buckets_on"])
def test_a_same_layout_resume_with_other_bucket_settings_trains_every_waiting_record(tmp_path, change):
    """Records waiting in buckets at the checkpoint, resumed on the same layout with buckets turned off (one group,
    fuller than a batch), a smaller batch, or from square batches into buckets: every record of the pass once."""
    sizes = [9, 4, 13, 6, 1]
    shards = text_shards(tmp_path, sizes)
    first_bucketed = change != "buckets_on"
    first, saved = run(shards, None, 2, 2, steps=7, batch_size=4, buffer=5, bucketed=first_bucketed)
    if first_bucketed:
        assert sum(len(s.get("held", [])) for r in saved for s in r["slots"].values()) >= 4
    last_pass = max(k[0] for k in first)
    rest, _ = run(shards, saved, 2, 2, until_pass=last_pass, batch_size=1 if change == "smaller_batch" else 4,
                  buffer=5, bucketed=change != "buckets_off")
    read, skipped, repeated = check_exactly_once(shards, sizes, 0, first + rest, range(last_pass + 1))
    assert (skipped, repeated) == (0, 0) and read > len(first)
