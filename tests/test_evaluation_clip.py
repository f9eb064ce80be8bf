"""CLIP score against transformers: a tiny random CLIP saved in Hugging Face's format by transformers
(tests/fixtures/eval/tiny-clip, made by tests/reference/make_eval_fixtures.py) loaded into PaddleNLP's CLIPModel,
its per-sample 100 * cos checked against transformers' on the same images and captions."""

from __future__ import annotations

import json
import shutil

import eval_weights as ew
import numpy as np
import pytest
from conftest import ROOT
from PIL import Image
from test_evaluation_fid import assert_user_error, run

from ldm.evaluation.clip import ClipError, ClipScorer, ImagePreprocessor, aggregate, paddle_state

FIXTURES = ROOT / "tests" / "fixtures" / "eval"
CLIP = FIXTURES / "tiny-clip"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())["clip"]


@pytest.fixture(scope="module")
def scorer():
    return ClipScorer(str(CLIP))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The test images as PNG files in caption order, and the captions file."""
    root = tmp_path_factory.mktemp("clip")
    (root / "images").mkdir()
    for i, image in enumerate(ew.make_images()):
        Image.fromarray(image).save(root / "images" / f"{i:02d}.png")
    (root / "captions.txt").write_text("\n".join(ew.CAPTIONS) + "\n")
    return root


def test_tokens_and_pixels_are_transformers(scorer):
    ids, mask = scorer.tokenize(ew.CAPTIONS)
    ours = [row[: int(m.sum())] for row, m in zip(ids.tolist(), mask, strict=True)]
    assert ours == REFERENCE["input_ids"]
    assert len(ours[6]) == 77 and ours[6][-1] == max(ours[6])  # the long caption: cut to 77, ends at <|endoftext|>
    pixels = np.stack([scorer.preprocess(image) for image in ew.make_images()])
    np.testing.assert_allclose(pixels, np.load(FIXTURES / "clip_pixel_values.npz")["pixel_values"], atol=1e-5)


def test_per_sample_clip_matches_transformers(scorer):
    score, per_sample = scorer.clip_score(ew.make_images(), ew.CAPTIONS)
    assert np.abs(per_sample - np.array(REFERENCE["per_sample"])).max() < 0.05
    assert (per_sample < 0).any()  # the random model: negative cosines exist, and are clamped in the score
    assert score == pytest.approx(np.mean(np.maximum(REFERENCE["per_sample"], 0)), abs=0.05)
    assert aggregate([-3.0, 10.0, 20.0]) == pytest.approx(10.0)


def test_the_clip_score_command(folder, capsys):
    code, out, err = run(["clip-score", "--images", str(folder / "images"), "--captions",
                          str(folder / "captions.txt"), "--clip", str(CLIP), "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert np.abs(np.array(result["per_sample"]) - REFERENCE["per_sample"]).max() < 0.05
    assert result["clip_score"] == pytest.approx(aggregate(result["per_sample"]))


def test_preprocessor_configs_of_either_era_prepare_the_same_pixels():
    old = json.loads((CLIP / "preprocessor_config.json").read_text())  # openai's 2021 layout: plain ints
    new = {**old, "size": {"shortest_edge": old["size"]}, "crop_size": {"height": 32, "width": 32},
           "do_rescale": True, "rescale_factor": 1 / 255}
    image = ew.make_images()[1]  # 200 x 320: the shorter side is the height
    a, b = ImagePreprocessor(old)(image), ImagePreprocessor(new)(image)
    assert a.shape == (3, 32, 32)
    np.testing.assert_array_equal(a, b)
    assert ImagePreprocessor(old).output_size(200, 320) == (40, 64)
    assert ImagePreprocessor(old).output_size(333, 250) == (53, 40)


def test_hugging_face_names_map_onto_paddlenlp_and_an_unknown_one_is_refused():
    from safetensors.numpy import load_file

    hf = load_file(str(CLIP / "model.safetensors"))
    mapped = paddle_state({**hf, "text_model.embeddings.position_ids": np.arange(77)[None]})
    np.testing.assert_array_equal(mapped["text_projection"], hf["text_projection.weight"].T)
    np.testing.assert_array_equal(mapped["vision_model.transformer.layers.1.linear2.weight"],
                                  hf["vision_model.encoder.layers.1.mlp.fc2.weight"].T)
    with pytest.raises(ClipError, match="unknown weight 'vision_model.head.weight'"):
        paddle_state({**hf, "vision_model.head.weight": np.zeros((2, 2), np.float32)})


def test_clip_user_errors_are_one_line(folder, tmp_path, capsys):
    base = ["clip-score", "--images", str(folder / "images"), "--clip", str(CLIP), "--captions"]
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run([*base, str(tmp_path / "empty.txt")], capsys)
    assert_user_error(code, err, "empty", "one caption per line")

    (tmp_path / "short.txt").write_text("\n".join(ew.CAPTIONS[:5]) + "\n")
    code, _, err = run([*base, str(tmp_path / "short.txt")], capsys)
    assert_user_error(code, err, "8 images", "5 captions")

    broken = tmp_path / "broken"
    shutil.copytree(folder / "images", broken)
    (broken / "03.png").write_bytes(b"not a png")
    code, _, err = run(["clip-score", "--images", str(broken), "--captions", str(folder / "captions.txt"),
                        "--clip", str(CLIP)], capsys)
    assert_user_error(code, err, "03.png", "not a readable image")

    no_weights = tmp_path / "no-weights"
    shutil.copytree(CLIP, no_weights)
    (no_weights / "model.safetensors").unlink()
    (no_weights / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    code, _, err = run([*base[:4], str(no_weights), "--captions", str(folder / "captions.txt")], capsys)
    assert_user_error(code, err, "model.safetensors", "not loaded")

    misshapen = tmp_path / "misshapen"
    shutil.copytree(CLIP, misshapen)
    config = json.loads((misshapen / "config.json").read_text())
    config["text_config"]["hidden_size"] = 64
    (misshapen / "config.json").write_text(json.dumps(config))
    code, _, err = run([*base[:4], str(misshapen), "--captions", str(folder / "captions.txt")], capsys)
    assert_user_error(code, err, "text_projection has shape (32, 16), its config.json gives (64, 16)")


def test_captions_end_at_their_last_line_and_a_blank_one_inside_is_refused(tmp_path):
    from ldm.evaluate import EvalError, read_captions

    (tmp_path / "ok.txt").write_text("a red circle\na blue square\n\n\n")
    assert read_captions(str(tmp_path / "ok.txt")) == ["a red circle", "a blue square"]
    (tmp_path / "gap.txt").write_text("a red circle\n\na blue square\n")
    with pytest.raises(EvalError, match="line 2 is blank"):
        read_captions(str(tmp_path / "gap.txt"))
