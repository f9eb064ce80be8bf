import json
import random
from pathlib import Path

import numpy as np
import pytest
from corpus import GOOD_KINDS, bad_lines, decode, image_bytes, photo
from PIL import Image

from ldm.data import record
from ldm.data.record import ImageTransform, SkipRecord, parse_record, to_rgb
from ldm.models import conditioning
from ldm.prepare.write import encode_image, record_line


@pytest.mark.parametrize("kind", GOOD_KINDS)
def test_every_image_mode_becomes_a_crop_close_to_the_rgb_original(kind):
    transform = ImageTransform(64, center_crop=True)
    got = transform(image_bytes(kind), random.Random(0))
    assert got.shape == (64, 64, 3) and got.dtype == np.uint8  # 8-bit RGB whatever the source mode
    got = got.astype(np.float32)
    reference = transform(image_bytes("png"), random.Random(0)).astype(np.float32)
    if kind in ("gray", "gray16"):
        reference = np.repeat(reference.mean(-1, keepdims=True), 3, -1)
    if kind == "rgba":  # half-transparent over white
        reference = reference / 2 + 127.5
    assert np.abs(got - reference).mean() < 12, kind


def test_sixteen_bit_is_scaled_not_clipped():
    values = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    rgb = np.asarray(to_rgb(decode(encode_image(Image.fromarray(values), "PNG"))))
    assert rgb[..., 0].max() == 255 and 120 < rgb[..., 0].mean() < 135  # a ramp, not all-white


def test_palette_transparency_is_composited_over_white():
    im = Image.new("P", (8, 8), 0)
    im.putpalette([0, 0, 0] * 256)
    im.info["transparency"] = 0
    assert np.asarray(to_rgb(decode(encode_image(im, "PNG")))).min() == 255


def test_draft_decoding_matches_a_full_decode():
    """The JPEG fast path (DCT downscale + one resize call) ~ full decode, resize, crop."""
    data = encode_image(photo(1024, 768, seed=3), "JPEG", quality=95)
    fast = ImageTransform(256, center_crop=True)(data, random.Random(0)).astype(np.float32)
    full = decode(data).convert("RGB")
    scale = (256 / 0.9) / 768
    resized = full.resize((round(1024 * scale), round(768 * scale)), Image.Resampling.BICUBIC)
    left, top = (resized.size[0] - 256) // 2, (resized.size[1] - 256) // 2
    slow = np.asarray(resized.crop((left, top, left + 256, top + 256)), dtype=np.float32)
    assert np.abs(fast - slow).mean() < 6


def test_random_crop_and_flip_follow_the_record_generator():
    transform = ImageTransform(64, random_flip=True)
    data = image_bytes("jpeg", size=(200, 90))
    a = transform(data, random.Random("k"))
    assert np.array_equal(a, transform(data, random.Random("k")))
    crops = {transform(data, random.Random(i)).tobytes() for i in range(12)}
    assert len(crops) > 6


def test_parse_record_ignores_extra_columns():
    jpeg = image_bytes("jpeg")
    caption, data = parse_record(record_line("  a  photo ", jpeg, "key").rstrip(b"\n") + b"\textra\tmore")
    assert caption == "a photo" and data == jpeg


@pytest.mark.parametrize("reason", list(bad_lines()))
def test_every_bad_record_is_skipped_with_its_reason(reason):
    transform = ImageTransform(64, min_image_size=64)
    with pytest.raises(SkipRecord) as info:
        _, data = parse_record(bad_lines()[reason])
        transform(data, random.Random(0))
    assert info.value.reason == reason


def test_uint8_batches_scale_on_the_device_to_the_float_pixels():
    import paddle

    from ldm.data.dataset import to_pixel_values, to_uint8_batch
    from ldm.models.autoencoder import unit_range

    rng = np.random.default_rng(0)
    crops = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(3)] + [np.zeros((8, 8, 3), np.uint8),
                                                                                  np.full((8, 8, 3), 255, np.uint8)]
    batch = to_uint8_batch(crops)
    assert batch.dtype == np.uint8 and batch.shape == (5, 3, 8, 8)
    scaled = unit_range(paddle.to_tensor(batch)).numpy()
    np.testing.assert_allclose(scaled, to_pixel_values(crops), rtol=0, atol=1e-6)
    assert scaled.min() == -1.0 and scaled.max() == 1.0


class Placed(random.Random):
    """A record's generator that places the crop where diffusers' script placed it: `ImageTransform` draws the crop's
    left edge, then its top (a random crop), then the flip."""

    def __init__(self, draws):
        super().__init__(0)
        self.draws = list(draws)

    def randint(self, a, b):
        value = self.draws.pop(0)
        assert a <= value <= b
        return value

    def random(self):
        return self.draws.pop(0)


TIME_IDS = json.loads((Path(__file__).resolve().parent / "fixtures" / "sdxl_time_ids.json").read_text())["cases"]


@pytest.mark.parametrize("case", TIME_IDS, ids=[case["name"] for case in TIME_IDS])
def test_an_images_geometry_is_the_time_ids_of_diffusers_sdxl_script(case):
    """tests/reference/make_sdxl_time_ids_fixtures.py: diffusers' `preprocess_train` and `compute_time_ids` on photos,
    square and not, centre- and random-cropped, flipped and not; in a bucket (the script has none), the same steps
    with the bucket's resize and crop. The transform resizes as the script does (`resize_ratio` 1: the shorter side to
    the resolution; these sizes round and truncate alike) and crops where it did (its centre, or the script's corner;
    this transform flips the crop, the script the resized image before cropping: the same pixels when the left edge is
    mirrored). Its geometry is the script's time ids: (h, w) before the resize, the crop's (top, left) in the resized,
    flipped image, the crop's (h, w)."""
    width, height = case["image"]
    bucket = tuple(case["bucket"]) if case["bucket"] else None
    out_h, out_w = bucket or (case["resolution"], case["resolution"])
    transform = ImageTransform(case["resolution"] or max(bucket), resize_ratio=1.0, center_crop=case["center_crop"],
                               random_flip=True, buckets=(bucket,) if bucket else None)
    resized_h, resized_w = case["resized"]
    assert transform.output_size(width, height) == (out_w, out_h, resized_w, resized_h)  # the script's resize
    top, left = case["crop_top_left"]
    if case["flip"]:  # the script's corner in the flipped image is this one's in the image before its flip
        left = resized_w - out_w - left
    draws = ([] if case["center_crop"] else [left, top]) + [0.0 if case["flip"] else 0.9]
    crop, geometry = transform.sample(encode_image(photo(width, height, case["seed"]), "PNG"), Placed(draws))
    assert crop.shape == (out_h, out_w, 3)
    assert geometry.dtype == np.float32 and geometry.tolist() == case["time_ids"]
    assert record.GEOMETRY == conditioning.GEOMETRY  # the batch's key is the models' name of it
