"""What one batch costs to cross from a loader worker to the trainer: float32 (as before) against uint8
(as the loader sends it now), interleaved in one run; the ratio is the last number printed.

    .venv/bin/python scripts/bench_batches.py [--batch_size 6] [--resolution 256] [--batches 100]
"""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import time

import numpy as np

from ldm.data.dataset import to_pixel_values, to_uint8_batch
from ldm.runtime.cli import ToolParser

MAKE = {"float32": to_pixel_values, "uint8": to_uint8_batch}


def send(conn, crops, kind: str, count: int) -> None:
    for _ in range(count):
        conn.send({"pixel_values": MAKE[kind](crops), "input_ids": np.zeros((len(crops), 77), np.int64)})
    conn.close()


def per_batch_ms(crops, kind: str, count: int) -> float:
    """Make, pickle, send through a pipe and unpickle, as a DataLoader worker's batch travels."""
    receiver, sender = multiprocessing.Pipe(duplex=False)
    worker = multiprocessing.get_context("fork").Process(target=send, args=(sender, crops, kind, count))
    worker.start()
    start = time.perf_counter()
    for _ in range(count):
        receiver.recv()
    elapsed = time.perf_counter() - start
    worker.join()
    return elapsed / count * 1e3


def main() -> None:
    parser = ToolParser(description=__doc__)
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    crops = [rng.integers(0, 256, (args.resolution, args.resolution, 3), dtype=np.uint8)
             for _ in range(args.batch_size)]
    times: dict[str, list[float]] = {"float32": [], "uint8": []}
    for _ in range(args.rounds):
        for kind in times:
            times[kind].append(per_batch_ms(crops, kind, args.batches))
    for kind, values in times.items():
        size = len(pickle.dumps(MAKE[kind](crops)))
        print(f"{kind:8s} {size / 1e6:.2f} MB per batch, {statistics.median(values):.2f} ms per batch (median)")
    ratio = statistics.median(times["float32"]) / statistics.median(times["uint8"])
    print(f"uint8 batches cross {ratio:.2f}x faster")


if __name__ == "__main__":
    main()
