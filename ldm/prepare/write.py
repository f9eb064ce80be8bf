"""Writing shards in the production format: `caption \\t <key> \\t base64(image bytes)` per line."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import tarfile

import pybase64
from PIL import Image


def encode_image(image: Image.Image, fmt: str = "JPEG", **save_args) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save_args)
    return out.getvalue()


def record_line(caption: str, image_bytes: bytes, key: str = "_", meta: dict | None = None) -> bytes:
    """A text record; `meta` (a JSON object: the source's metadata) becomes its fourth column."""
    caption = " ".join(caption.split())  # tabs and newlines would break the line format
    fields = [caption.encode("utf-8"), key.encode("utf-8"), pybase64.b64encode(image_bytes)]
    if meta:
        fields.append(json.dumps(meta, separators=(",", ":"), default=str).encode())  # escapes tabs and newlines
    return b"\t".join(fields) + b"\n"


def write_webdataset(path: str, samples) -> None:
    """A WebDataset tar in img2dataset's layout: `KEY.jpg`, `KEY.txt`, `KEY.json` per (key, caption, jpeg, meta)
    (benchmarks and tests; img2dataset writes the real ones)."""
    with tarfile.open(path, "w") as tar:
        for key, caption, image, meta in samples:
            for ext, data in (("jpg", image), ("txt", caption.encode("utf-8")), ("json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_img2dataset_parquet(path: str, samples, row_group_rows: int = 1000) -> None:
    """A parquet in img2dataset's `parquet` output layout (metadata columns, `caption`, `key`, `status`, `jpg`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**meta, "caption": caption, "key": key, "status": "success", "jpg": image}
            for key, caption, image, meta in samples]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_rows)


class ShardWriter:
    """Writes records into numbered gzip shards of `records_per_shard` lines, and their filelists.

    `close()` writes `<folder>/<name>.filelist` (shard paths relative to it) and
    `<folder>/<name>.filelist.list`, and returns the path of the latter.
    """

    def __init__(self, folder: str, name: str = "train", records_per_shard: int = 1000, compresslevel: int = 6):
        self.made_folder = not os.path.isdir(folder)
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

    @staticmethod
    def outputs_in(folder: str, name: str) -> list[str]:
        """Files of `folder` a writer of corpus `name` writes: its shards and its two file lists."""
        if not os.path.isdir(folder):
            return []
        pattern = re.compile(rf"^{re.escape(name)}(-\d{{5,}}\.gz|\.filelist|\.filelist\.list)$")
        return sorted(os.path.join(folder, n) for n in os.listdir(folder) if pattern.match(n))

    def discard(self) -> None:
        """Remove what this writer wrote (and its folder, if it made it and it is empty)."""
        self._close_shard()
        for path in self.shards:
            if os.path.exists(path):
                os.remove(path)
        self.shards = []
        if self.made_folder and not os.listdir(self.folder):
            os.rmdir(self.folder)

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
