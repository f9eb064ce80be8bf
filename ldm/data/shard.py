"""Opening a shard and reading its lines.

`open_shard` is the single place a shard is opened: a local path, or a URL through fsspec with retries
(`ldm.data.remote`). Lines
are read with our own decompression loop rather than `gzip.open` iteration, because the latter
drops the lines it has already decompressed when the stream turns out to be truncated; here
every complete line before the break is returned, then `ShardTruncated` is raised.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from ldm.data import remote

try:  # ISA-L inflates shard lines faster than zlib (docs/benchmarks.md)
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - isal is in the lock file
    _zlib = zlib

GZIP_MAGIC = b"\x1f\x8b"
CHUNK = 1 << 20
MAX_LINE_BYTES = 256 << 20


class ShardError(OSError):
    """A shard is missing, unreadable or corrupt."""


class ShardMissing(ShardError):
    """The shard does not exist."""


class ShardTruncated(ShardError):
    """The shard ended (or broke) in the middle of its compressed stream."""


class LineTooLong(ShardError):
    pass


def open_shard(path: str) -> BinaryIO:
    try:
        if remote.is_url(path):
            return remote.open_url(path)
        return open(path, "rb")
    except FileNotFoundError:
        raise ShardMissing(f"shard not found: {path}") from None
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
        while True:
            try:
                # Bounded output: deflate inflates up to ~1000x, so one read of a gzip bomb would
                # otherwise arrive as a single ~1 GB piece, before any line length is checked.
                out = inflater.decompress(chunk, CHUNK)
            except (zlib.error, _zlib.error) as e:
                raise ShardTruncated(f"corrupt gzip data in {path}: {e}") from None
            if out:
                yield out
            if inflater.eof:
                chunk = inflater.unused_data
                finished = True
                inflater = _zlib.decompressobj(31)
                if not chunk:
                    break
            else:
                chunk = inflater.unconsumed_tail
                finished = False
                if not chunk and len(out) < CHUNK:  # a full output may leave inflated bytes behind: ask again
                    break
    if not finished:
        raise ShardTruncated(f"gzip stream of {path} ends before its end marker (truncated file)")


def first_bytes(f: BinaryIO, path: str) -> bytes:
    """The first chunk of an open shard (at least 2 bytes unless shorter): what its kind is told from."""
    first = next(_raw_chunks(f, path), b"")  # no seek back: a remote stream may not have one
    if len(first) == 1:
        first += next(_raw_chunks(f, path), b"")
    return first


def iter_lines(path: str) -> Iterator[bytes]:
    """Yield the lines of a gzip or plain-text shard without their line ending.

    The format is detected from the first bytes, never from the name. A final line without a
    newline is kept in a plain file and in a gzip stream that ends cleanly, and dropped when the
    gzip stream is truncated (it is then incomplete).
    """
    with open_shard(path) as f:
        yield from read_lines(first_bytes(f, path), f, path)


def read_lines(first: bytes, f: BinaryIO, path: str) -> Iterator[bytes]:
    """The lines of an open text shard whose first chunk, `first`, was already read from `f`."""
    chunks = itertools.chain([first] if first else [], _raw_chunks(f, path))
    if first[:2] == GZIP_MAGIC:
        chunks = _inflate(chunks, path)
    # The pieces of the unfinished line, joined once at its end: re-joining (and re-splitting) it
    # at every chunk made a line over N chunks cost N^2 / 2 chunk copies (docs/benchmarks.md).
    pending: list[bytes] = []
    pending_size = 0
    for chunk in chunks:
        if b"\n" not in chunk:
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size > MAX_LINE_BYTES:
                raise LineTooLong(f"a line of {path} exceeds {MAX_LINE_BYTES} bytes")
            continue
        lines = chunk.split(b"\n")
        if pending:
            lines[0] = b"".join([*pending, lines[0]])
        last = lines.pop()
        pending, pending_size = ([last], len(last)) if last else ([], 0)
        for line in lines:
            yield line[:-1] if line.endswith(b"\r") else line
    if pending:
        line = b"".join(pending)
        yield line[:-1] if line.endswith(b"\r") else line
