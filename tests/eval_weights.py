"""Seeded stand-ins for the FID Inception weights and for real images, in numpy only.

The real Inception weights (pytorch-fid's 95 MB `pt_inception-2015-12-05-6726825d.pth`) cannot be downloaded
here, and random weights of that size are too big to commit. Both the reference script
(`tests/reference/make_eval_fixtures.py`, run with torch, pytorch-fid and clean-fid in another virtualenv)
and the project's tests import this module, so they build the same weights and images from the same seeds;
`weights_digest` lets a test tell a changed generator (another numpy) from a wrong port.

Images use only exact arithmetic (integers, +, *, /, comparisons; no sin or exp whose last bit may differ
between builds), so both sides decode the same pixels.
"""

from __future__ import annotations

import hashlib

import numpy as np

WEIGHTS_SEED = 2015_12_05
IMAGES_SEED = 6726825

# (name, in_channels, out_channels, kernel height, kernel width) of every conv + BN block of the FID Inception,
# in pytorch-fid's names (torchvision's Inception3 with the FID blocks).
STEM = [("Conv2d_1a_3x3", 3, 32, 3, 3), ("Conv2d_2a_3x3", 32, 32, 3, 3), ("Conv2d_2b_3x3", 32, 64, 3, 3),
        ("Conv2d_3b_1x1", 64, 80, 1, 1), ("Conv2d_4a_3x3", 80, 192, 3, 3)]


def _block_a(c, pool):
    return [("branch1x1", c, 64, 1, 1), ("branch5x5_1", c, 48, 1, 1), ("branch5x5_2", 48, 64, 5, 5),
            ("branch3x3dbl_1", c, 64, 1, 1), ("branch3x3dbl_2", 64, 96, 3, 3), ("branch3x3dbl_3", 96, 96, 3, 3),
            ("branch_pool", c, pool, 1, 1)]


def _block_b(c):
    return [("branch3x3", c, 384, 3, 3), ("branch3x3dbl_1", c, 64, 1, 1), ("branch3x3dbl_2", 64, 96, 3, 3),
            ("branch3x3dbl_3", 96, 96, 3, 3)]


def _block_c(c, c7):
    return [("branch1x1", c, 192, 1, 1), ("branch7x7_1", c, c7, 1, 1), ("branch7x7_2", c7, c7, 1, 7),
            ("branch7x7_3", c7, 192, 7, 1), ("branch7x7dbl_1", c, c7, 1, 1), ("branch7x7dbl_2", c7, c7, 7, 1),
            ("branch7x7dbl_3", c7, c7, 1, 7), ("branch7x7dbl_4", c7, c7, 7, 1), ("branch7x7dbl_5", c7, 192, 1, 7),
            ("branch_pool", c, 192, 1, 1)]


def _block_d(c):
    return [("branch3x3_1", c, 192, 1, 1), ("branch3x3_2", 192, 320, 3, 3), ("branch7x7x3_1", c, 192, 1, 1),
            ("branch7x7x3_2", 192, 192, 1, 7), ("branch7x7x3_3", 192, 192, 7, 1), ("branch7x7x3_4", 192, 192, 3, 3)]


def _block_e(c):
    return [("branch1x1", c, 320, 1, 1), ("branch3x3_1", c, 384, 1, 1), ("branch3x3_2a", 384, 384, 1, 3),
            ("branch3x3_2b", 384, 384, 3, 1), ("branch3x3dbl_1", c, 448, 1, 1), ("branch3x3dbl_2", 448, 384, 3, 3),
            ("branch3x3dbl_3a", 384, 384, 1, 3), ("branch3x3dbl_3b", 384, 384, 3, 1), ("branch_pool", c, 192, 1, 1)]


MIXED = [("Mixed_5b", _block_a(192, 32)), ("Mixed_5c", _block_a(256, 64)), ("Mixed_5d", _block_a(288, 64)),
         ("Mixed_6a", _block_b(288)), ("Mixed_6b", _block_c(768, 128)), ("Mixed_6c", _block_c(768, 160)),
         ("Mixed_6d", _block_c(768, 160)), ("Mixed_6e", _block_c(768, 192)), ("Mixed_7a", _block_d(768)),
         ("Mixed_7b", _block_e(1280)), ("Mixed_7c", _block_e(2048))]


def conv_blocks() -> list[tuple[str, int, int, int, int]]:
    return STEM + [(f"{mixed}.{name}", *rest) for mixed, blocks in MIXED for name, *rest in blocks]


def inception_shapes(with_fc: bool = True) -> dict[str, tuple[int, ...]]:
    """pytorch-fid's state-dict names and shapes (`num_batches_tracked` left out: it holds no weight)."""
    shapes = {}
    for name, cin, cout, kh, kw in conv_blocks():
        shapes[f"{name}.conv.weight"] = (cout, cin, kh, kw)
        for part in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.bn.{part}"] = (cout,)
    if with_fc:
        shapes["fc.weight"] = (1008, 2048)
        shapes["fc.bias"] = (1008,)
    return shapes


def random_inception(seed: int = WEIGHTS_SEED, with_fc: bool = True) -> dict[str, np.ndarray]:
    """float32 weights under pytorch-fid's names: He-scaled convolutions (activations keep their scale through
    the 47 layers), batch norms near identity with some spread, so that features differ between images."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, cin, cout, kh, kw in conv_blocks():
        fan_in = cin * kh * kw
        state[f"{name}.conv.weight"] = (rng.standard_normal((cout, cin, kh, kw), dtype=np.float32)
                                        * np.float32(np.sqrt(2.0 / fan_in)))
        state[f"{name}.bn.weight"] = rng.uniform(0.8, 1.2, cout).astype(np.float32)
        state[f"{name}.bn.bias"] = rng.uniform(-0.1, 0.1, cout).astype(np.float32)
        state[f"{name}.bn.running_mean"] = rng.uniform(-0.1, 0.1, cout).astype(np.float32)
        state[f"{name}.bn.running_var"] = rng.uniform(0.8, 1.25, cout).astype(np.float32)
    if with_fc:
        state["fc.weight"] = (rng.standard_normal((1008, 2048), dtype=np.float32) * np.float32(0.02))
        state["fc.bias"] = np.zeros(1008, np.float32)
    return state


def weights_digest(state: dict[str, np.ndarray]) -> str:
    """sha256 over the names, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        array = np.ascontiguousarray(state[name], dtype=np.float32)
        digest.update(f"{name}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


# (height, width) of the test images: square, non-square both ways, smaller than the network's 299, larger
IMAGE_SIZES = [(256, 256), (200, 320), (299, 299), (48, 32), (512, 384), (128, 128), (333, 250), (64, 96)]


def _upsample(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear upsampling of a small [gh, gw, 3] grid to [height, width, 3], in exact arithmetic order."""
    gh, gw = grid.shape[:2]
    y = np.arange(height, dtype=np.float64) * (gh - 1) / max(height - 1, 1)
    x = np.arange(width, dtype=np.float64) * (gw - 1) / max(width - 1, 1)
    y0 = np.minimum(y.astype(np.int64), gh - 2)
    x0 = np.minimum(x.astype(np.int64), gw - 2)
    fy = (y - y0)[:, None, None]
    fx = (x - x0)[None, :, None]
    top = grid[y0][:, x0] * (1 - fx) + grid[y0][:, x0 + 1] * fx
    bottom = grid[y0 + 1][:, x0] * (1 - fx) + grid[y0 + 1][:, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def make_image(index: int, height: int, width: int, seed: int = IMAGES_SEED) -> np.ndarray:
    """A uint8 [height, width, 3] picture: a colour gradient, a smooth texture, a few ellipses and rectangles
    of flat colour, and grain."""
    rng = np.random.default_rng([seed, index])
    yy = np.arange(height, dtype=np.float64)[:, None, None] / height
    xx = np.arange(width, dtype=np.float64)[None, :, None] / width
    start, end = rng.integers(0, 256, 3).astype(np.float64), rng.integers(0, 256, 3).astype(np.float64)
    a, b = rng.integers(-4, 5, 2)
    t = (a * yy + b * xx - min(a, 0) - min(b, 0)) / max(abs(a) + abs(b), 1)
    image = start + (end - start) * t
    image = image + _upsample(rng.integers(-60, 61, (5, 6, 3)).astype(np.float64), height, width)
    y = np.arange(height, dtype=np.float64)[:, None]
    x = np.arange(width, dtype=np.float64)[None, :]
    for _ in range(int(rng.integers(3, 7))):
        colour = rng.integers(0, 256, 3).astype(np.float64)
        cy, cx = rng.integers(0, height), rng.integers(0, width)
        ry, rx = rng.integers(height // 10 + 2, height // 3 + 3), rng.integers(width // 10 + 2, width // 3 + 3)
        if rng.integers(0, 2):
            mask = ((y - cy) * (y - cy)) / (ry * ry) + ((x - cx) * (x - cx)) / (rx * rx) <= 1
        else:
            mask = (abs(y - cy) <= ry) & (abs(x - cx) <= rx)
        image[mask] = colour
    image = image + rng.integers(-12, 13, (height, width, 3))
    return np.clip(np.floor(image + 0.5), 0, 255).astype(np.uint8)


def make_images(seed: int = IMAGES_SEED) -> list[np.ndarray]:
    return [make_image(i, h, w, seed) for i, (h, w) in enumerate(IMAGE_SIZES)]


CAPTIONS = [
    "a photo of a red circle on a blue background",
    "a green square",
    "an orange sky over the sea at dusk",
    "a small blue triangle",
    "a photo of a cat, sitting on a chair!",
    "the quick brown fox jumps over the lazy dog",
    " ".join(["a long caption that runs past the seventy seven tokens of the text model"] * 8),
    "a grey square on a white background",
]


def covariance_pair(kind: str, seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(mu1, sigma1, mu2, sigma2) of two seeded feature sets: 'well_conditioned' (64 dimensions, 600 samples
    each) or 'rank_deficient' (256 dimensions, 10 samples each: covariances of rank 9, as FID of few images)."""
    rng = np.random.default_rng([seed, 0 if kind == "well_conditioned" else 1])
    dims, count = (64, 600) if kind == "well_conditioned" else (256, 10)
    mixing = rng.standard_normal((dims, dims)) / np.sqrt(dims)
    a = rng.standard_normal((count, dims)) @ mixing
    b = rng.standard_normal((count, dims)) @ (mixing + 0.3 * rng.standard_normal((dims, dims)) / np.sqrt(dims)) + 0.2
    return a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)
