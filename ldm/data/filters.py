"""Metadata filters (`--metadata_filter "punsafe < 0.5" "AESTHETIC_SCORE >= 5"`), and a record's parts.

Each filter is `KEY OP NUMBER`, OP one of `< <= > >= == !=`; a record must pass all of them. KEY is any field of
the record's metadata: the `.json` of a tar sample, the columns of a parquet row, the JSON object in a text
shard's fourth column (`python -m ldm.prepare convert` writes it), the `metadata` of a latent record (`encode` copies
it there). Two keys are derived: `min_side` and `aspect_ratio` (long side / short side), from `original_width` and
`original_height` when the metadata has them (img2dataset writes them: the size before its resize), else from the
image's own header (the image is not decoded for it).

A rejected record raises `SkipRecord("filter_KEY_OP_NUMBER")` (OP spelled lt le gt ge eq ne: `punsafe < 0.5` is
counted as `filter_punsafe_lt_0.5`, a name trackers take as a tag); one without the key (or with a null or
non-numeric value) `SkipRecord("missing_key_KEY")`, so that neither is silently passed nor silently dropped.
"""

from __future__ import annotations

import io
import json
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ldm.data.readers import Sample
from ldm.data.record import MAX_CAPTION_CHARS, SkipRecord

OPERATORS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt,
             ">": operator.gt}
DERIVED = ("min_side", "aspect_ratio")
# in reason names, which become tracker tags (data_<reason>): letters, digits, _ . - only
OPERATOR_NAMES = {"<=": "le", ">=": "ge", "==": "eq", "!=": "ne", "<": "lt", ">": "gt"}
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_EXPRESSION = re.compile(rf"^\s*([A-Za-z_][\w.\-]*)\s*(<=|>=|==|!=|<|>)\s*({_NUMBER})\s*$")


@dataclass(frozen=True)
class MetadataFilter:
    key: str
    op: str
    value: float
    number: str  # the number as the user wrote it: messages and counter names show it, never a rounding of it

    @classmethod
    def parse(cls, text: str) -> MetadataFilter:
        match = _EXPRESSION.match(text)
        if match is None:
            raise ValueError(f"--metadata_filter {text!r}: expected 'KEY OP NUMBER' with OP one of "
                             f"{' '.join(sorted(OPERATORS, key=len))}, e.g. 'punsafe < 0.5'")
        value = float(match.group(3))
        if not math.isfinite(value):
            raise ValueError(f"--metadata_filter {text!r}: {match.group(3)} is beyond the range of a number; a "
                             "filter needs a finite bound")
        return cls(match.group(1), match.group(2), value, match.group(3))

    def __str__(self) -> str:
        return f"{self.key} {self.op} {self.number}"

    @property
    def reason(self) -> str:
        """What a rejection is counted under: `filter_punsafe_lt_0.5` for `punsafe < 0.5` (a `+` dropped: tags hold
        letters, digits and `_ . -` only; `1e+07` is counted as `..._1e07`)."""
        return f"filter_{self.key}_{OPERATOR_NAMES[self.op]}_{self.number.replace('+', '')}"


def show_number(value: float) -> str:
    """A metadata value in full: 30000001, 0.1000001 (`:g` would print 3e+07 and 0.1)."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def image_size(image: bytes) -> tuple[int, int]:
    """(width, height) from an image's header (Pillow reads the header only)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(image)) as im:
            return im.size
    except Exception as e:  # noqa: BLE001 - any Pillow failure to identify the bytes
        raise SkipRecord("bad_image", f"{type(e).__name__}: {e}") from None


class MetadataFilters:
    """All of `expressions` (strings): ValueError naming the first malformed one."""

    def __init__(self, expressions: Sequence[str]):
        self.filters = [MetadataFilter.parse(e) for e in expressions]
        self.reasons = [(f, OPERATORS[f.op], f.reason, f"missing_key_{f.key}") for f in self.filters]

    def __bool__(self) -> bool:
        return bool(self.filters)

    def __repr__(self) -> str:
        return f"MetadataFilters({[str(f) for f in self.filters]})"

    def check(self, meta: dict | None, image: bytes | None) -> None:
        """Raise SkipRecord unless the record passes every filter; `image`: for the derived keys' fallback."""
        if meta is None:
            raise SkipRecord("bad_metadata", "the record's metadata is not a JSON object")
        derived: dict[str, float] | None = None
        for f, compare, rejected, missing in self.reasons:
            if f.key in DERIVED and f.key not in meta:
                if derived is None:
                    derived = derived_keys(meta, image)
                value = derived.get(f.key)
            else:
                value = _number(meta.get(f.key))
            if value is None or math.isnan(value):
                raise SkipRecord(missing)
            if not compare(value, f.value):
                raise SkipRecord(rejected, f"{f.key} = {show_number(value)}, not {f}")


def derived_keys(meta: dict, image: bytes | None) -> dict[str, float]:
    width, height = _number(meta.get("original_width")), _number(meta.get("original_height"))
    if not (width and height and width > 0 and height > 0):
        if image is None:
            return {}
        width, height = image_size(image)
        if width < 1 or height < 1:
            raise SkipRecord("bad_image", f"{width}x{height}")
    return {"min_side": float(min(width, height)), "aspect_ratio": max(width, height) / min(width, height)}


def parse_filters(expressions: Sequence[str] | None) -> MetadataFilters | None:
    """MetadataFilters, or None when there are none (the unfiltered path then checks nothing)."""
    return MetadataFilters(expressions) if expressions else None


# -- a record's parts ------------------------------------------------------------------------------
def text_metadata(line: bytes) -> dict | None:
    """The JSON object of a text record's fourth column ({} when it has none; None when it is not an object)."""
    fields = line.split(b"\t", 4)  # a latent record's fifth column: its cached text states
    if len(fields) < 4 or not fields[3].strip():
        return {}
    try:
        meta = json.loads(fields[3])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def latent_metadata(line: bytes) -> dict | None:
    """The source metadata `encode` kept in a latent record's meta (`metadata`), {} when none."""
    meta = text_metadata(line)
    if meta is None:
        return None
    source = meta.get("metadata", {})
    return source if isinstance(source, dict) else None


def sample_parts(sample: Sample, filters: MetadataFilters | None) -> tuple[str, bytes]:
    """A tar or parquet sample -> (caption, image bytes), or SkipRecord with the reason it is unusable."""
    if sample.status is not None and sample.status != "success":
        raise SkipRecord("status_not_success", sample.status)
    if not sample.image:
        raise SkipRecord("no_image")
    if sample.caption is None:
        raise SkipRecord("no_caption")
    if filters:
        filters.check(sample.meta, sample.image)
    return sample.caption.strip()[:MAX_CAPTION_CHARS], sample.image


def record_key_meta(record) -> tuple[str, dict]:
    """(key, metadata) a record carries ("" and {} when it has none): a text line's second column and 4th
    column, a tar's or parquet's key and metadata."""
    if isinstance(record, bytes):
        return record.split(b"\t", 2)[1].decode("utf-8", "replace").strip(), text_metadata(record) or {}
    return record.key or "", record.meta or {}


def record_parts(record, image_parse, latent_parse, filters: MetadataFilters | None) -> tuple[bool, str, Any]:
    """(latent?, caption, payload) of a record of any kind, filters applied: for the data tools (`stats`,
    `encode`, `convert`), which read records as the training stream does (`CaptionImageStream.make_sample`)."""
    if not isinstance(record, bytes):
        caption, image = sample_parts(record, filters)
        return False, caption, image
    from ldm.data.latents import is_latent_line

    latent = is_latent_line(record)
    caption, payload = (latent_parse if latent else image_parse)(record)
    if filters:
        filters.check(latent_metadata(record) if latent else text_metadata(record), None if latent else payload)
    return latent, caption, payload
