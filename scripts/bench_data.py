"""Benchmark the data path against the naive reference on LAION-like JPEGs made here.

    .venv/bin/python scripts/bench_data.py [--num_images 300] [--folder /tmp/ldm-bench]

Writes photo-like JPEGs (512x384 ... 1024x768, quality 90, smooth content with texture so that
they compress like photographs, ~60-120 kB) into one gzipped shard, then runs
`python -m ldm.data bench` on it: both loaders on one pinned core, interleaved rounds, medians.
"""

import argparse
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from ldm.args import ToolParser
from ldm.data.tools import main as data_main
from ldm.data.write import ShardWriter, encode_image, record_line


def photo_like(rng: np.random.Generator) -> Image.Image:
    width = int(rng.integers(512, 1025))
    height = int(rng.integers(384, 769))
    small = Image.fromarray(rng.integers(0, 256, (height // 32 + 2, width // 32 + 2, 3), dtype=np.uint8))
    image = small.resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(10, 120))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    texture = rng.normal(0, 2.5, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + texture, 0, 255).astype(np.uint8))


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_images", type=int, default=300)
    parser.add_argument("--folder", default="/tmp/ldm-bench")
    args = parser.parse_args()
    listing = os.path.join(args.folder, "bench.filelist.list")
    if not os.path.exists(listing):
        rng = np.random.default_rng(0)
        sizes = []
        with ShardWriter(args.folder, "bench", records_per_shard=args.num_images) as writer:
            for i in range(args.num_images):
                data = encode_image(photo_like(rng), "JPEG", quality=90)
                sizes.append(len(data))
                writer.write(record_line(f"a photo number {i}", data))
        print(f"wrote {args.num_images} JPEGs, mean {np.mean(sizes) / 1000:.0f} kB, to {args.folder}")
    return data_main(["bench", "--file_list", listing, "--num_samples", str(args.num_images)])


if __name__ == "__main__":
    sys.exit(main())
