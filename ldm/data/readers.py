"""Reading any shard a filelist names, its kind told from its first bytes, never from its name.

Four kinds, mixed freely in one filelist:

- a text shard (gzip or plain): one record per line, `caption \\t key \\t base64(image)[\\t metadata JSON]`, or a
  latent record (`ldm.data.latents`); its records are the lines themselves (bytes), as the stream always read them;
- a WebDataset tar, as img2dataset's `webdataset` output writes it (`KEY.jpg`, `KEY.txt`, `KEY.json` per sample):
  read as a stream (ustar, GNU and pax headers parsed here; never whole in memory, never seeked: a remote tar
  comes through the ranged, retrying reader of `ldm.data.remote`), members grouped by key as WebDataset groups
  them (consecutive members whose paths agree up to the first dot of the file name); a gzip-compressed tar too;
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

import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ldm.data import remote
from ldm.data.shard import GZIP_MAGIC, ShardError, ShardTruncated, first_bytes, open_shard, read_lines

TAR_MAGIC_OFFSET = 257
TAR_BLOCK = 512
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


def _is_tar(head: bytes) -> bool:
    """A tar's first header, or a tar of no members (its end marker: two zero blocks, which no text shard starts
    with)."""
    return head[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + 5] == b"ustar" or head[:2 * TAR_BLOCK] == bytes(2 * TAR_BLOCK)


def kind_of(first: bytes, path: str) -> str:
    """'text', 'tar' or 'parquet' from a shard's first bytes; ShardFormatError for anything else."""
    if _is_tar(first):
        return "tar"
    if first.startswith(PARQUET_MAGIC):
        return "parquet"
    inner = _inflated_head(first) if first.startswith(GZIP_MAGIC) else first
    if first.startswith(GZIP_MAGIC) and _is_tar(inner):
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


_ZERO_BLOCK = bytes(TAR_BLOCK)
_FILE_TYPES = (b"0", b"\0", b"7")  # regular (and contiguous) files
_PAX_PATH = re.compile(rb"\d+ path=([^\n]*)\n")


def _octal(field: bytes, path: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes past 8 GB
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ShardTruncated(f"tar {path}: a garbled header (size {digits!r})") from None


def _tar_members(read, path: str) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(name, data()) for each file of an uncompressed tar stream read by `read(n)`: `data()` reads the member's
    bytes; a member whose data the caller did not ask for is skipped. ShardTruncated at a short read, a garbled
    header or a missing end marker (a tar cut at a member boundary otherwise looks whole).

    `tarfile`'s streaming mode costs ~3x this per member (it parses every field and keeps every TarInfo): ~8% of a
    sample's time on 256 px JPEGs."""
    long_name: bytes | None = None
    while True:
        try:
            block = read(TAR_BLOCK)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise TarHeaderBreak(f"tar {path}: {e}") from None
        if len(block) < TAR_BLOCK:
            raise TarHeaderBreak(f"tar {path} ends without its end marker (truncated file)" if not block else
                                 f"tar {path} ends in the middle of a header (truncated file)")
        if block == _ZERO_BLOCK:
            return
        try:
            stored = _octal(block[148:156], path)
        except ShardTruncated as e:
            raise TarHeaderBreak(str(e)) from None
        if stored != sum(block) - sum(block[148:156]) + 8 * 32:  # the checksum field counts as 8 spaces
            raise TarHeaderBreak(f"tar {path}: a header with a wrong checksum (corrupt, or not a tar)")
        size = _octal(block[124:136], path)
        padded = -(-size // TAR_BLOCK) * TAR_BLOCK
        kind = block[156:157]
        if kind in _FILE_TYPES:
            name = long_name
            if name is None:
                name = block[:100].split(b"\0", 1)[0]
                prefix = block[345:500].split(b"\0", 1)[0] if block[257:262] == b"ustar" else b""
                if prefix:
                    name = prefix + b"/" + name
            long_name = None
            taken = []

            def data(size=size, taken=taken) -> bytes:
                taken.append(size)
                return _read_exact(read, size, path)

            yield name.decode("utf-8", "surrogateescape"), data
            if taken:  # the member's data was read whole: a break in its padding is a break before the next header
                try:
                    _skip(read, padded - size, path)
                except ShardTruncated as e:
                    raise TarHeaderBreak(str(e)) from None
            else:
                _skip(read, padded, path)
            continue
        try:  # a long name or pax record: it belongs to the next member, so the members before it are whole
            content = _read_exact(read, padded, path)[:size]
        except ShardTruncated as e:
            raise TarHeaderBreak(str(e)) from None
        if kind == b"L":  # GNU long name of the next member
            long_name = content.split(b"\0", 1)[0]
        elif kind == b"x":  # pax header of the next member: its path, if it has one
            match = _PAX_PATH.search(content)
            if match:
                long_name = match.group(1)
        # directories, links, global pax headers: nothing to take


class TarHeaderBreak(ShardTruncated):
    """A tar breaks where a header should be: every member before it was read whole."""


def _read_exact(read, size: int, path: str) -> bytes:
    data = read(size)
    if len(data) < size:
        raise ShardTruncated(f"tar {path}: unexpected end of data (truncated file)")
    return data


def _skip(read, size: int, path: str) -> None:
    while size > 0:
        got = len(read(min(size, 1 << 20)))
        if not got:
            raise ShardTruncated(f"tar {path}: unexpected end of data (truncated file)")
        size -= got


def _tar_groups(f, path: str, want: Callable[[int], bool]) -> Iterator[tuple[int, str, dict[str, bytes] | None]]:
    """(number, key, {extension: bytes} or None when not wanted) for each sample of a tar stream (gzip or not).

    A member whose extension the sample being grouped has already starts a new sample of the same key (two
    adjacent samples written under one key are two records, not one carrying the second's files). Where the tar
    breaks: at a header, the sample being grouped is kept (its members were read whole; a missing caption or
    image is then counted as for any sample); inside a member's data, that sample is incomplete and dropped, and
    the break is counted for the shard (`truncated_shard`)."""
    stream = io.BufferedReader(f, 1 << 20)
    read = stream.read
    if stream.peek(2)[:2] == GZIP_MAGIC:
        read = gzip.GzipFile(fileobj=stream).read
    number, key, files, wanted, exts = 0, None, {}, False, set()
    try:
        for name, data in _tar_members(read, path):
            match = _KEY_EXT.match(name)
            if match is None:  # no extension: WebDataset skips it too
                continue
            member_key, ext = match.group(1), match.group(2).lower()
            if member_key != key or ext in exts:
                if key is not None:
                    yield number, key, files if wanted else None
                number, key, files, exts = number + 1, member_key, {}, set()
                wanted = want(number)
            exts.add(ext)
            if wanted:
                files[ext] = data()
    except TarHeaderBreak as e:
        if key is not None:
            yield number, key, files if wanted else None
        raise ShardTruncated(f"{e}, after sample {number}") from None
    except ShardTruncated as e:
        raise ShardTruncated(f"{e}, after sample {max(0, number - 1)}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ShardTruncated(f"tar {path}: {e}, after sample {max(0, number - 1)}") from None
    if key is not None:
        yield number, key, files if wanted else None


def tar_records(f, path: str, want: Callable[[int], bool]) -> Iterator[tuple[int, Sample]]:
    for number, key, files in _tar_groups(f, path, want):
        if files is not None:
            yield number, tar_sample(key, files)


# -- parquet -------------------------------------------------------------------------------------
def open_parquet(path: str):
    """A `pyarrow.parquet.ParquetFile` of a local path or URL (the retrying reader of `ldm.data.remote`: ranged
    reads of the footer and of the row groups, each retried where it broke); ShardError when it cannot be read as
    a parquet."""
    import pyarrow.parquet as pq

    try:
        if not remote.is_url(path):
            return pq.ParquetFile(path)
        return pq.ParquetFile(remote.open_url(path))
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


def leading_bytes(f: BinaryIO, path: str) -> bytes:
    """The first chunk of an open shard, topped up to the end of a tar's end marker when it is shorter (a remote
    stream's first read can be): what `kind_of` tells the kind from."""
    first = first_bytes(f, path)
    if len(first) < 2 * TAR_BLOCK and not first.startswith((GZIP_MAGIC, PARQUET_MAGIC)):
        first += f.read(2 * TAR_BLOCK - len(first)) or b""
    return first


def iter_records(path: str, want: Callable[[int], bool] | None = None) -> Iterator[tuple[int, bytes | Sample]]:
    """(number from 1, record) for the records `want` takes (default all) of a shard of any kind: a text shard's
    records are its lines (bytes), a tar's and a parquet's are `Sample`s. ShardError subclasses as `iter_lines`
    raises them, and ShardFormatError for a file of another kind."""
    want = want or _all
    with open_shard(path) as f:
        first = leading_bytes(f, path)
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
        first = leading_bytes(f, path)
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
        return kind_of(leading_bytes(f, path), path)


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
