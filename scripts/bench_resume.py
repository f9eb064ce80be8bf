"""Size of a checkpoint's data-stream state and time to resume it on another layout, for large plans.

    PYTHONPATH=. python scripts/bench_resume.py [--shards 600 6000 60000] [--ranks 8] [--workers 8] [--buffer 256]
                                                [--held 25]

No shard is read: the slot states are those of slots stopped a third of the way into pass 0 with a full
shuffle buffer (what `SlotStream.state_dict` writes), and `--records` (400M by default) only sets the line
numbers they point at: state and resume work do not depend on it. Times are the fastest of 3 (a shared
machine). Prints, per shard count: the checkpoint's stream state (every rank's `StreamState.state_dict()` as
JSON) saved with RANKS x WORKERS; the time to turn it into the plan of a run of half the ranks and 6 workers
(`resolve_stream_state`, on each new rank) and the plan's size; the time a new slot takes to list its items;
the stream state that second run saves when stopped in the middle of the plan (the plan plus its own slot
states) and the time to resume that on 2 x 1. `--held N`: each slot also holds N records in partly filled
aspect-ratio buckets (at most buckets x (batch - 1): 25 for ldm-32layer's 5 buckets at 256 px and batch 6).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import time

from ldm.data.dataset import rank_stream_state, resolve_stream_state
from ldm.data.filelist import Shard
from ldm.data.resume import Picked, Schedule


def slot_state(slot, num_slots, phase, pass_index, unit, line, buffer, rng, held=0):
    state = {"slot": slot, "num_slots": num_slots, "pass": pass_index, "phase": phase, "seed": 0, "unit": unit,
             "line": line, "pops": 123456, "pass_ok": 4000, "counts": {"ok": 4000, "bad_image": 3},
             "buffer": [[unit, rng.randrange(1, line + 1)] for _ in range(buffer)]}
    if held:
        state["held"] = [[unit, rng.randrange(1, line + 1)] for _ in range(held)]
    return state


def timed(call, *args, repeats=3):
    """(result, the fastest of `repeats` wall times): the machine is shared, the minimum is the work."""
    best, result = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = call(*args)
        best = min(best, time.perf_counter() - start)
    return result, best


def checkpoint(ranks, workers, slots, schedule=None):
    saved = []
    for rank in range(ranks):
        mine = {str(s): state for s, state in slots.items() if s // workers == rank}
        state = {"num_workers": workers, "batches": 1000, "slots": mine}
        if schedule and rank == 0:
            state["schedule"] = schedule
        saved.append(state)
    return json.loads(json.dumps(saved))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[600, 6000, 60000])
    parser.add_argument("--records", type=int, default=400_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--buffer", type=int, default=256)
    parser.add_argument("--held", type=int, default=0, help="records per slot waiting in aspect-ratio buckets")
    args = parser.parse_args()
    logging.getLogger("ldm.data").setLevel(logging.WARNING)  # the resume message, once per timing
    rng = random.Random(0)
    for num_shards in args.shards:
        per_shard = args.records // num_shards
        shards = [Shard(f"laion400m/{i:06d}.gz") for i in range(num_shards)]
        slots_a = args.ranks * args.workers
        units_done = max(1, num_shards // slots_a // 3)  # a third of the pass consumed
        slots = {s: slot_state(s, slots_a, 0, 0, units_done + rng.randrange(3), per_shard // 2, args.buffer, rng,
                               args.held) for s in range(slots_a)}
        saved = checkpoint(args.ranks, args.workers, slots)
        saved_bytes = len(json.dumps(saved))

        ranks_b, workers_b = max(1, args.ranks // 2), 6
        resolved, resolve_s = timed(resolve_stream_state, rank_stream_state(saved, 0, ranks_b), shards, 0, workers_b)
        plan = Schedule.from_json(resolved["schedule"])
        plan_bytes = len(json.dumps(resolved["schedule"]))
        items, items_s = timed(plan.segment(0).items, shards, 0, ranks_b * workers_b)
        items = items[0::ranks_b * workers_b]

        # the second run stopped in the middle of the plan: its slots' states point into the plan's items
        slots_b = ranks_b * workers_b
        all_items = plan.segment(0).items(shards, 0, slots_b)
        slots2 = {}
        for s in range(slots_b):
            mine = all_items[s::slots_b]
            unit = len(mine) // 2
            last = len(mine[unit].records) if isinstance(mine[unit], Picked) else per_shard // 3
            slots2[s] = slot_state(s, slots_b, 0, 0, unit, last, args.buffer, rng, args.held)
        saved2 = checkpoint(ranks_b, workers_b, slots2, resolved["schedule"])
        saved2_bytes = len(json.dumps(saved2))
        resolved3, resolve3_s = timed(resolve_stream_state, rank_stream_state(saved2, 0, 2), shards, 0, 1)
        plan3_bytes = len(json.dumps(resolved3["schedule"]))
        print(f"{num_shards:>6} shards ({per_shard} records each), {args.ranks}x{args.workers} slots, "
              f"buffer {args.buffer}, {args.held} held in buckets:\n"
              f"  checkpoint stream state {saved_bytes / 1e3:8.1f} kB; resume on {ranks_b}x{workers_b}: plan "
              f"{resolve_s:6.3f} s per rank, {plan_bytes / 1e3:7.1f} kB "
              f"({len(plan.plan[0].extras)} extras, frontier {plan.plan[0].frontier}); a slot lists its "
              f"{len(items)} items in {items_s:6.3f} s\n"
              f"  stopped again mid-plan: stream state {saved2_bytes / 1e3:8.1f} kB; resume on 2x1: "
              f"{resolve3_s:6.3f} s, plan {plan3_bytes / 1e3:7.1f} kB")


if __name__ == "__main__":
    main()
