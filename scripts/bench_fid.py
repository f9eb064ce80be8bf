"""The Fréchet distance's two methods on full-rank 2048 x 2048 covariances: seconds each and their ratio in one run,
and how far apart their values are.

    python scripts/bench_fid.py [--images 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ldm.evaluation.fid import frechet_distance


def covariance_pair(images: int, seed: int = 0):
    """Two feature sets like Inception pool3 ones (non-negative, correlated): their means and covariances."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((2048, 2048)) / 45
    a = np.maximum(rng.standard_normal((images, 2048)) @ mixing, 0)
    b = np.maximum((rng.standard_normal((images, 2048)) + 0.1) @ mixing, 0)
    return a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    pair = covariance_pair(args.images)
    seconds = {"sqrtm": [], "eigenvalues": []}
    values = {}
    for _ in range(args.rounds):
        for method in seconds:  # interleaved, so that the machine's load falls on both alike
            start = time.perf_counter()
            values[method] = frechet_distance(*pair, method=method)
            seconds[method].append(time.perf_counter() - start)
    best = {m: min(s) for m, s in seconds.items()}
    print(f"sqrtm {best['sqrtm']:.2f} s, eigenvalues {best['eigenvalues']:.2f} s (best of {args.rounds}): "
          f"{best['sqrtm'] / best['eigenvalues']:.1f}x; FID {values['sqrtm']:.6f} vs {values['eigenvalues']:.6f}, "
          f"relative difference {abs(values['sqrtm'] - values['eigenvalues']) / values['sqrtm']:.1e}")


if __name__ == "__main__":
    main()
