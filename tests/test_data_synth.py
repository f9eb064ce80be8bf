"""The captioned-shapes corpus: deterministic, in the production format, captions match pixels."""

import random

import numpy as np
from entry import run_python

from apps.eval import classify
from ldm.data.filelist import read_file_list
from ldm.data.record import ImageTransform, parse_record
from ldm.data.shard import iter_lines
from ldm.prepare.synth import record


def test_records_are_deterministic_and_captions_match_pixels():
    for i in range(24):
        text, image = record(i, seed=3, resolution=48)
        again_text, again = record(i, seed=3, resolution=48)
        assert text == again_text and np.array_equal(np.asarray(image), np.asarray(again))
        assert classify(np.asarray(image)).caption == text
    assert [record(i, 3, 48)[0] for i in range(24)] != [record(i, 4, 48)[0] for i in range(24)]


def test_synth_command_writes_readable_shards_and_a_vocab(tmp_path):
    out = run_python(["-m", "ldm.data", "synth", "--output_dir", str(tmp_path), "--num_records", "30",
                      "--resolution", "32", "--records_per_shard", "8", "--seed", "1"])
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
