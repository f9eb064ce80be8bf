"""Opening a shard and reading its lines.

`open_shard` is the single place a shard is opened: an fsspec URL would be added there. Lines
are read with our own decompression loop rather than `gzip.open` iteration, because the latter
drops the lines it has already decompressed when the stream turns out to be truncated; here
every complete line before the break is returned, then `ShardTruncated` is raised.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import BinaryIO

try:  # ISA-L inflate is ~1.8x faster than zlib on shard lines (see PERFORMANCE.md)
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - isal is in the lock file
    _zlib = zlib

GZIP_MAGIC = b"\x1f\x8b"
CHUNK = 1 << 20
MAX_LINE_BYTES = 256 << 20


class ShardError(OSError):
    """A shard is missing, unreadable or corrupt."""


class ShardTruncated(ShardError):
    """The shard ended (or broke) in the middle of its compressed stream."""


class LineTooLong(ShardError):
    pass


def open_shard(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise ShardError(f"shard not found: {path}") from None
    except OSError as e:
        raise ShardError(f"cannot open shard {path}: {e.strerror or e}") from None


def _raw_chunks(f: BinaryIO, path: str) -> Iterator[bytes]:
    while True:
        try:
            chunk = f.read(CHUNK)
        except OSError as e:
            raise ShardError(f"read error in {path}: {e}") from None
        if not chunk:
            return
        yield chunk


def _inflate(chunks: Iterator[bytes], path: str) -> Iterator[bytes]:
    """Decompress a (possibly multi-member) gzip stream, raising ShardTruncated at a break."""
    inflater = _zlib.decompressobj(31)
    finished = False
    for chunk in chunks:
        while chunk:
            try:
                out = inflater.decompress(chunk)
            except (zlib.error, _zlib.error) as e:
                raise ShardTruncated(f"corrupt gzip data in {path}: {e}") from None
            if out:
                yield out
            if inflater.eof:
                chunk = inflater.unused_data
                finished = True
                inflater = _zlib.decompressobj(31)
            else:
                chunk = b""
                finished = False
    if not finished:
        raise ShardTruncated(f"gzip stream of {path} ends before its end marker (truncated file)")


def iter_lines(path: str) -> Iterator[bytes]:
    """Yield the lines of a gzip or plain-text shard without their line ending.

    The format is detected from the first bytes, never from the name. A final line without a
    newline is kept in a plain file and in a gzip stream that ends cleanly, and dropped when the
    gzip stream is truncated (it is then incomplete).
    """
    with open_shard(path) as f:
        head = f.read(2)
        f.seek(0)
        chunks = _raw_chunks(f, path)
        if head == GZIP_MAGIC:
            chunks = _inflate(chunks, path)
        pending = b""
        for chunk in chunks:
            pending = pending + chunk if pending else chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line[:-1] if line.endswith(b"\r") else line
            if len(pending) > MAX_LINE_BYTES:
                raise LineTooLong(f"a line of {path} exceeds {MAX_LINE_BYTES} bytes")
        if pending:
            yield pending[:-1] if pending.endswith(b"\r") else pending
