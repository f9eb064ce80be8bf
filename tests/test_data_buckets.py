"""Aspect-ratio buckets: which shapes, which bucket a record goes to, what its crop keeps, and the tools' reports."""

import json
import math
import random

import numpy as np
import pytest
from corpus import aspect_sizes, photo, write_aspect_corpus
from entry import run_python

from ldm.config.args import ArgumentError, DataArguments
from ldm.data.record import ImageTransform
from ldm.models.buckets import (
    BucketError,
    area_kept,
    auto_buckets,
    bucket_name,
    far_from_area,
    nearest_bucket,
    parse_buckets,
)
from ldm.models.build import model_size_step
from ldm.prepare.write import encode_image


@pytest.mark.parametrize("resolution, step", [(256, 64), (512, 64), (1024, 64), (32, 8), (64, 8)])
def test_auto_buckets_have_the_area_the_step_and_the_ratios_asked_for(resolution, step):
    buckets = auto_buckets(resolution, step, 2.0)
    assert (resolution, resolution) in buckets
    assert set(buckets) == {(w, h) for h, w in buckets}  # every landscape bucket has its portrait
    for height, width in buckets:
        assert height % step == 0 and width % step == 0
        assert max(height, width) / min(height, width) <= 2.0
        assert abs(height * width / resolution**2 - 1) < 0.15
    ratios = [w / h for h, w in buckets]
    assert ratios == sorted(ratios)


def test_the_presets_size_steps_and_the_buckets_of_ldm_32layer_at_256():
    assert model_size_step("ldm-32layer") == 64 and model_size_step("ldm-tiny") == 8
    assert [bucket_name(b) for b in auto_buckets(256, 64)] == ["384x192", "320x192", "256x256", "192x320", "192x384"]
    assert len(auto_buckets(512, 64, 1.5)) < len(auto_buckets(512, 64, 2.0))


def test_bucket_lists_are_parsed_or_refused_in_one_line():
    assert parse_buckets("none", 256, 64) is None
    assert parse_buckets("192x320, 256x256 320x192", 256, 64) == ((320, 192), (256, 256), (192, 320))
    for bad, message in (("256", "HEIGHTxWIDTH"), ("200x256", "multiple of 64"), ("0x64", "multiple of 64"),
                         (",", "no bucket")):
        with pytest.raises(BucketError, match=message):
            parse_buckets(bad, 256, 64)
    with pytest.raises(BucketError, match="multiple of 64"):
        parse_buckets("auto", 288, 64)
    with pytest.raises(BucketError, match="wider than --max_aspect_ratio 1.5"):
        parse_buckets("256x256,192x384", 256, 64, 1.5)  # the flag bounds a list too, not auto alone
    assert parse_buckets("192x384", 256, 64, 2.0) == ((192, 384),)
    assert far_from_area(parse_buckets("64x64,256x256,192x320", 256, 64), 256) == [(64, 64)]
    with pytest.raises(ArgumentError, match="HEIGHTxWIDTH"):
        DataArguments(aspect_buckets="wide")
    with pytest.raises(ArgumentError, match="is empty"):  # an unset shell variable is no choice of square crops
        DataArguments(aspect_buckets=" ")
    with pytest.raises(ArgumentError, match="max_aspect_ratio"):
        DataArguments(max_aspect_ratio=0.5)


def test_a_record_goes_to_the_bucket_nearest_its_aspect_ratio():
    buckets = auto_buckets(256, 64)
    assert nearest_bucket(buckets, 640, 480) == (192, 320)  # 4:3 -> 5:3 rather than 1:1 (in log ratio)
    assert nearest_bucket(buckets, 480, 640) == (320, 192)
    assert nearest_bucket(buckets, 500, 480) == (256, 256)
    assert nearest_bucket(buckets, 3000, 500) == (192, 384)  # beyond the widest: the widest
    assert area_kept(400, 200, (192, 384)) == pytest.approx(1.0)
    assert area_kept(400, 200, (256, 256)) == pytest.approx(0.5)
    assert area_kept(640, 480, (192, 320)) == pytest.approx((4 / 3) / (5 / 3))


@pytest.mark.parametrize("kind", ["JPEG", "PNG"])
def test_the_bucketed_crop_has_its_buckets_shape_and_keeps_what_it_covers(kind):
    buckets = auto_buckets(64, 8)
    rng, matched = random.Random(0), []
    for width, height in [(300, 150), (150, 300), (200, 200), (333, 250), (90, 40), (352, 192), (192, 352), (240, 400)]:
        data = encode_image(photo(width, height, seed=width), kind, **({"quality": 95} if kind == "JPEG" else {}))
        bucket = nearest_bucket(buckets, width, height)
        random_crop = ImageTransform(64, buckets=buckets)(data, rng)
        centre = ImageTransform(64, buckets=buckets, center_crop=True)(data, rng)
        assert random_crop.shape == centre.shape == (*bucket, 3) and centre.dtype == np.uint8
        if math.isclose(width / height, bucket[1] / bucket[0], rel_tol=0.01):
            # the bucket holds the whole image: the centre crop is the image resized
            whole = np.asarray(photo(width, height, seed=width).resize(bucket[::-1]))
            assert np.abs(centre.astype(int) - whole.astype(int)).mean() < 8
            matched.append(bucket)
    assert {(48, 88), (88, 48), (64, 64), (80, 48)} <= set(matched)  # wide, tall and square buckets held whole
    square = ImageTransform(64)(encode_image(photo(300, 150), "PNG"), rng)
    assert square.shape == (64, 64, 3)


def test_stats_reports_the_bucket_histogram_and_the_area_kept(tmp_path):
    listing = write_aspect_corpus(str(tmp_path / "c"), 30, 10, seed=5)
    out = run_python(["-m", "ldm.data", "stats", "--file_list", listing, "--resolution", "32", "--aspect_buckets",
                      "auto", "--model_name_or_path", "ldm-tiny", "--json"])
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout)
    buckets = auto_buckets(32, 8)
    sizes = aspect_sizes(30, seed=5)
    expected = {bucket_name(b): 0 for b in buckets}
    for width, height in sizes:
        expected[bucket_name(nearest_bucket(buckets, width, height))] += 1
    assert stats["buckets"] == expected and stats["ok"] == 30
    kept = stats["area_kept"]
    assert kept["buckets"] == pytest.approx(np.mean([area_kept(w, h, nearest_bucket(buckets, w, h)) for w, h in sizes]))
    assert kept["center_crop"] == pytest.approx(np.mean([min(w, h) / max(w, h) for w, h in sizes]))
    assert kept["buckets"] > kept["center_crop"]

    text = run_python(["-m", "ldm.data", "stats", "--file_list", listing, "--resolution", "32", "--aspect_buckets",
                       "auto", "--model_name_or_path", "ldm-tiny"])
    assert "area kept" in text.stdout and "24x48" in text.stdout
    bad = run_python(["-m", "ldm.data", "stats", "--file_list", listing, "--resolution", "36", "--aspect_buckets",
                      "auto", "--model_name_or_path", "ldm-tiny"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --aspect_buckets auto")


def test_bench_compares_buckets_with_square_crops_on_the_same_shards(tmp_path):
    listing = write_aspect_corpus(str(tmp_path / "c"), 24, 12, seed=6)
    out = run_python(["-m", "ldm.data", "bench", "--file_list", listing, "--resolution", "32", "--num_samples", "40",
                      "--rounds", "1", "--aspect_buckets", "auto", "--model_name_or_path", "ldm-tiny"])
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("square crops") and lines[1].startswith("buckets") and lines[2].startswith("ratio")


def test_a_yaml_list_of_buckets_is_one_flag(tmp_path):
    from ldm.config.record import expand_config

    (tmp_path / "run.yaml").write_text("aspect_buckets: [24x40, 40x24]\nresolution: 32\n")
    argv = expand_config(["--config", str(tmp_path / "run.yaml")])
    assert argv[argv.index("--aspect_buckets") + 1] == "24x40,40x24"


def test_a_bucket_past_the_aspect_ratio_is_called_taller_or_wider_as_it_is():
    with pytest.raises(BucketError, match="64x8 is taller than --max_aspect_ratio 2 allows"):
        parse_buckets("64x8", 32, 8, 2.0)
    with pytest.raises(BucketError, match="8x64 is wider than --max_aspect_ratio 2 allows"):
        parse_buckets("8x64", 32, 8, 2.0)
