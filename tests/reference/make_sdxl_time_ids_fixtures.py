"""Stable Diffusion XL's time ids as diffusers' training script computes them, for tests/test_data_record.py:

    /work/refvenv/bin/python tests/reference/make_sdxl_time_ids_fixtures.py

`examples/text_to_image/train_text_to_image_sdxl.py` (diffusers since #6547, as in 0.42) preprocesses an image as:

    original_sizes.append((image.height, image.width))
    image = train_resize(image)                      # transforms.Resize(resolution): the shorter side to it
    if args.random_flip and random.random() < 0.5:
        image = train_flip(image)                    # the resized image, before the crop
    if args.center_crop:
        y1 = max(0, int(round((image.height - args.resolution) / 2.0)))
        x1 = max(0, int(round((image.width - args.resolution) / 2.0)))
        image = train_crop(image)
    else:
        y1, x1, h, w = train_crop.get_params(image, (args.resolution, args.resolution))
        image = crop(image, y1, x1, h, w)
    crop_top_left = (y1, x1)

and `compute_time_ids(original_size, crops_coords_top_left)` = original_size + crops_coords_top_left + (resolution,
resolution). This script applies those steps to photo-like PIL images, square and not, centre- and random-cropped,
flipped and not (the flip chosen per case, not drawn), with torchvision's formulas written out (this virtualenv has
no torchvision): `Resize(size)` sets the shorter side to `size` and the longer to `int(size * long / short)`,
`RandomCrop.get_params` draws `torch.randint(0, h - th + 1)` then `torch.randint(0, w - tw + 1)`. The script has no
aspect-ratio buckets; the bucket cases apply the same steps with the bucket's resize (`cover`, the size this
project's `ImageTransform` resizes that image to for that bucket) and the bucket's crop size as the target.

Writes tests/fixtures/sdxl_time_ids.json: per case the image's size, the resize, the crop, the flip, the crop's top-left
corner and the time ids.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "sdxl_time_ids.json")

# (name, (width, height) of the image, resolution or bucket (height, width), resize (height, width) for a bucket or
# None: Resize(resolution), centre crop, flip)
CASES = [
    ("square", (256, 256), 64, None, True, False),
    ("landscape centre", (320, 240), 64, None, True, False),
    ("landscape random", (320, 240), 64, None, False, False),
    ("landscape random flipped", (320, 240), 64, None, False, True),
    ("portrait centre flipped", (200, 300), 64, None, True, True),
    ("portrait random flipped", (200, 300), 64, None, False, True),
    ("bucket 24x40 random flipped", (300, 160), (24, 40), (24, 45), False, True),
    ("bucket 40x24 centre flipped", (150, 260), (40, 24), (42, 24), True, True),
    ("bucket 24x48 random", (330, 150), (24, 48), (24, 53), False, False),
]


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A smooth, photo-like RGB image (gradients plus noise): the geometry depends on its size alone."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    return Image.fromarray(np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8), "RGB")


def resize(image: Image.Image, size) -> Image.Image:
    """torchvision's `Resize(size)` on a PIL image: an int sets the shorter side (the longer one truncated)."""
    if isinstance(size, int):
        w, h = image.size
        short, long = min(w, h), max(w, h)
        new_long = int(size * long / short)
        size = (size, new_long) if h <= w else (new_long, size)
    return image.resize((size[1], size[0]), Image.BILINEAR)


def preprocess(image: Image.Image, target: tuple[int, int], resize_to, center_crop: bool, flip: bool, seed: int):
    """The script's `preprocess_train` for one image (its crop `target`, (height, width)): (original size, resized
    size, crop top-left), each (height, width)."""
    original_size = (image.height, image.width)
    image = resize(image, resize_to)
    resized = (image.height, image.width)
    if flip:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    th, tw = target
    if center_crop:
        y1 = max(0, int(round((image.height - th) / 2.0)))
        x1 = max(0, int(round((image.width - tw) / 2.0)))
    else:
        torch.manual_seed(seed)
        y1 = int(torch.randint(0, image.height - th + 1, size=(1,)).item())
        x1 = int(torch.randint(0, image.width - tw + 1, size=(1,)).item())
    image = image.crop((x1, y1, x1 + tw, y1 + th))
    assert image.size == (tw, th)
    return original_size, resized, (y1, x1)


def compute_time_ids(original_size, crops_coords_top_left, target_size) -> list[int]:
    """The script's `compute_time_ids` (its target is (resolution, resolution); a bucket's is the bucket)."""
    return list(original_size + crops_coords_top_left + target_size)


def main() -> None:
    cases = []
    for seed, (name, (width, height), target, bucket_resize, center_crop, flip) in enumerate(CASES):
        size = (target, target) if isinstance(target, int) else tuple(target)
        original, resized, corner = preprocess(photo(width, height, seed), size,
                                               target if bucket_resize is None else bucket_resize, center_crop, flip,
                                               seed)
        cases.append({"name": name, "image": [width, height], "seed": seed,
                      "resolution": target if isinstance(target, int) else None,
                      "bucket": None if isinstance(target, int) else list(size), "resized": list(resized),
                      "center_crop": center_crop, "flip": flip, "crop_top_left": list(corner),
                      "time_ids": compute_time_ids(original, corner, size)})
    import diffusers

    with open(OUT, "w") as f:
        json.dump({"diffusers": diffusers.__version__, "torch": torch.__version__,
                   "script": "examples/text_to_image/train_text_to_image_sdxl.py (preprocess_train, compute_time_ids)",
                   "cases": cases}, f, indent=1)
    print(OUT, len(cases), "cases")


if __name__ == "__main__":
    main()
