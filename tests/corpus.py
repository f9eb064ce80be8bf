"""Real shards for the tests: real JPEG/PNG bytes in every mode, and every kind of bad record."""

from __future__ import annotations

import gzip
import io
import os
import struct
import zlib

import numpy as np
import pybase64
from PIL import Image

from ldm.prepare.write import ShardWriter, encode_image, record_line


def photo(width: int = 320, height: int = 240, seed: int = 0) -> Image.Image:
    """A smooth, photo-like RGB image (gradients plus noise) of the given size."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    image = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(image, "RGB")


def image_bytes(kind: str, seed: int = 0, size: tuple[int, int] = (320, 240)) -> bytes:
    im = photo(*size, seed=seed)
    if kind == "jpeg":
        return encode_image(im, "JPEG", quality=85)
    if kind == "progressive":
        return encode_image(im, "JPEG", quality=85, progressive=True)
    if kind == "png":
        return encode_image(im, "PNG")
    if kind == "rgba":
        rgba = im.convert("RGBA")
        rgba.putalpha(128)
        return encode_image(rgba, "PNG")
    if kind == "gray":
        return encode_image(im.convert("L"), "JPEG")
    if kind == "cmyk":
        return encode_image(im.convert("CMYK"), "JPEG")
    if kind == "palette":
        return encode_image(im.convert("P"), "PNG")
    if kind == "gray16":
        values = (np.asarray(im.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
        return encode_image(Image.fromarray(values), "PNG")
    raise ValueError(kind)


GOOD_KINDS = ("jpeg", "progressive", "png", "rgba", "gray", "cmyk", "palette", "gray16")


def bomb_png(side: int = 20000) -> bytes:
    """A tiny PNG whose header declares side x side pixels (a decompression bomb)."""
    png = bytearray(encode_image(Image.new("L", (1, 1)), "PNG"))
    png[16:24] = struct.pack(">II", side, side)  # IHDR width, height
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


def bad_lines() -> dict[str, bytes]:
    """One line for every reason a record is skipped, keyed by the reason."""
    jpeg = image_bytes("jpeg")
    return {
        "missing_columns": b"only a caption",
        "bad_caption": b"\xff\xfe caption\t_\t" + pybase64.b64encode(jpeg),
        "empty_image": b"empty\t_\t",
        "bad_base64": b"bad base64\t_\t@@@not base64@@@",
        "bad_image": record_line("truncated jpeg", jpeg[: len(jpeg) // 3]).rstrip(b"\n"),
        "too_large": record_line("bomb", bomb_png()).rstrip(b"\n"),
        "too_small": record_line("tiny", image_bytes("jpeg", size=(40, 30))).rstrip(b"\n"),
    }


def write_corpus(folder: str, num_records: int, records_per_shard: int, kinds=("jpeg",), bad_every: int = 0,
                 name: str = "train") -> str:
    """Shards of `num_records` good records (captions 'photo N'), with a bad line after every `bad_every`."""
    bad = list(bad_lines().values())
    with ShardWriter(folder, name, records_per_shard) as writer:
        for i in range(num_records):
            kind = kinds[i % len(kinds)]
            writer.write(record_line(f"photo {i}", image_bytes(kind, seed=i, size=(96 + i % 7, 80))))
            if bad_every and i % bad_every == bad_every - 1:
                writer.write(bad[(i // bad_every) % len(bad)] + b"\n")
    return os.path.join(folder, f"{name}.filelist.list")


def aspect_sizes(num_records: int, seed: int = 0, short_side: tuple[int, int] = (40, 90),
                 ratio: tuple[float, float] = (0.4, 2.5)) -> list[tuple[int, int]]:
    """(width, height) of `num_records` images of random aspect ratios (log-uniform in `ratio`, width / height)."""
    import math
    import random

    rng = random.Random(seed)
    sizes = []
    for _ in range(num_records):
        r = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        short = rng.randint(*short_side)
        sizes.append((round(short * r), short) if r >= 1 else (short, round(short / r)))
    return sizes


def write_aspect_corpus(folder: str, num_records: int, records_per_shard: int, seed: int = 0,
                        kinds=("jpeg", "png"), name: str = "train") -> str:
    """Shards of records whose images have random aspect ratios (captions 'photo N'), JPEG and PNG."""
    with ShardWriter(folder, name, records_per_shard) as writer:
        for i, size in enumerate(aspect_sizes(num_records, seed)):
            writer.write(record_line(f"photo {i}", image_bytes(kinds[i % len(kinds)], seed=i, size=size)))
    return os.path.join(folder, f"{name}.filelist.list")


def gzip_lines(path: str, lines: list[bytes]) -> None:
    with gzip.open(path, "wb") as f:
        f.writelines(line + b"\n" for line in lines)


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))
