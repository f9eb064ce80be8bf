"""Latent shards: a corpus encoded once by the frozen autoencoder (`python -m ldm.prepare encode`).

A latent shard is a gzip text shard like an image shard, one record per line:

    caption \\t key \\t latent:<base64 of the array's bytes> \\t <meta: one-line JSON> [\\t text:<base64>]

- the array is the autoencoder's posterior for the record's crop: its moments (mean and log-variance
  concatenated on the channel axis, as `AutoencoderKL` computes them, not yet scaled by the
  config's `scaling_factor`), shape `[copies, 2 * latent_channels, R / f, R / f]`. Copy 0 is the crop;
  copy 1, written when the corpus was encoded with `--random_flip`, is its mirror image. Training
  draws a fresh posterior sample at every step, as it does from images;
- bytes are little-endian `float16`, `float32` or `bfloat16` (the upper half of each float32);
- meta: `{"format": 1, "vae": <fingerprint of the autoencoder>, "dtype": ..., "shape": [...],
  "resolution": R}`, with `"bucket": [height, width]` (the crop's size in pixels) when the corpus was encoded
  in aspect-ratio buckets (`--aspect_buckets`: the latent is then that bucket's shape, not R / f square), and
  `"metadata": {...}`, the source record's metadata, when it had some (a tar sample's
  `.json`, a parquet row's columns, a text record's fourth column: what `--metadata_filter` reads), and
  `"geometry": [[...6], ...]`, each copy's `ldm.models.conditioning.GEOMETRY` (original height and width, the crop's
  top and left in the resized image, its height and width, in pixels; the mirror copy's left edge mirrored): what
  Stable Diffusion XL's time ids and PixArt-α's resolution and aspect ratio are made of. Corpora encoded before it
  was stored lack it: they train every model that does not read it, and a model that does refuses them.

- text (`encode --text_embeddings`): the frozen text encoder's hidden states of the record's caption, shape
  `[tokens, width]` in the meta's `"text": {"encoder": <fingerprint>, "dtype": ..., "shape": [...]}` (float16 by
  default: 118 KB a record for Stable Diffusion 1.5's 77 x 768). An encoder that masks its padding (T5's) stores
  the caption's real tokens only, with `"length"`, the padded length training restores (zeros, masked). Training
  takes them instead of encoding the caption; a dropped caption gets the empty caption's states, which the run
  computes once with the same encoder (its identity is the fingerprint's).
- texts of several encoders (Stable Diffusion 3's two CLIPs and T5): the meta's `"text": {"encoders": [...]}` holds
  one entry per encoder, in the model's order, each as above with the `"part"` it is (`text_encoder_2`) and, when the
  encoder gives one, `"pooled": [width]`, its pooled vector's shape; the `text:` column holds each encoder's states
  then its pooled vector, in that order, one after the other. A run takes them only from the same encoders in the
  same order (each one's fingerprint).

The `latent:` prefix (":" is not a base64 character) tells the two kinds apart from the content. This
module reads and writes the format; it imports neither Paddle nor PaddleNLP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass

import numpy as np
import pybase64

from ldm.data.record import LATENT_PREFIX as PREFIX
from ldm.data.record import SkipRecord, decode_base64, decode_caption
from ldm.models.buckets import bucket_name
from ldm.runtime.errors import UserError

FORMAT = 1
DTYPES = ("float16", "bfloat16", "float32")
PROBED_SHARDS = 4
TEXT_PREFIX = b"text:"


class LatentMismatch(UserError, ValueError):
    """Latent shards this run cannot train on: another autoencoder, resolution or layout."""


def fingerprint(identity: dict) -> str:
    """A short name of an autoencoder (`ldm.models.autoencoder.autoencoder_identity`): config and weights."""
    text = f"{identity['config_sha256']}/{identity['weights_sha256']}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_latent_line(line: bytes) -> bool:
    """Is the third column a latent payload? (found without splitting, which would copy the payload)"""
    first = line.find(b"\t")
    second = line.find(b"\t", first + 1) if first >= 0 else -1
    return second >= 0 and line.startswith(PREFIX, second + 1)


def to_bytes(array: np.ndarray, dtype: str) -> bytes:
    """float32 array -> stored bytes (bfloat16: float32 rounded to nearest even, upper 16 bits kept)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "bfloat16":
        bits = array.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype("<u2").tobytes()
    return array.astype("<f2" if dtype == "float16" else "<f4").tobytes()


def from_bytes(data: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    """Stored bytes -> float32 array of `shape`."""
    if dtype == "bfloat16":
        array = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        array = np.frombuffer(data, "<f2" if dtype == "float16" else "<f4").astype(np.float32)
    return array.reshape(shape)


@dataclass(frozen=True)
class LatentMeta:
    vae: str
    dtype: str
    shape: tuple[int, ...]  # copies, 2 * latent channels, height, width
    resolution: int
    bucket: tuple[int, int] | None = None  # (height, width) of the crop, encoded in aspect-ratio buckets
    text: dict | None = None  # the cached text states': {"encoder": fingerprint, "dtype": ..., "shape": [L, D]}, or
    # several encoders': {"encoders": [{"part": ..., "encoder": ..., "dtype": ..., "shape": ..., "pooled": [P]}, ...]}
    geometry: tuple[tuple[int, ...], ...] | None = None  # each copy's GEOMETRY (6 pixel counts); None: not stored

    @property
    def copies(self) -> int:
        return self.shape[0]

    def to_json(self) -> bytes:
        meta = {"format": FORMAT, "vae": self.vae, "dtype": self.dtype, "shape": list(self.shape),
                "resolution": self.resolution}
        if self.bucket:
            meta["bucket"] = list(self.bucket)
        if self.text:
            meta["text"] = self.text
        if self.geometry:
            meta["geometry"] = [list(row) for row in self.geometry]
        return json.dumps(meta, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LatentMeta:
        meta = json.loads(data)
        if meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
            raise ValueError(f"unknown latent format {meta.get('format')!r} / dtype {meta.get('dtype')!r}")
        bucket = tuple(int(n) for n in meta["bucket"]) if meta.get("bucket") else None
        text = meta.get("text")
        if text is not None and not (isinstance(text, dict) and valid_text(text)):
            raise ValueError(f"unknown text states {text!r}")
        shape = tuple(int(n) for n in meta["shape"])
        geometry = meta.get("geometry")
        if geometry is not None:
            geometry = tuple(tuple(int(n) for n in row) for row in geometry)
            if len(geometry) != shape[0] or any(len(row) != 6 for row in geometry):
                raise ValueError(f"geometry {meta['geometry']!r} is not 6 numbers for each of {shape[0]} copies")
        return cls(str(meta["vae"]), meta["dtype"], shape, int(meta["resolution"]), bucket, text, geometry)

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape[1:]))
        mirrored = ", with mirror images" if self.copies == 2 else ""
        size = f"{self.resolution}px"
        if self.bucket:
            size += f" buckets (this one {self.bucket[0]}x{self.bucket[1]})"
        text = "; text states of " + ", ".join(
            f"{p.get('part', 'encoder')} {p['encoder']}, {p['dtype']} {'x'.join(map(str, p['shape']))}"
            + (f" and pooled {p['pooled'][0]}" if p.get("pooled") else "") for p in text_parts(self.text)) \
            if self.text else ""
        return f"autoencoder {self.vae}, {size}, {self.dtype} moments {shape}{mirrored}{text}"


def valid_text_part(part) -> bool:
    shape, pooled = part.get("shape"), part.get("pooled")
    return (part.get("dtype") in DTYPES and isinstance(part.get("encoder"), str) and isinstance(shape, list)
            and len(shape) == 2 and all(isinstance(n, int) for n in shape)
            and (pooled is None or (isinstance(pooled, list) and len(pooled) == 1 and isinstance(pooled[0], int))))


def valid_text(text: dict) -> bool:
    if "encoders" not in text:
        return valid_text_part(text)
    parts = text["encoders"]
    return isinstance(parts, list) and bool(parts) and all(
        isinstance(p, dict) and isinstance(p.get("part"), str) and valid_text_part(p) for p in parts)


def text_parts(text: dict | None) -> list[dict]:
    """Each encoder's entry of a meta's `text`: the one of a single encoder's form, or the several's in order."""
    if text is None:
        return []
    return list(text["encoders"]) if "encoders" in text else [text]


def text_key(text: dict | None) -> tuple[str, ...]:
    """The fingerprints of the encoders whose states a record holds, in order."""
    return tuple(part["encoder"] for part in text_parts(text))


def latent_line(caption: str, key: str, moments: np.ndarray, meta: LatentMeta, source: dict | None = None,
                text: np.ndarray | list | None = None) -> bytes:
    """A latent record; `source`: the metadata of the record it was encoded from, kept in the meta as `metadata`
    (what `--metadata_filter` reads on latent records); `text`: the caption's text states (`meta.text` says how):
    an array for one encoder, or a list of (states, pooled vector or None) for several, in the meta's order."""
    caption = " ".join(caption.split())  # tabs and newlines would break the line format
    payload = PREFIX + pybase64.b64encode(to_bytes(moments, meta.dtype))
    text_bytes = b""
    if text is not None and "encoders" in meta.text:
        parts = []
        for part, (states, pooled) in zip(meta.text["encoders"], text, strict=True):
            parts.append({**part, "shape": list(states.shape)})  # a compact record: its own number of tokens
            text_bytes += to_bytes(states, part["dtype"])
            if part.get("pooled"):
                text_bytes += to_bytes(pooled, part["dtype"])
        meta = dataclasses.replace(meta, text={**meta.text, "encoders": parts})
    elif text is not None:
        text, pooled = text if isinstance(text, tuple) else (text, None)  # a set's pooled vector (SD3's) after
        if list(text.shape) != meta.text["shape"]:  # a compact record: its own number of tokens
            meta = dataclasses.replace(meta, text={**meta.text, "shape": list(text.shape)})
        text_bytes = to_bytes(text, meta.text["dtype"])
        if meta.text.get("pooled"):
            text_bytes += to_bytes(pooled, meta.text["dtype"])
    info = meta.to_json()
    if source:
        info = info[:-1] + b',"metadata":' + json.dumps(source, separators=(",", ":"), default=str).encode() + b"}"
    fields = [caption.encode("utf-8"), key.encode("utf-8"), payload, info]
    if text is not None:
        fields.append(TEXT_PREFIX + pybase64.b64encode(text_bytes))
    return b"\t".join(fields) + b"\n"


def parse_latent_record(line: bytes) -> tuple[str, tuple[bytes, LatentMeta, bytes | None]]:
    """A latent shard line -> (caption, (array bytes, meta, text states' bytes or None)); an unusable line raises
    `SkipRecord`."""
    fields = line.split(b"\t", 4)
    if len(fields) < 4:
        raise SkipRecord("missing_columns", f"{len(fields)} column(s), a latent record has 4")
    if not fields[2].startswith(PREFIX):
        raise SkipRecord("image_record", "an image record in a latent corpus")
    caption = decode_caption(fields[0])
    try:
        meta = LatentMeta.from_json(fields[3])
    except (ValueError, KeyError, TypeError) as e:
        raise SkipRecord("bad_latent", f"meta: {e}") from None
    text = None
    if meta.text is not None:
        if len(fields) < 5 or not fields[4].startswith(TEXT_PREFIX):
            raise SkipRecord("bad_text_state", "its meta names text states, and it has none")
        text = fields[4][len(TEXT_PREFIX):]
    return caption, (decode_base64(fields[2][len(PREFIX):]), meta, text)


@dataclass(frozen=True)
class LatentTransform:
    """The latent counterpart of `ImageTransform`: a record's moments, its mirror image at random when
    `random_flip` asks for it (drawn from the record's generator, as the image path draws its flip).

    Each record is checked against the run: encoded by its autoencoder (`vae`, a fingerprint; None
    checks nothing, for the data tools), at its `resolution`, with a mirror image when it flips. A
    record that fails raises `LatentMismatch`, which ends the run (at its start when the first batch
    holds it): such a corpus is a mix-up, and skipping its records could silently drop most of the data."""

    vae: str | None = None
    vae_source: str = ""
    resolution: int | None = None
    random_flip: bool = False
    buckets: tuple[tuple[int, int], ...] | None = None  # the run's aspect-ratio buckets; None: square crops
    # the run's frozen text encoder (its fingerprint, `text_fingerprint`): cached text states must be its; "": the run
    # trains its text encoder (a corpus with text states is refused); None: checks nothing (data tools, held-out)
    cached_text: str | None = None
    reads_geometry: bool = False  # the run's model reads each image's geometry: a record without it is refused

    parse = staticmethod(parse_latent_record)

    def check(self, meta: LatentMeta) -> None:
        if self.vae is not None and meta.vae != self.vae:
            raise LatentMismatch(
                f"latents of autoencoder {meta.vae}, but this run's autoencoder ({self.vae_source}) is {self.vae}: "
                "the diffusion model must learn the latents of the autoencoder it is exported with. Encode the "
                "corpus with this run's autoencoder (python -m ldm.prepare encode --vae_name_or_path ...) or pass "
                "the one it was encoded with")
        if self.resolution is not None and meta.resolution != self.resolution:
            raise LatentMismatch(f"latents of {meta.resolution}px crops; this run asks for --resolution "
                                 f"{self.resolution}")
        if self.resolution is not None:
            self.check_bucket(meta)
        if self.random_flip and meta.copies < 2:
            raise LatentMismatch("latents without mirror images (encoded without --random_flip); this run asks for "
                                 "--random_flip: encode with --random_flip or train without it")
        if meta.text is not None and self.cached_text is not None:
            self.check_text(meta.text)
        if self.reads_geometry and meta.geometry is None:
            raise LatentMismatch("latents encoded without each image's size and crop (its geometry), which this run's "
                                 "model is conditioned on: encode the corpus again with this version (python -m "
                                 "ldm.prepare encode, into a new --output_dir), or train a model that does not read "
                                 "them")

    def check_text(self, text: dict) -> None:
        """The record's text states are the run's frozen encoders' (`cached_text`: one fingerprint, or a tuple of
        them in the model's order)."""
        found = text_key(text)
        encoder = found[0] if len(found) == 1 else ", ".join(
            f"{p['part']} {p['encoder']}" for p in text_parts(text))
        if not self.cached_text:
            raise LatentMismatch(f"latents with the text states of frozen encoder {encoder}, and this run trains its "
                                 "text encoder: train on a corpus encoded without --text_embeddings, or keep the "
                                 "encoder frozen")
        expected = (self.cached_text,) if isinstance(self.cached_text, str) else tuple(self.cached_text)
        if len(found) > 1 or len(expected) > 1:
            if found == expected:
                return
            if len(found) != len(expected):
                raise LatentMismatch(f"latents with the text states of {len(found)} encoder(s) ({encoder}), and this "
                                     f"run has {len(expected)} frozen text encoder(s) ({', '.join(expected)}): "
                                     "encode with this run's --model_name_or_path, or train the model the corpus "
                                     "was encoded for")
            at = next(i for i, (a, b) in enumerate(zip(found, expected, strict=True)) if a != b)
            raise LatentMismatch(f"latents whose {text_parts(text)[at]['part']} states are of encoder {found[at]}, "
                                 f"and this run's is {expected[at]} (the fingerprint covers its weights and the "
                                 "caption length): encode with this run's --model_name_or_path and "
                                 "--model_max_length, or train with the ones the corpus was encoded with")
        if found != expected:
            raise LatentMismatch(f"latents with the text states of encoder {encoder}, and this run's frozen text "
                                 f"encoder is {self.cached_text} (the fingerprint covers its weights and the caption "
                                 "length, --model_max_length): the UNet must learn the states it is exported with. "
                                 "Encode with this run's --model_name_or_path and --model_max_length, or train with "
                                 "the ones the corpus was encoded with")

    def check_bucket(self, meta: LatentMeta) -> None:
        """Latents of a bucketed encode in a bucketed run of the same buckets; square ones in a square run."""
        bucket = meta.bucket or (meta.resolution, meta.resolution)
        if self.buckets is None and meta.bucket is not None:  # square or not: the corpus is bucketed, refused at once
            raise LatentMismatch(f"latents encoded in aspect-ratio buckets (this one {bucket[0]}x{bucket[1]}); this "
                                 "run crops squares: train with --aspect_buckets (the ones the corpus was encoded "
                                 "with) or encode without them")
        if self.buckets is not None and bucket not in self.buckets:
            raise LatentMismatch(f"latents of a {bucket[0]}x{bucket[1]} crop, which is not one of this run's "
                                 f"--aspect_buckets ({', '.join(map(bucket_name, self.buckets))}): train with "
                                 "the buckets the corpus was encoded with")

    def __call__(self, payload: tuple[bytes, LatentMeta, bytes | None], rng: random.Random) -> np.ndarray:
        return self.sample(payload, rng)[0]

    def sample(self, payload: tuple[bytes, LatentMeta, bytes | None], rng: random.Random
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """(the moments of the copy drawn, that copy's geometry as `ImageTransform.sample` gives it, or None: a
        record encoded without it)."""
        data, meta, _ = payload
        self.check(meta)
        try:
            moments = from_bytes(data, meta.dtype, list(meta.shape))
        except ValueError as e:
            raise SkipRecord("bad_latent", str(e)) from None
        copy = 1 if self.random_flip and rng.random() < 0.5 else 0
        return moments[copy], None if meta.geometry is None else np.array(meta.geometry[copy], np.float32)

    def encoder_states(self, payload: tuple[bytes, LatentMeta, bytes | None]
                       ) -> list[tuple[np.ndarray, int, np.ndarray | None]] | None:
        """Each encoder's cached states (padded as `text_states` pads them), real tokens and pooled vector (None
        where the encoder gives none), in the meta's order, when the run takes them; None: it encodes the caption
        itself. A record of one encoder gives one entry."""
        _, meta, text = payload
        if text is None or not self.cached_text:
            return None
        try:
            data = decode_base64(text)
        except SkipRecord as e:
            raise SkipRecord("bad_text_state", f"text states: {e.detail}") from None
        out, offset = [], 0
        for part in text_parts(meta.text):
            size = 4 if part["dtype"] == "float32" else 2
            shapes = [list(part["shape"])] + ([list(part["pooled"])] if part.get("pooled") else [])
            arrays = []
            for shape in shapes:
                end = offset + size * int(np.prod(shape))
                try:
                    arrays.append(from_bytes(data[offset:end], part["dtype"], shape))
                except ValueError as e:
                    raise SkipRecord("bad_text_state", f"text states: {e}") from None
                offset = end
            states, real, length = arrays[0], len(arrays[0]), int(part.get("length", len(arrays[0])))
            if real < length:
                states = np.concatenate([states, np.zeros([length - real, states.shape[1]], np.float32)])
            out.append((states, real, arrays[1] if len(arrays) > 1 else None))
        if offset != len(data):
            raise SkipRecord("bad_text_state", f"text states: {len(data)} bytes, the meta describes {offset}")
        return out

    def text_states(self, payload: tuple[bytes, LatentMeta, bytes | None]
                    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
        """The record's cached text states (float32 [tokens, width], a compact record's padded with zeros to its
        `length`), their mask (int64, 1 for a real token) where the encoder masks its padding (a compact record's:
        None for another) and the pooled vector (None unless the meta has one: SD3's encoder set), when the run takes
        them; None: it encodes the caption itself."""
        parts = self.encoder_states(payload)  # one encoder's record (a run refuses another encoder's at its check)
        if parts is None:
            return None
        states, real, pooled = parts[0]
        masked = "length" in text_parts(payload[1].text)[0]
        return states, (np.arange(len(states)) < real).astype(np.int64) if masked else None, pooled


def text_fingerprint(identity: dict) -> str:
    """A short name of a frozen text encoder (`ldm.models.text.text_encoder_identity`): its family, config, weights,
    layer and caption length."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def first_record_kind(path: str) -> str | None:
    """What the first record of a text shard is: "image", "latent", or "latent with text states"; None when the shard
    has no record or its first one is unusable (the run counts it). ShardError when it cannot be read."""
    from ldm.data.shard import iter_lines

    lines = iter_lines(path)
    try:
        line = next(lines, None)
    finally:
        lines.close()
    if line is None:
        return None
    if not is_latent_line(line):
        return "image"
    try:
        meta = parse_latent_record(line)[1][1]
    except SkipRecord:
        return None
    return "latent with text states" if meta.text is not None else "latent"


def probe(paths: list[str]) -> LatentMeta | None:
    """The meta of the first record of the first readable shard among the first few, or None for images (the data
    tools' guess of a corpus's kind; training tells each record's kind from its content)."""
    from ldm.data.shard import ShardError, iter_lines

    for path in paths[:PROBED_SHARDS]:
        try:
            line = next(iter(iter_lines(path)), None)
        except ShardError:
            continue
        if line is None:
            continue
        if not is_latent_line(line):
            return None
        try:
            return parse_latent_record(line)[1][1]
        except SkipRecord as e:
            raise LatentMismatch(f"{path}: the first latent record is unusable: {e.reason} {e.detail}") from None
    return None
