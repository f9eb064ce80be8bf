"""The captioned-shapes corpus: deterministic, in the production format, captions match pixels."""

import random
import subprocess
import sys

import numpy as np
from conftest import ROOT

from ldm.data.filelist import read_file_list
from ldm.data.record import ImageTransform, parse_record
from ldm.data.shard import iter_lines
from ldm.data.synth import COLOURS, record


def nearest_colour(rgb) -> str:
    return min(COLOURS, key=lambda name: sum((int(a) - b) ** 2 for a, b in zip(rgb, COLOURS[name], strict=True)))


def describe(pixels: np.ndarray) -> tuple[str, str, str]:
    """(colour, shape, background) read back from the pixels: border colour, the rest, bbox fill ratio."""
    labels = np.array([[nearest_colour(p) for p in row] for row in pixels])
    border = np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]])
    background = max(set(border), key=list(border).count)
    mask = labels != background
    colour = max(set(labels[mask]), key=list(labels[mask]).count)
    ys, xs = np.nonzero(mask)
    fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    shape = "square" if fill > 0.9 else "circle" if fill > 0.65 else "triangle"
    return colour, shape, background


def test_records_are_deterministic_and_captions_match_pixels():
    for i in range(24):
        text, image = record(i, seed=3, resolution=48)
        again_text, again = record(i, seed=3, resolution=48)
        assert text == again_text and np.array_equal(np.asarray(image), np.asarray(again))
        colour, shape, background = describe(np.asarray(image))
        assert text == f"a {colour} {shape} on a {background} background"
    assert [record(i, 3, 48)[0] for i in range(24)] != [record(i, 4, 48)[0] for i in range(24)]


def test_synth_command_writes_readable_shards_and_a_vocab(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ldm.data", "synth", "--output_dir", str(tmp_path), "--num_records",
                          "30", "--resolution", "32", "--records_per_shard", "8", "--seed", "1"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    shards = read_file_list(str(tmp_path / "shapes.filelist.list"))
    assert len(shards) == 4
    lines = [line for s in shards for line in iter_lines(s.path)]
    assert len(lines) == 30
    caption, data = parse_record(lines[7])
    assert caption == record(7, seed=1, resolution=32)[0]
    crop = ImageTransform(32, resize_ratio=1.0, center_crop=True)(data, random.Random(0))
    assert np.array_equal(crop, np.asarray(record(7, seed=1, resolution=32)[1]))
    vocab = (tmp_path / "tokenizer" / "vocab.txt").read_text().split()
    assert {"[PAD]", "purple", "triangle", "background"} <= set(vocab)
