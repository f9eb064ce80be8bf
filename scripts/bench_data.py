"""Benchmark the data path against the naive reference on LAION-like images made here.

    .venv/bin/python scripts/bench_data.py [--corpus synthetic|photos|photos-jpeg] [--num_images 300] [--folder F]
                                           [--formats] [--aspect_buckets auto]

`synthetic` (default): photo-like JPEGs (512x384 ... 1024x768, quality 90, smooth content with texture
so that they compress like photographs, ~60-120 kB). `photos`: real photographs shipped inside
installed packages (matplotlib's and scikit-learn's sample images), cut and rescaled to mixed sizes
(shorter side 216-768 px) and encoded as LAION's mix is: JPEG quality 75-95, some progressive, some
greyscale or CMYK, some PNG (with alpha or a palette). `photos-jpeg`: the same photographs in the JPEG
kinds only, as img2dataset writes LAION by default (it re-encodes every image to JPEG). `photos-256`: the same
photographs as img2dataset writes them for 256 px training (`--image_size 256 --resize_mode keep_ratio`: shorter
side 256, JPEG quality 95, its defaults). Either is written
into one gzipped shard, then `python -m ldm.prepare bench` runs on it: both loaders on one pinned core,
interleaved rounds, medians.

`--aspect_buckets auto`: the data path cropping to aspect-ratio buckets (`ldm-32layer`'s at 256 px) against the same
path cropping squares, both batching as a loader slot does, on the same shard (the cost of bucketing).

`--formats`: the same images also as a WebDataset tar and an img2dataset parquet (img2dataset's layouts: KEY.jpg,
KEY.txt, KEY.json; a `jpg` column beside the metadata), and `bench --against` the text shard for each: the data
path on the tar (then the parquet) against the data path on the base64 text shard, same images, same core.

A PNG costs both loaders the same (zlib inflate, no reduced-size decode), so the share of PNGs bounds
the ratio: in `photos`, the third of the images that are PNG take most of the decode time (docs/benchmarks.md).
"""

import argparse
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from ldm.prepare.tools import main as data_main
from ldm.prepare.write import ShardWriter, encode_image, record_line, write_img2dataset_parquet, write_webdataset
from ldm.runtime.cli import ToolParser


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


def package_photos() -> list[Image.Image]:
    """The real photographs that installed packages ship (offline: nothing is downloaded)."""
    import importlib.util

    found = []
    for package, relative in (("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
                              ("sklearn", "datasets/images/china.jpg"), ("sklearn", "datasets/images/flower.jpg")):
        spec = importlib.util.find_spec(package)
        if spec and spec.submodule_search_locations:
            path = os.path.join(spec.submodule_search_locations[0], relative)
            if os.path.isfile(path):
                found.append(Image.open(path).convert("RGB"))
    if not found:
        raise SystemExit("error: no sample photographs found (matplotlib or scikit-learn is needed)")
    return found


PHOTO_KINDS = ("jpeg", "jpeg", "jpeg", "progressive", "grey", "cmyk", "png", "png_alpha", "palette")
JPEG_KINDS = tuple(kind for kind in PHOTO_KINDS if kind not in ("png", "png_alpha", "palette"))


def photo_variant(photos: list[Image.Image], rng: np.random.Generator, kinds: tuple[str, ...] = PHOTO_KINDS) -> bytes:
    """One LAION-like record image: a crop of a real photograph at a mixed size and encoding."""
    photo = photos[int(rng.integers(len(photos)))]
    width, height = photo.size
    crop_w, crop_h = int(width * rng.uniform(0.5, 1.0)), int(height * rng.uniform(0.5, 1.0))
    left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
    image = photo.crop((left, top, left + crop_w, top + crop_h))
    short = int(rng.integers(216, 769))
    scale = short / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
    kind = rng.choice(kinds)
    quality = int(rng.integers(75, 96))
    if kind == "progressive":
        return encode_image(image, "JPEG", quality=quality, progressive=True)
    if kind == "grey":
        return encode_image(image.convert("L"), "JPEG", quality=quality)
    if kind == "cmyk":
        return encode_image(image.convert("CMYK"), "JPEG", quality=quality)
    if kind == "png_alpha":
        return encode_image(image.convert("RGBA"), "PNG")
    if kind == "palette":
        return encode_image(image.convert("P", palette=Image.Palette.ADAPTIVE), "PNG")
    return encode_image(image, "PNG" if kind == "png" else "JPEG", **({} if kind == "png" else {"quality": quality}))


def img2dataset_256(data: bytes) -> bytes:
    """An image as img2dataset writes it with --image_size 256 --resize_mode keep_ratio: shorter side 256 (area
    interpolation down), re-encoded as JPEG quality 95."""
    import io

    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = 256 / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BOX)
    return encode_image(image, "JPEG", quality=95)


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=["synthetic", "photos", "photos-jpeg", "photos-256"], default="synthetic")
    parser.add_argument("--num_images", type=int, default=300)
    parser.add_argument("--folder", help="where the corpus is written (default /tmp/ldm-bench-<corpus>)")
    parser.add_argument("--formats", action="store_true",
                        help="also bench a WebDataset tar and an img2dataset parquet of the same images against the "
                             "text shard")
    parser.add_argument("--aspect_buckets", default="none", help="auto or HxW,...: bench bucketed against square crops")
    args = parser.parse_args()
    folder = args.folder or f"/tmp/ldm-bench-{args.corpus}"
    listing = os.path.join(folder, "bench.filelist.list")
    if not os.path.exists(listing):
        rng = np.random.default_rng(0)
        photos = package_photos() if args.corpus.startswith("photos") else None
        kinds = JPEG_KINDS if args.corpus == "photos-jpeg" else PHOTO_KINDS
        samples = []
        with ShardWriter(folder, "bench", records_per_shard=args.num_images) as writer:
            for i in range(args.num_images):
                if args.corpus == "photos-256":
                    data = img2dataset_256(photo_variant(photos, rng, ("jpeg",)))
                elif photos:
                    data = photo_variant(photos, rng, kinds)
                else:
                    data = encode_image(photo_like(rng), "JPEG", quality=90)
                meta = {"punsafe": float(rng.random()), "AESTHETIC_SCORE": float(rng.uniform(3, 7))}
                samples.append((f"{i:09d}", f"a photo number {i}", data, meta))
                writer.write(record_line(f"a photo number {i}", data, f"{i:09d}", meta))
        write_webdataset(os.path.join(folder, "00000.tar"), samples)
        write_img2dataset_parquet(os.path.join(folder, "00000.parquet"), samples, row_group_rows=100)
        for name in ("tar", "parquet"):
            with open(os.path.join(folder, f"{name}.filelist"), "w") as f:
                f.write(f"00000.{name}\n")
            with open(os.path.join(folder, f"{name}.filelist.list"), "w") as f:
                f.write(f"{name}.filelist\n")
        sizes = [len(s[2]) for s in samples]
        print(f"wrote {args.num_images} {args.corpus} images, mean {np.mean(sizes) / 1000:.0f} kB, to {folder}")
    code = data_main(["bench", "--file_list", listing, "--num_samples", str(args.num_images),
                      "--aspect_buckets", args.aspect_buckets])
    if args.formats:
        for name in ("tar", "parquet"):
            print(f"-- {name} (reference: the data path on the same images as a base64 text shard)")
            code = code or data_main(["bench", "--file_list", os.path.join(folder, f"{name}.filelist.list"),
                                      "--against", listing, "--num_samples", str(args.num_images)])
    return code


if __name__ == "__main__":
    sys.exit(main())
