"""Turning one shard line into a caption and an image crop.

Every way a record can be unusable raises `SkipRecord` with a short reason; the stream counts
the reasons. Image decoding: JPEG `draft` (DCT-domain downscaling), then only the crop region
leaves Pillow and OpenCV resizes it (measured by scripts/bench_data.py, docs/benchmarks.md).
"""

from __future__ import annotations

import binascii
import io
import random
import warnings
from dataclasses import dataclass

import cv2
import numpy as np
import pybase64
from PIL import Image

from ldm.models.buckets import cover_size, nearest_bucket

REASONS = (
    "missing_columns",
    "bad_caption",
    "empty_image",
    "bad_base64",
    "bad_image",
    "too_large",
    "too_small",
)


# The tokenizer reads a whole caption before it truncates it to its 77 tokens, slowly (docs/benchmarks.md):
# one corrupt caption of a few MB stalls a loader worker (a line may hold 256 MB). 77 tokens of text
# whose words are shorter than WordPiece's 100-character limit fit in far fewer characters.
MAX_CAPTION_CHARS = 8192


class SkipRecord(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


LATENT_PREFIX = b"latent:"  # starts the payload of a latent record (ldm.data.latents): ":" is not a base64 character


def decode_caption(field: bytes) -> str:
    try:
        return field.decode("utf-8").strip()[:MAX_CAPTION_CHARS]
    except UnicodeDecodeError as e:
        raise SkipRecord("bad_caption", str(e)) from None


def decode_base64(payload: bytes) -> bytes:
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise SkipRecord("bad_base64", str(e)) from None


def parse_record(line: bytes) -> tuple[str, bytes]:
    """`caption \\t <ignored> \\t base64(image)[\\t ...]` -> (caption, image bytes)."""
    fields = line.split(b"\t", 3)
    if len(fields) < 3:
        raise SkipRecord("missing_columns", f"{len(fields)} column(s)")
    caption = decode_caption(fields[0])
    payload = fields[2].strip()
    if not payload:
        raise SkipRecord("empty_image")
    if payload.startswith(LATENT_PREFIX):
        raise SkipRecord("latent_record", "a latent record in an image corpus")
    image_bytes = decode_base64(payload)
    if not image_bytes:
        raise SkipRecord("empty_image")
    return caption, image_bytes


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB: transparency over white, 16-bit scaled, not clipped."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        # Pillow's convert("L") clips 16-bit values at 255; scale the full range instead.
        values = np.asarray(image, dtype=np.uint32)
        return Image.fromarray((np.minimum(values, 65535) // 257).astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        values = np.asarray(image, dtype=np.float32)
        return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# a batch's key of each image's geometry (`Placement.geometry`): `ldm.models.conditioning.GEOMETRY`, named here too
# because the data path stands on the runtime alone (tests/test_structure.py)
GEOMETRY = "geometry"


@dataclass(frozen=True)
class Placement:
    """Where a crop was taken from, in pixels, each size as (height, width): the decoded image's size before any
    resize (its header's), the size it was resized to (covering the crop), the crop's corner in that resized image
    and the crop's size."""

    original: tuple[int, int]
    resized: tuple[int, int]
    top: int
    left: int
    size: tuple[int, int]

    def geometry(self, flipped: bool) -> np.ndarray:
        """float32 [6]: the crop's `ldm.models.conditioning.GEOMETRY`, Stable Diffusion XL's time ids (original
        h, w, crop top, left, target h, w). A flipped crop is the crop of the flipped resized image whose left edge is
        the mirror of this one's, as diffusers' SDXL script computes it since #6547 (it flips the resized image, then
        crops; before, it took the width of the crop, not of the resized image: #6234)."""
        left = self.resized[1] - self.size[1] - self.left if flipped else self.left
        return np.array([*self.original, self.top, left, *self.size], dtype=np.float32)


@dataclass(frozen=True)
class ImageTransform:
    """Shorter side to `resolution / resize_ratio`, crop `resolution` (random or center), optional flip. With
    `buckets` (`ldm.models.buckets`): resized to cover the bucket nearest the image's aspect ratio (read from its
    header, before decoding), then cropped to it; `resize_ratio` is not applied, so a crop loses only what the
    bucket's shape does not hold.

    Returns uint8 HWC (`sample`: with the crop's geometry, `Placement.geometry`); the crop position and flip come
    from the record's own generator, so a record's sample depends only on (seed, pass, record), never on reading
    order.
    """

    resolution: int = 256
    resize_ratio: float = 0.9
    center_crop: bool = False
    random_flip: bool = False
    min_image_size: int = 0
    max_image_pixels: int = 89_478_485
    buckets: tuple[tuple[int, int], ...] | None = None  # (height, width) each; None: square crops

    parse = staticmethod(parse_record)  # a shard line -> (caption, what `__call__` takes)

    def output_size(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(crop width, crop height, resized width, resized height) of an image of `width` x `height`."""
        if self.buckets:
            bucket = nearest_bucket(self.buckets, width, height)
            return (bucket[1], bucket[0], *cover_size(width, height, bucket))
        size = self.resolution
        scale = size / self.resize_ratio / min(width, height)
        return size, size, max(size, round(width * scale)), max(size, round(height * scale))

    def __call__(self, image_bytes: bytes, rng: random.Random) -> np.ndarray:
        return self.sample(image_bytes, rng)[0]

    def sample(self, image_bytes: bytes, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 HWC crop, flipped at random when `random_flip` asks for it; its geometry: `Placement.geometry`)."""
        array, placement = self.place(image_bytes, rng)
        flipped = self.random_flip and rng.random() < 0.5
        return (array[:, ::-1] if flipped else array), placement.geometry(flipped)

    def place(self, image_bytes: bytes, rng: random.Random) -> tuple[np.ndarray, Placement]:
        """(uint8 HWC crop, not flipped; where it was taken from)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(image_bytes))
            width, height = image.size
            if width * height > self.max_image_pixels:
                raise SkipRecord("too_large", f"{width}x{height}")
            if min(width, height) < self.min_image_size:
                raise SkipRecord("too_small", f"{width}x{height}")
            if width < 1 or height < 1:
                raise SkipRecord("bad_image", f"{width}x{height}")
            out_w, out_h, resized_w, resized_h = self.output_size(width, height)
            if self.center_crop:
                left, top = (resized_w - out_w) // 2, (resized_h - out_h) // 2
            else:
                left, top = rng.randint(0, resized_w - out_w), rng.randint(0, resized_h - out_h)
            sx, sy = width / resized_w, height / resized_h
            box = (left * sx, top * sy, (left + out_w) * sx, (top + out_h) * sy)
            if image.format == "JPEG":
                # DCT-domain downscale by the largest power of two that keeps the crop >= size
                image.draft("RGB", (resized_w, resized_h))
                dx, dy = image.size[0] / width, image.size[1] / height
                box = (box[0] * dx, box[1] * dy, box[2] * dx, box[3] * dy)
            image = to_rgb(image)
            x0, y0 = min(int(box[0]), image.size[0] - 1), min(int(box[1]), image.size[1] - 1)
            x1 = max(x0 + 1, min(round(box[2]), image.size[0]))
            y1 = max(y0 + 1, min(round(box[3]), image.size[1]))
            region = np.asarray(image.crop((x0, y0, x1, y1)))  # only the crop is copied out of Pillow
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise SkipRecord("too_large", str(e)) from None
        except (OSError, SyntaxError, ValueError, TypeError, IndexError, EOFError,
                Image.UnidentifiedImageError) as e:
            raise SkipRecord("bad_image", f"{type(e).__name__}: {e}") from None
        # After a JPEG draft the crop is at most 2x the output: bilinear is then as close to a
        # full-size antialiased bicubic resize as area averaging (mean abs diff 0.98 vs 0.95 grey
        # levels on LAION-like JPEGs) at 1/5 of its cost. Larger factors (PNG, huge JPEGs) need
        # area averaging to avoid aliasing; upscaling uses bicubic.
        factor = region.shape[0] / out_h
        interpolation = cv2.INTER_AREA if factor >= 2 else cv2.INTER_LINEAR if factor >= 1 else cv2.INTER_CUBIC
        if region.shape[:2] == (out_h, out_w):  # an image already of its bucket's size (img2dataset's square ones)
            array = region
        else:
            array = cv2.resize(region, (out_w, out_h), interpolation=interpolation)
        return array, Placement((height, width), (resized_h, resized_w), top, left, (out_h, out_w))


def sample_rng(seed: int, pass_index: int, shard: str, line_number: int, copy: int = 0) -> random.Random:
    """The generator of one record's augmentations and caption dropout (string seeds hash with SHA-512)."""
    return random.Random(f"{seed}/{pass_index}/{copy}/{shard}:{line_number}")
