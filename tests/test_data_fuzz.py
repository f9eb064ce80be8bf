"""Fuzzing the data path: thousands of mutated records through `python -m ldm.prepare stats` and the loader.

The corpus is generated from one seed: bit flips, truncations, deleted columns, random bytes, PNG and
JPEG headers before garbage, 1 MB captions, decompression bombs, invalid UTF-8, empty and tab-only
lines, NUL bytes, and valid records between them; spread over gzip shards, one of them truncated and
one holding a gzip bomb (a line that inflates past the reader's line limit). Every generated line
has the outcomes its construction allows ("ok", a skip reason, or any for bit flips); a reference
decode in this process must agree with them, and both the stats tool and the loader workers must
count exactly what the reference decode counts, without crashing, hanging or losing a record.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pybase64
import pytest
from conftest import ROOT
from corpus import GOOD_KINDS, bomb_png, image_bytes
from PIL import Image

from ldm.data.dataset import CaptionImageStream, StreamState, build_dataloader
from ldm.data.filelist import read_file_list
from ldm.data.plan import slot_units
from ldm.data.record import REASONS, ImageTransform, SkipRecord, parse_record, sample_rng
from ldm.data.shard import CHUNK, MAX_LINE_BYTES
from ldm.data.tokenize import CaptionTokenizer, load_tokenizer
from ldm.data.watchdog import raise_if_error
from ldm.prepare.write import encode_image
from ldm.runtime.compat import stop_loader

SEED = 20251123
FUZZ_LINES = 2600
RESOLUTION = 32
WORKERS = 2
SHARD_ERRORS = ("truncated_shard", "line_too_long", "unreadable_shard")
NOT_OK = frozenset(REASONS)  # any skip reason
ANY = frozenset(REASONS) | {"ok"}
WORDS = ("a", "photo", "of", "the", "red", "green", "blue", "circle", "square", "on", "background", "café", "中文",
         "🙂", "x" * 40)


@dataclass
class FuzzShard:
    name: str
    lines: list[bytes] = field(default_factory=list)  # as the reader returns them (complete lines only)
    allowed: list[frozenset] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    error: str | None = None  # the shard error the reader counts after the last line
    outcomes: list[str] = field(default_factory=list)  # filled by the reference decode


# -- images ----------------------------------------------------------------------------------------
def jpeg_bomb(width: int, height: int) -> bytes:
    """A tiny baseline JPEG whose frame header (SOF0) declares width x height."""
    jpeg = bytearray(encode_image(Image.new("RGB", (8, 8), (90, 30, 200)), "JPEG"))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(jpeg)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def valid_bilevel_png(side: int) -> bytes:
    """A complete, valid 1-bit PNG of side x side pixels: small on disk, huge once decoded."""
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    row = b"\x00" * (1 + (side + 7) // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row * 1000) for _ in range(side // 1000)) + packer.compress(row * (side % 1000))
    idat += packer.flush()
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def png_with_header_then_garbage(rng: random.Random, width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + rng.randbytes(rng.randint(0, 3000))


class Generator:
    """Mutated and valid records, all drawn from one `random.Random`."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.pool = [image_bytes(kind, seed=i, size=(24 + 9 * i, 20 + 5 * i)) for i, kind in
                     enumerate(GOOD_KINDS * 2)]
        jpeg = image_bytes("jpeg", size=(64, 48))
        self.jpeg_head = jpeg[:jpeg.index(b"\xff\xda") + 14]  # everything up to the entropy-coded data
        self.bombs = [
            bomb_png(30000), bomb_png(10000),  # 900 M pixels (Pillow's error), 100 M (Pillow's warning)
            bomb_png(65535),
            jpeg_bomb(30000, 30000), jpeg_bomb(10000, 10000), jpeg_bomb(65535, 65535),
            valid_bilevel_png(20000), valid_bilevel_png(10000),
        ]
        self.big_under_limit = png_with_header_then_garbage(random.Random(1), 9000, 9000)  # 81 M pixels, no data

    # -- pieces
    def caption(self) -> bytes:
        words = [self.rng.choice(WORDS) for _ in range(self.rng.randint(0, 12))]
        return " ".join(words).encode("utf-8")

    def key(self) -> bytes:
        return b"%09d" % self.rng.randrange(10**9)

    def line(self, image: bytes, caption: bytes | None = None) -> bytes:
        return b"\t".join((self.caption() if caption is None else caption, self.key(), pybase64.b64encode(image)))

    def valid(self) -> bytes:
        return self.line(self.rng.choice(self.pool))

    def invalid_utf8(self) -> bytes:
        bad = self.rng.choice([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\x80abc", b"\xf8\x88\x80\x80\x80",
                               b"\xf4\x90\x80\x80"])
        words = self.caption()
        cut = self.rng.randint(0, len(words))
        return words[:cut] + bad + words[cut:]

    # -- kinds: (name, weight, make -> (line, allowed outcomes))
    def kinds(self):
        rng = self.rng
        return [
            ("valid", 14, lambda: (self.valid(), {"ok"})),
            ("valid_extra_columns", 1, lambda: (self.valid() + b"\textra\t\tmore", {"ok"})),
            ("valid_crlf", 1, lambda: (self.valid() + b"\r", {"ok"})),
            ("valid_nul_caption", 1, lambda: (self.line(rng.choice(self.pool), b"a\x00photo\x00"), {"ok"})),
            ("bit_flips", 16, self.bit_flips),
            ("truncated", 8, self.truncated),
            ("image_bit_flips", 12, self.image_bit_flips),
            ("image_truncated", 6, self.image_truncated),
            ("deleted_columns", 5, self.deleted_columns),
            ("random_bytes", 7, lambda: (self.line(rng.randbytes(rng.randint(1, 4000))), NOT_OK)),
            ("png_magic_garbage", 3, lambda: (self.line(b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randint(0, 3000))),
                                              {"bad_image"})),
            ("png_header_garbage", 3, lambda: (
                self.line(png_with_header_then_garbage(rng, rng.randint(1, 3000), rng.randint(1, 3000))),
                {"bad_image"})),
            ("jpeg_magic_garbage", 3, lambda: (self.line(b"\xff\xd8\xff" + rng.randbytes(rng.randint(0, 3000))),
                                               NOT_OK)),
            ("jpeg_header_garbage", 3, lambda: (self.line(self.jpeg_head + rng.randbytes(rng.randint(0, 3000))),
                                                ANY)),
            ("bomb", 2, lambda: (self.line(rng.choice(self.bombs)), {"too_large"})),
            ("big_header_no_data", 1, lambda: (self.line(self.big_under_limit), {"bad_image"})),
            ("invalid_utf8_caption", 4, lambda: (self.line(rng.choice(self.pool), self.invalid_utf8()),
                                                 {"bad_caption"})),
            ("empty_line", 2, lambda: (b"", {"missing_columns"})),
            ("tabs_only", 2, self.tabs_only),
            ("nul_bytes", 3, self.nul_bytes),
            ("bad_base64", 2, self.bad_base64),
            ("empty_payload", 1, lambda: (self.caption() + b"\t_\t" + b" " * rng.randint(0, 3), {"empty_image"})),
        ]

    def bit_flips(self):
        line = bytearray(self.valid())
        for _ in range(self.rng.randint(1, 8)):
            while True:
                pos, bit = self.rng.randrange(len(line)), 1 << self.rng.randrange(8)
                if line[pos] ^ bit != ord("\n"):  # a newline would make two records of one
                    line[pos] ^= bit
                    break
        return bytes(line), ANY

    def truncated(self):
        line = self.valid()
        cut = self.rng.randrange(len(line))
        # cut before the last quarter, the image (or more) is missing a quarter of its bytes
        return line[:cut], NOT_OK if cut < len(line) * 3 // 4 else ANY

    def image_bit_flips(self):
        image = bytearray(self.rng.choice(self.pool))
        for _ in range(self.rng.randint(1, 16)):
            image[self.rng.randrange(len(image))] ^= 1 << self.rng.randrange(8)
        return self.line(bytes(image)), ANY

    def image_truncated(self):
        image = self.rng.choice(self.pool)
        cut = self.rng.randrange(len(image))
        return self.line(image[:cut]), NOT_OK if cut < len(image) * 3 // 4 else ANY

    def deleted_columns(self):
        fields = self.valid().split(b"\t")
        for _ in range(self.rng.randint(1, 2)):
            del fields[self.rng.randrange(len(fields))]
        return b"\t".join(fields), {"missing_columns"}

    def tabs_only(self):
        n = self.rng.randint(1, 6)
        return b"\t" * n, {"missing_columns"} if n == 1 else {"empty_image"}

    def nul_bytes(self):
        choice = self.rng.randrange(3)
        if choice == 0:
            return b"\x00" * self.rng.randint(1, 50), {"missing_columns"}
        line = bytearray(self.valid())
        if choice == 1:  # a NUL in the base64 payload
            start = line.rindex(b"\t") + 1
            line[self.rng.randrange(start, len(line))] = 0
            return bytes(line), {"bad_base64"}
        line[line.index(b"\t")] = 0  # a NUL instead of the first tab
        return bytes(line), {"missing_columns"}

    def bad_base64(self):
        line = bytearray(self.valid())
        start = line.rindex(b"\t") + 1
        if self.rng.random() < 0.5:
            line[self.rng.randrange(start, len(line))] = self.rng.choice(b"!*-_.~ ")
        else:  # a payload of 4n + 1 characters decodes to no whole number of bytes
            line = line.rstrip(b"=")
            line += b"A" * ((1 - (len(line) - start)) % 4)
        return bytes(line), {"bad_base64"}

    def huge_captions(self):
        """Lines with a ~1 MB caption: valid, invalid UTF-8 at its very end, and without an image column."""
        words = b" ".join(self.rng.choice(WORDS).encode() for _ in range(200_000))[: 1 << 20]
        return [
            (self.line(self.rng.choice(self.pool), words), {"ok"}, "huge_caption"),
            (self.line(self.rng.choice(self.pool), b"\x00" + words), {"ok"}, "huge_caption"),
            (self.line(self.rng.choice(self.pool), words + b"\xff"), {"bad_caption"}, "huge_caption"),
            (words + b"\t" + self.key(), {"missing_columns"}, "huge_caption"),
        ]

    def records(self, n: int):
        kinds = self.kinds()
        names, weights = [k[0] for k in kinds], [k[1] for k in kinds]
        makers = {k[0]: k[2] for k in kinds}
        out = []
        for _ in range(n):
            name = self.rng.choices(names, weights)[0]
            line, allowed = makers[name]()
            out.append((line, frozenset(allowed), name))
        for record in self.huge_captions():  # in the part of the corpus that goes to intact shards
            out.insert(self.rng.randrange(len(out) * 3 // 4), (record[0], frozenset(record[1]), record[2]))
        return out


# -- shards ----------------------------------------------------------------------------------------
def as_read(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line  # the reader drops a CR before the newline


def fill(shard: FuzzShard, records) -> None:
    for line, allowed, kind in records:
        shard.lines.append(as_read(line))
        shard.allowed.append(allowed)
        shard.kinds.append(kind)


def write_gzip(path: str, lines: list[bytes]) -> bytes:
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.writelines(line + b"\n" for line in lines)
    with open(path, "rb") as f:
        return f.read()


def gzip_bomb(head: bytes, tail: bytes, blocks: int) -> tuple[bytes, int]:
    """One valid gzip member: head, `blocks` x 16 MB of b"A" (one line, ~16 KB each compressed), tail;
    and where the compressed blocks end.

    Each block is compressed once and repeated: after a full flush deflate starts afresh, so the
    same input gives the same bytes; the trailer is computed over the whole content.
    """
    block = b"A" * (16 << 20)
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    start = packer.compress(head) + packer.flush(zlib.Z_FULL_FLUSH)
    packed = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
    end = packer.compress(tail) + packer.flush()
    crc = zlib.crc32(head)
    for _ in range(blocks):
        crc = zlib.crc32(block, crc)
    crc = zlib.crc32(tail, crc)
    size = len(head) + blocks * len(block) + len(tail)
    data = start + packed * blocks + end[:-8] + struct.pack("<II", crc, size & 0xFFFFFFFF)
    return data, len(start) + blocks * len(packed)


def build_corpus(folder: str) -> tuple[str, list[FuzzShard]]:
    gen = Generator(SEED)
    records = gen.records(FUZZ_LINES)
    shards = []
    # six intact shards of uneven sizes
    weights = [gen.rng.uniform(1, 3) for _ in range(6)]
    intact = len(records) * 4 // 5
    bounds = [round(intact * sum(weights[:i]) / sum(weights)) for i in range(7)]
    for i in range(6):
        shard = FuzzShard(f"intact-{i}.gz")
        fill(shard, records[bounds[i]:bounds[i + 1]])
        write_gzip(os.path.join(folder, shard.name), [line for line, _, _ in records[bounds[i]:bounds[i + 1]]])
        shards.append(shard)
    rest = records[intact:]

    # a truncated gzip shard: what it holds is whatever complete lines inflate from the bytes that are left
    shard = FuzzShard("truncated.gz", error="truncated_shard")
    tail = rest[: len(rest) * 3 // 4]
    data = write_gzip(os.path.join(folder, shard.name), [line for line, _, _ in tail])
    data = data[: len(data) * 11 // 20]
    with open(os.path.join(folder, shard.name), "wb") as f:
        f.write(data)
    complete = zlib.decompressobj(31).decompress(data).count(b"\n")
    assert 0 < complete < len(tail)
    fill(shard, tail[:complete])
    shards.append(shard)

    # a gzip bomb: one gzip member in which a 640 MB line takes 650 KB, so that the first read of the
    # file holds all of it (it used to inflate as one piece, past the line limit, ~1.3 GB in memory)
    shard = FuzzShard("gzip-bomb.gz", error="line_too_long")
    before, after = rest[len(tail):][:40], rest[len(tail):][40:]
    data, bomb_end = gzip_bomb(b"".join(line + b"\n" for line, _, _ in before),
                               b"\n" + b"".join(line + b"\n" for line, _, _ in after),
                               blocks=MAX_LINE_BYTES * 5 // 2 >> 24)
    assert bomb_end < CHUNK
    with open(os.path.join(folder, shard.name), "wb") as f:
        f.write(data)
    fill(shard, before)  # the lines after the bomb are lost with the rest of the shard
    shards.append(shard)

    with open(os.path.join(folder, "fuzz.filelist"), "w") as f:
        f.writelines(s.name + "\n" for s in shards)
    listing = os.path.join(folder, "fuzz.filelist.list")
    with open(listing, "w") as f:
        f.write("fuzz.filelist\n")
    return listing, shards


def reference_outcome(transform: ImageTransform, line: bytes, path: str, number: int) -> str:
    try:
        _, data = parse_record(line)
        transform(data, sample_rng(0, 0, path, number))
    except SkipRecord as e:
        return e.reason
    return "ok"


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fuzz"))
    listing, shards = build_corpus(folder)
    transform = ImageTransform(RESOLUTION, center_crop=True)
    wrong = []
    for shard in shards:
        path = os.path.join(folder, shard.name)
        for number, (line, allowed, kind) in enumerate(zip(shard.lines, shard.allowed, shard.kinds, strict=True), 1):
            outcome = reference_outcome(transform, line, path, number)
            shard.outcomes.append(outcome)
            if outcome not in allowed:
                wrong.append(f"{shard.name}:{number} {kind}: {outcome}, expected one of {sorted(allowed)}")
    assert not wrong, "\n".join(wrong[:20])
    return listing, shards


def expected_totals(shards: list[FuzzShard]) -> tuple[Counter, Counter]:
    outcomes = Counter(o for s in shards for o in s.outcomes)
    errors = Counter(s.error for s in shards if s.error)
    return outcomes, errors


def test_the_fuzz_corpus_covers_every_reason(fuzz):
    _, shards = fuzz
    outcomes, errors = expected_totals(shards)
    kinds = Counter(k for s in shards for k in s.kinds)
    assert sum(outcomes.values()) > 2000
    assert set(outcomes) == set(REASONS) - {"too_small"} | {"ok"}, outcomes
    assert outcomes["ok"] >= 300 and kinds["huge_caption"] == 4
    assert all(kinds[k] for k in ("bit_flips", "image_bit_flips", "bomb", "jpeg_header_garbage", "empty_line"))
    assert errors == {"truncated_shard": 1, "line_too_long": 1}


# -- the stats tool ------------------------------------------------------------------------------
STATS_MEMORY_BYTES = 1 << 30  # its data segment: ~250 MB after imports; a bomb decoded or inflated goes past


def test_stats_counts_every_fuzzed_record_without_crash_or_blow_up(fuzz):
    listing, shards = fuzz
    outcomes, errors = expected_totals(shards)
    command = [sys.executable, "-m", "ldm.data", "stats", "--file_list", listing, "--json",
               "--resolution", str(RESOLUTION)]
    # the memory limit turns a blow-up into a failed run instead of a machine that swaps or an OOM kill
    if shutil.which("prlimit"):
        command = ["prlimit", f"--data={STATS_MEMORY_BYTES}", *command]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout)
    bad = stats["bad"]
    assert set(bad) <= set(REASONS), bad
    assert set(stats["shard_errors"]) <= set(SHARD_ERRORS), stats["shard_errors"]
    assert stats["records"] == stats["ok"] + sum(bad.values())
    assert stats["records"] == sum(len(s.lines) for s in shards)
    # usable: the valid records written, plus the mutated ones (bit flips...) that still decode
    known_ok = sum(a == {"ok"} for s in shards for a in s.allowed)
    maybe_ok = sum("ok" in a and a != {"ok"} for s in shards for a in s.allowed)
    assert known_ok <= stats["ok"] <= known_ok + maybe_ok
    assert stats["ok"] == outcomes["ok"]
    assert bad == {reason: n for reason, n in outcomes.items() if reason != "ok"}
    assert stats["shard_errors"] == dict(errors)
    assert stats["shards"] == len(shards) and stats["missing_shards"] == 0


# -- the loader ----------------------------------------------------------------------------------
def slot_reading(shards: list[FuzzShard], listed, slot: int, pass_index: int) -> list[FuzzShard]:
    """The shards one slot reads in a pass, in order (with shuffle_buffer 1 the records come in reading order)."""
    units = slot_units(listed, slot, WORKERS, SEED, pass_index)
    assert all(u.parts == 1 and u.copy == 0 for u in units)
    by_path = {os.path.basename(s.path): i for i, s in enumerate(listed)}
    order = {by_path[s.name]: s for s in shards}
    return [order[u.shard] for u in units]


def counted_at(shards, listed, state: dict) -> tuple[Counter, Counter]:
    """What a slot must have counted when it hands out the record its state points to: every record and
    shard error of the earlier passes, then those of this pass up to that record. Also returns the part
    counted in passes after the first."""
    slot, pass_index, unit, line = state["slot"], state["pass"], state["unit"], state["line"]
    total, later = Counter(), Counter()
    for p in range(pass_index + 1):
        reading = slot_reading(shards, listed, slot, p)
        here = Counter()
        for u, shard in enumerate(reading):
            if p == pass_index and u == unit:
                assert line <= len(shard.lines), f"read line {line} of {shard.name}, which has {len(shard.lines)}"
                assert state["pops"] == sum(len(s.lines) for s in reading[:u]) + line
                assert shard.outcomes[line - 1] == "ok", "a batch came from a record the reference decode refused"
                here.update(shard.outcomes[:line])
                break
            here.update(shard.outcomes)
            if shard.error:
                here[shard.error] += 1
        total.update(here)
        if p > 0:
            later.update(here)
    return total, later


@pytest.mark.timeout(180, method="thread")
def test_loader_workers_read_a_full_pass_of_fuzzed_records_and_count_each_once(fuzz, vocab_dir):
    listing, shards = fuzz
    outcomes, errors = expected_totals(shards)
    listed = read_file_list(listing)
    stream = CaptionImageStream(
        listed, tokenize=CaptionTokenizer(load_tokenizer(vocab_dir), 16), transform=ImageTransform(RESOLUTION),
        batch_size=1, caption_dropout_prob=0.1, seed=SEED, num_workers=WORKERS, shuffle_buffer=1,
    )
    tracker = StreamState(WORKERS)
    first_of_next_pass: dict[int, dict] = {}
    batches = 0
    iterator = iter(build_dataloader(stream, WORKERS))
    try:
        while len(first_of_next_pass) < WORKERS:
            batch = next(iterator)  # StopIteration here would be a loader that ended: the stream is endless
            raise_if_error(batch)  # a worker's exception arrives as a batch
            state = json.loads(batch["stream_state"])
            batch = tracker.update(batch)
            batches += 1
            pixels = np.asarray(batch["pixel_values"])
            assert pixels.shape == (1, 3, RESOLUTION, RESOLUTION) and pixels.dtype == np.uint8
            assert np.asarray(batch["input_ids"]).shape == (1, 16)
            # every record read so far is counted once, under the reason the reference decode gives
            expected, _ = counted_at(shards, listed, state)
            # a caption cut to the caption length is counted beside its record's outcome, not as one
            seen = Counter({k: v for k, v in state["counts"].items() if k != "truncated_captions"})
            assert seen == expected, f"slot {state['slot']} at batch {batches}"
            if state["pass"] >= 1:
                first_of_next_pass.setdefault(state["slot"], state)
    finally:
        stop_loader(iterator)

    # the first pass, whole: every record of every slot counted once, as ok or under a known reason
    first_pass = Counter()
    for state in first_of_next_pass.values():
        _, later = counted_at(shards, listed, state)
        first_pass.update(Counter(state["counts"]) - later)
        assert set(state["counts"]) <= {"ok", "truncated_captions", *REASONS, *SHARD_ERRORS}, state["counts"]
    records = sum(len(s.lines) for s in shards)
    assert first_pass["ok"] + sum(first_pass[r] for r in REASONS) == records
    assert first_pass["ok"] == outcomes["ok"]
    assert {r: first_pass[r] for r in SHARD_ERRORS if first_pass[r]} == dict(errors)
    assert batches >= outcomes["ok"]


def test_a_megabyte_caption_costs_a_worker_no_more_than_a_short_one(vocab_dir):
    """The tokenizer took 6-9 s for one 1 MB caption of these words: a stalled worker per corrupt record."""
    gen = Generator(SEED)
    line = next(line for line, allowed, _ in gen.huge_captions() if allowed == {"ok"})
    tokenize = CaptionTokenizer(load_tokenizer(vocab_dir), 16)
    start = time.perf_counter()
    caption, _ = parse_record(line)
    ids = tokenize(caption)
    assert time.perf_counter() - start < 2
    whole = line.split(b"\t")[0].decode("utf-8").strip()
    assert whole.startswith(caption)  # cut, never changed
    np.testing.assert_array_equal(ids, tokenize(whole[:1000]))  # the same tokens as any long-enough prefix
