"""Writing shards in the production format: `caption \\t <key> \\t base64(image bytes)` per line."""

from __future__ import annotations

import gzip
import io
import os

import pybase64
from PIL import Image


def encode_image(image: Image.Image, fmt: str = "JPEG", **save_args) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save_args)
    return out.getvalue()


def record_line(caption: str, image_bytes: bytes, key: str = "_") -> bytes:
    caption = " ".join(caption.split())  # tabs and newlines would break the line format
    return b"\t".join((caption.encode("utf-8"), key.encode("utf-8"), pybase64.b64encode(image_bytes))) + b"\n"


class ShardWriter:
    """Writes records into numbered gzip shards of `records_per_shard` lines, and their filelists.

    `close()` writes `<folder>/<name>.filelist` (shard paths relative to it) and
    `<folder>/<name>.filelist.list`, and returns the path of the latter.
    """

    def __init__(self, folder: str, name: str = "train", records_per_shard: int = 1000, compresslevel: int = 6):
        os.makedirs(folder, exist_ok=True)
        self.folder, self.name = folder, name
        self.records_per_shard, self.compresslevel = records_per_shard, compresslevel
        self.shards: list[str] = []
        self._file = None
        self._in_shard = 0

    def write(self, line: bytes) -> None:
        if self._file is None or self._in_shard == self.records_per_shard:
            self._close_shard()
            path = os.path.join(self.folder, f"{self.name}-{len(self.shards):05d}.gz")
            self._file = gzip.open(path, "wb", compresslevel=self.compresslevel)  # noqa: SIM115 - closed in _close_shard
            self.shards.append(path)
        self._file.write(line)
        self._in_shard += 1

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._in_shard = None, 0

    def close(self) -> str:
        self._close_shard()
        filelist = os.path.join(self.folder, f"{self.name}.filelist")
        with open(filelist, "w") as f:
            f.writelines(os.path.basename(p) + "\n" for p in self.shards)
        listing = filelist + ".list"
        with open(listing, "w") as f:
            f.write(os.path.basename(filelist) + "\n")
        return listing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
