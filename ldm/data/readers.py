"""Reading any shard a filelist names, its kind told from its first bytes, never from its name.

Four kinds, mixed freely in one filelist:

- a text shard (gzip or plain): one record per line, `caption \\t key \\t base64(image)[\\t metadata JSON]`, or a
  latent record (`ldm.data.latents`); its records are the lines themselves (bytes), as the stream always read them;
- a WebDataset tar, as img2dataset's `webdataset` output writes it (`KEY.jpg`, `KEY.txt`, `KEY.json` per sample):
  read as a stream (`tarfile` mode `r|*`, never whole in memory, never seeked: a remote tar comes through the
  ranged, retrying reader of `ldm.data.remote`), members grouped by key as WebDataset groups them (consecutive
  members whose paths agree up to the first dot of the file name); a gzip-compressed tar too;
- an img2dataset parquet (its `parquet` output): image bytes in a `jpg` (or `png`/`webp`/`image`) column beside
  `caption`, `status` and the metadata columns, read batch by batch with pyarrow;
- anything else (a zip, an HTML error page saved as `.gz`, a parquet without images such as img2dataset's URL
  list) raises `ShardFormatError`, which names what the file is, and the stream counts as `unknown_format`.

Records are numbered from 1 in file order for every kind (a tar's samples, a parquet's rows), so that a slot's
share of a shard (`ldm.data.plan.Unit.owns`) and a saved position (unit, record number) mean the same for all.
`want(number)` says which records the caller takes: the others are not decoded (a tar member's bytes are skipped,
a parquet's unwanted rows never become Python objects), so resuming after record N re-reads the shard's bytes up
to N but builds nothing from them.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ldm.data import remote
from ldm.data.shard import GZIP_MAGIC, ShardError, ShardTruncated, first_bytes, open_shard, read_lines

TAR_MAGIC_OFFSET = 257
PARQUET_MAGIC = b"PAR1"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # a sample's image member / a parquet's image column, in order
PARQUET_IMAGE_COLUMNS = (*IMAGE_EXTENSIONS, "image")
CAPTION_COLUMNS = ("caption", "text", "TEXT", "txt")
PARQUET_BATCH_ROWS = 64
# WebDataset's own split of a member name into (key, extension): the key is the path up to the first dot of the
# file name (webdataset.tariterators.base_plus_ext)
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")

FOREIGN = (  # magic bytes of files that are no shard, for the message
    (b"PK\x03\x04", "a zip archive"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"%PDF", "a PDF document"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"BZh", "a bzip2 file"),
    (b"\xfd7zXZ", "an xz file"),
    (b"7z\xbc\xaf", "a 7z archive"),
    (b"\x28\xb5\x2f\xfd", "a zstd file"),
)
MARKUP = (b"<!doctype", b"<html", b"<?xml", b"<head", b"<body", b"<error")


class ShardFormatError(ShardError):
    """The file is not a shard of any kind this reads (or a parquet without images)."""


class Sample:
    """One record of a tar or parquet shard: caption (None when it has none), image bytes (None when none),
    img2dataset's `status` (None when the source has none) and the metadata (the sample's `.json`, the row's
    other columns; None when the `.json` is not a JSON object)."""

    __slots__ = ("key", "caption", "image", "status", "meta")

    def __init__(self, key: str, caption: str | None, image: bytes | None, status: str | None,
                 meta: dict[str, Any] | None):
        self.key, self.caption, self.image, self.status, self.meta = key, caption, image, status, meta

    def __repr__(self) -> str:
        image = f"{len(self.image)} bytes" if self.image is not None else None
        return f"Sample({self.key!r}, caption={self.caption!r}, image={image}, status={self.status!r})"


# -- kinds ---------------------------------------------------------------------------------------
def _foreign(data: bytes) -> str | None:
    for magic, what in FOREIGN:
        if data.startswith(magic):
            return what
    head = data[:256].lstrip().lower()
    if head.startswith(MARKUP):
        return "an HTML/XML page (an error page saved in place of the shard?)"
    if head.startswith((b"{", b"[")) and b"\t" not in data:
        return "a JSON file (img2dataset's _stats.json?)"
    return None


def _inflated_head(first: bytes) -> bytes:
    try:
        return zlib.decompressobj(31).decompress(first, 1 << 16)
    except zlib.error:
        return b""  # corrupt from the start: the text reader says so where it reads it


def kind_of(first: bytes, path: str) -> str:
    """'text', 'tar' or 'parquet' from a shard's first bytes; ShardFormatError for anything else."""
    if first[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + 5] == b"ustar":
        return "tar"
    if first.startswith(PARQUET_MAGIC):
        return "parquet"
    inner = _inflated_head(first) if first.startswith(GZIP_MAGIC) else first
    if first.startswith(GZIP_MAGIC) and inner[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + 5] == b"ustar":
        return "tar"
    what = _foreign(inner)
    if what:
        packed = " inside gzip" if inner is not first else ""
        raise ShardFormatError(f"{path} is {what}{packed}, not a shard (text, latent, WebDataset tar or "
                               "img2dataset parquet)")
    return "text"


class _Prefixed(io.RawIOBase):
    """An open stream whose first bytes were already read: they come first again (no seek back needed)."""

    def __init__(self, first: bytes, f: BinaryIO):
        self.first, self.f = first, f

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.first:
            n = min(len(buffer), len(self.first))
            buffer[:n] = self.first[:n]
            self.first = self.first[n:]
            return n
        data = self.f.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


# -- tar -----------------------------------------------------------------------------------------
def _caption(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def tar_sample(key: str, files: dict[str, bytes]) -> Sample:
    meta: dict | None = {}
    if "json" in files:
        try:
            meta = json.loads(files["json"])
        except ValueError:
            meta = None
        if not isinstance(meta, dict):
            meta = None
    caption = _caption(files.get("txt"))
    if caption is None and meta:
        caption = next((meta[c] for c in CAPTION_COLUMNS if isinstance(meta.get(c), str)), None)
    image = next((files[e] for e in IMAGE_EXTENSIONS if e in files), None)
    status = meta.get("status") if meta else None
    return Sample(key, caption, image, status if isinstance(status, str) else None, meta)


class _TarInfo(tarfile.TarInfo):
    """Notes whether the archive ended with its end marker (a zero block): a tar cut at a member boundary, or with
    a garbled header, otherwise ends like a whole one in `tarfile`'s streaming mode."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:
            tar.ldm_end_marker = True
            raise


def _tar_groups(f, path: str, want: Callable[[int], bool]) -> Iterator[tuple[int, str, dict[str, bytes] | None]]:
    """(number, key, {extension: bytes} or None when not wanted) for each sample of a tar stream."""
    try:
        tar = tarfile.open(fileobj=f, mode="r|*", tarinfo=_TarInfo)  # noqa: SIM115 - f is closed by the caller
        tar.ldm_end_marker = False
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise ShardTruncated(f"{path}: not a readable tar ({e})") from None
    number, key, files, wanted = 0, None, {}, False
    try:
        for member in tar:
            if not member.isfile():
                continue
            match = _KEY_EXT.match(member.name)
            if match is None:  # no extension: WebDataset skips it too
                continue
            member_key, ext = match.group(1), match.group(2).lower()
            if member_key != key:
                if key is not None:
                    yield number, key, files if wanted else None
                number, key, files = number + 1, member_key, {}
                wanted = want(number)
            if wanted:
                files[ext] = tar.extractfile(member).read()
            tar.members = []  # streaming: nothing refers back to earlier members
    except (tarfile.TarError, EOFError, zlib.error) as e:  # the sample being read when it broke is incomplete
        raise ShardTruncated(f"tar {path} breaks after sample {number - 1} ({e})") from None
    if not tar.ldm_end_marker:
        raise ShardTruncated(f"tar {path} ends after sample {number - 1} without its end marker (truncated file)")
    if key is not None:
        yield number, key, files if wanted else None


def tar_records(f, path: str, want: Callable[[int], bool]) -> Iterator[tuple[int, Sample]]:
    for number, key, files in _tar_groups(f, path, want):
        if files is not None:
            yield number, tar_sample(key, files)


# -- parquet -------------------------------------------------------------------------------------
def open_parquet(path: str):
    """A `pyarrow.parquet.ParquetFile` of a local path or URL (fsspec file object: ranged reads of the footer
    and of the row groups); ShardError when it cannot be read as a parquet."""
    import pyarrow.parquet as pq

    try:
        if not remote.is_url(path):
            return pq.ParquetFile(path)
        return pq.ParquetFile(remote._fsspec().open(path, "rb", block_size=remote.BLOCK_SIZE).open())
    except FileNotFoundError:
        raise ShardError(f"shard not found: {path}") from None
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and friends for a broken file
        raise ShardTruncated(f"parquet {path} cannot be read ({remote.describe(e)})") from None


def parquet_columns(parquet, path: str) -> tuple[str, str | None]:
    names = parquet.schema_arrow.names
    image = next((c for c in PARQUET_IMAGE_COLUMNS if c in names), None)
    if image is None:
        raise ShardFormatError(
            f"{path} is a parquet without an image column ({'/'.join(PARQUET_IMAGE_COLUMNS)}); its columns are "
            f"{', '.join(names[:12])}: a URL list or img2dataset's per-shard metadata, not its images (read the "
            ".tar files of a webdataset folder, or download with --output_format parquet)")
    return image, next((c for c in CAPTION_COLUMNS if c in names), None)


def parquet_records(path: str, want: Callable[[int], bool]) -> Iterator[tuple[int, Sample]]:
    parquet = open_parquet(path)
    image_column, caption_column = parquet_columns(parquet, path)
    number = 0
    try:
        for group in range(parquet.num_row_groups):
            rows = parquet.metadata.row_group(group).num_rows
            if not any(want(number + i + 1) for i in range(rows)):  # resuming: a row group before the position
                number += rows
                continue
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group]):
                taken = [i for i in range(batch.num_rows) if want(number + i + 1)]
                if taken:
                    part = batch if len(taken) == batch.num_rows else batch.take(taken)
                    for i, row in zip(taken, part.to_pylist(), strict=True):
                        image = row.pop(image_column)
                        caption = row.get(caption_column) if caption_column else None
                        status = row.get("status")
                        key = row.get("key")
                        yield number + i + 1, Sample(str(key) if key is not None else str(number + i + 1),
                                                     caption if isinstance(caption, str) else None,
                                                     image or None, status if isinstance(status, str) else None, row)
                number += batch.num_rows
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a corrupt page
        raise ShardTruncated(f"parquet {path} breaks after row {number} ({remote.describe(e)})") from None


# -- any kind ------------------------------------------------------------------------------------
def _all(number: int) -> bool:
    return True


def iter_records(path: str, want: Callable[[int], bool] | None = None) -> Iterator[tuple[int, bytes | Sample]]:
    """(number from 1, record) for the records `want` takes (default all) of a shard of any kind: a text shard's
    records are its lines (bytes), a tar's and a parquet's are `Sample`s. ShardError subclasses as `iter_lines`
    raises them, and ShardFormatError for a file of another kind."""
    want = want or _all
    with open_shard(path) as f:
        first = first_bytes(f, path)
        if len(first) < TAR_MAGIC_OFFSET + 8 and not first.startswith((GZIP_MAGIC, PARQUET_MAGIC)):
            more = f.read(TAR_MAGIC_OFFSET + 8)  # a tiny first chunk (a remote stream's first read)
            first += more or b""
        kind = kind_of(first, path)
        if kind == "text":
            for number, line in enumerate(read_lines(first, f, path), 1):
                if want(number):
                    yield number, line
            return
        if kind == "tar":
            yield from tar_records(_Prefixed(first, f), path, want)
            return
    yield from parquet_records(path, want)  # random access (footer first): opened again by pyarrow


def count_records(path: str) -> int:
    """How many records a shard holds (a parquet's from its footer; a tar's keys without reading their bytes)."""
    with open_shard(path) as f:
        first = first_bytes(f, path)
        kind = kind_of(first, path)
        if kind == "text":
            return sum(1 for _ in read_lines(first, f, path))
        if kind == "tar":
            return sum(1 for _ in _tar_groups(_Prefixed(first, f), path, lambda n: False))
    parquet = open_parquet(path)
    parquet_columns(parquet, path)
    return parquet.metadata.num_rows


def shard_kind(path: str) -> str:
    """'text', 'tar' or 'parquet' (ShardError when unreadable or of another kind)."""
    with open_shard(path) as f:
        return kind_of(first_bytes(f, path), path)


# -- image folders (convert) ---------------------------------------------------------------------
FOLDER_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def folder_records(folder: str) -> Iterator[tuple[str | None, tuple[str, bytes, dict] | None, str | None]]:
    """(key, (caption, image bytes, metadata), None) for every image with a `.txt` (and maybe a `.json`) beside it,
    or (None, None, problem)."""
    for root, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            stem, ext = os.path.splitext(name)
            if ext.lower() not in FOLDER_IMAGE_EXTENSIONS:
                continue
            caption_path = os.path.join(root, stem + ".txt")
            if not os.path.exists(caption_path):
                yield None, None, f"{os.path.join(root, name)}: no {stem}.txt beside it"
                continue
            with open(caption_path, encoding="utf-8") as f:
                caption = f.read().strip()
            meta: dict = {}
            json_path = os.path.join(root, stem + ".json")
            if os.path.exists(json_path):
                with open(json_path, "rb") as f:
                    try:
                        loaded = json.loads(f.read())
                    except ValueError:
                        loaded = None
                meta = loaded if isinstance(loaded, dict) else {}
            with open(os.path.join(root, name), "rb") as f:
                yield stem, (caption, f.read(), meta), None
