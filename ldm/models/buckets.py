"""Aspect-ratio buckets: the shapes a bucketed run trains at, and which one a record goes to.

A bucket is (height, width) in pixels, both multiples of the model's size step (the autoencoder's
downsampling times the UNet's, so that every UNet level gets whole latents), of area about
`resolution` squared. A record goes to the bucket nearest its aspect ratio (in log ratio, so 2:1 and
1:2 are as far from square), is resized to cover it and cropped (`ldm.data.record.ImageTransform`).

`auto` is the usual construction (NovelAI's and kohya's sd-scripts' buckets, SDXL section 2.2): for
each width in steps of `step`, the height whose area is nearest resolution squared, kept when the ratio
is within `max_aspect_ratio`, with its transpose. Which batch a record lands in is the data stream's
business (`ldm.data.dataset`): batches hold one bucket each.
"""

from __future__ import annotations

import math

from ldm.runtime.errors import UserError

Bucket = tuple[int, int]  # (height, width)


class BucketError(UserError, ValueError):
    """An --aspect_buckets value the run cannot use."""


def bucket_name(bucket: Bucket) -> str:
    return f"{bucket[0]}x{bucket[1]}"


def size_step(vae_config, unet_config=None) -> int:
    """The side every bucket is a multiple of: the autoencoder's downsampling (2 per block after the first), times
    the backbone's (a UNet's, the same rule; a DiT's patch) when there is one."""
    from ldm.models.backbone import autoencoder_factor
    from ldm.models.backbone import size_step as backbone_step

    step = autoencoder_factor(vae_config)
    if unet_config is not None:
        step *= backbone_step(unet_config)
    return step


def backbone_buckets(value: str | None, resolution: int, max_aspect_ratio: float, vae_config, backbone_config
                     ) -> tuple[Bucket, ...] | None:
    """The buckets `value` names for a backbone over an autoencoder (`parse_buckets`): sides multiples of their
    `size_step`, none longer than the backbone takes (`ldm.models.backbone.largest_side`)."""
    from ldm.models.backbone import largest_side

    return parse_buckets(value, resolution, size_step(vae_config, backbone_config), max_aspect_ratio,
                         largest_side(backbone_config, vae_config))


def check_max_aspect_ratio(max_aspect_ratio: float) -> None:
    if not (math.isfinite(max_aspect_ratio) and max_aspect_ratio >= 1):
        raise BucketError(f"--max_aspect_ratio must be a number >= 1 (long side / short side), not "
                          f"{max_aspect_ratio:g}")


def by_ratio(buckets) -> tuple[Bucket, ...]:
    """Buckets from the tallest to the widest."""
    return tuple(sorted(buckets, key=lambda b: (b[1] / b[0], b[1])))


def auto_buckets(resolution: int, step: int, max_aspect_ratio: float = 2.0, largest: int | None = None
                 ) -> tuple[Bucket, ...]:
    """Buckets of area about `resolution`², sides multiples of `step` and at most `largest` (the backbone's: SD3's
    position embedding), ratios within `max_aspect_ratio`, widest last."""
    check_max_aspect_ratio(max_aspect_ratio)
    if resolution % step:
        raise BucketError(f"--aspect_buckets auto needs --resolution a multiple of {step} (the model's size step: "
                          f"its autoencoder's downsampling times its UNet's), not {resolution}")
    area = resolution * resolution
    found: set[Bucket] = set()
    width = step
    while (height := round(area / width / step) * step) >= step:  # wider ones would have no height left
        fits = largest is None or max(width, height) <= largest
        if fits and max(width, height) / min(width, height) <= max_aspect_ratio + 1e-9:
            found.update({(height, width), (width, height)})
        width += step
    return by_ratio(found)


def buckets_off(value: str | None) -> bool:
    """Does an --aspect_buckets value ask for square crops? (None: not given; an empty string is refused, as an
    unset shell variable rather than a choice)"""
    if value is not None and not value.strip():
        raise BucketError("--aspect_buckets is empty: give none, auto or HEIGHTxWIDTH,... (e.g. 256x256,192x320)")
    return value is None or value.strip().lower() == "none"


def parse_buckets(value: str | None, resolution: int, step: int, max_aspect_ratio: float = 2.0,
                  largest: int | None = None) -> tuple[Bucket, ...] | None:
    """`none` -> None (square crops), `auto` -> `auto_buckets`, `HxW,HxW,...` (or space-separated) -> those; no side
    longer than `largest` (pixels; None: any)."""
    if buckets_off(value):
        return None
    text = value.strip().lower()
    if text == "auto":
        return auto_buckets(resolution, step, max_aspect_ratio, largest)
    buckets: list[Bucket] = []
    for part in text.replace(",", " ").split():
        height, sep, width = part.partition("x")
        if not sep or not height.isdecimal() or not width.isdecimal():
            raise BucketError(f"--aspect_buckets: {part!r} is not HEIGHTxWIDTH (e.g. 256x256,192x320), auto or none")
        bucket = (int(height), int(width))
        if min(bucket) < step or bucket[0] % step or bucket[1] % step:
            raise BucketError(f"--aspect_buckets: {part} has a side that is not a positive multiple of {step} (the "
                              "model's size step: its autoencoder's downsampling times its UNet's)")
        if largest is not None and max(bucket) > largest:
            raise BucketError(f"--aspect_buckets: {part} has a side longer than {largest} px, the largest the model's "
                              "backbone takes (its position embedding's span)")
        if bucket not in buckets:
            buckets.append(bucket)
    if not buckets:
        raise BucketError("--aspect_buckets names no bucket")
    check_max_aspect_ratio(max_aspect_ratio)
    for bucket in buckets:
        if max(bucket) / min(bucket) > max_aspect_ratio + 1e-9:
            shape = "taller" if bucket[0] > bucket[1] else "wider"  # height x width
            raise BucketError(f"--aspect_buckets: {bucket_name(bucket)} is {shape} than --max_aspect_ratio "
                              f"{max_aspect_ratio:g} allows (raise it to train such shapes)")
    return by_ratio(buckets)


def far_from_area(buckets: tuple[Bucket, ...], resolution: int, tolerance: float = 0.25) -> list[Bucket]:
    """The buckets whose area is more than `tolerance` away from `resolution` squared (a listed bucket may be)."""
    return [b for b in buckets if abs(b[0] * b[1] / resolution**2 - 1) > tolerance]


def add_bucket_flags(parser, model: bool = True) -> None:
    """--aspect_buckets and --max_aspect_ratio as training takes them; with `model`, --model_name_or_path, the model
    whose size step they follow (a command that loads a model has its own)."""
    parser.add_argument("--aspect_buckets", default="none",
                        help="aspect-ratio buckets, as training takes them: none (square crops), auto (area about "
                             "--resolution squared, ratios within --max_aspect_ratio) or HxW,HxW,...")
    parser.add_argument("--max_aspect_ratio", type=float, default=2.0,
                        help="the widest ratio (long side / short side) a bucket may have (auto makes them up to it)")
    if not model:
        return
    parser.add_argument("--model_name_or_path", default="ldm-32layer",
                        help="the model the buckets are for (a preset or a folder): their sides are multiples of its "
                             "autoencoder's downsampling times its UNet's")


def nearest_bucket(buckets: tuple[Bucket, ...], width: int, height: int) -> Bucket:
    """The bucket nearest an image's aspect ratio (ties: the first, the taller)."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[1] / b[0]) - ratio))


def cover_size(width: int, height: int, bucket: Bucket) -> tuple[int, int]:
    """(width, height) an image is resized to so that it covers `bucket` with its aspect ratio kept."""
    scale = max(bucket[1] / width, bucket[0] / height)
    return max(bucket[1], round(width * scale)), max(bucket[0], round(height * scale))


def area_kept(width: int, height: int, bucket: Bucket) -> float:
    """The fraction of an image's area a crop of `bucket` keeps after the image is resized to cover it."""
    scale = max(bucket[1] / width, bucket[0] / height)
    return bucket[0] * bucket[1] / (width * height * scale * scale)
