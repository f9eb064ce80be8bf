"""The shapes classifier: exact on real corpus images, robust to blur, honest about empty images."""

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from apps.eval import classify, corpus_reference, eval_prompts, parse_caption, score
from ldm.prepare.synth import COLOURS, SHAPES, record


@pytest.mark.parametrize("resolution", [32, 64])
def test_classifier_reads_real_corpus_images(resolution):
    result = corpus_reference(600, resolution, seed=7)
    assert result["images"] == 600
    for name in ("object_colour", "background", "shape", "all_three"):
        assert result[name] >= 0.99, result


def test_classifier_survives_the_blur_of_a_decoder():
    captions, readings = [], []
    for i in range(200):
        text, image = record(i, 11, 32)
        captions.append(text)
        readings.append(classify(np.asarray(image.filter(ImageFilter.GaussianBlur(0.8)))))
    result = score(readings, captions)
    assert result["object_colour"] >= 0.97 and result["background"] >= 0.99 and result["shape"] >= 0.9, result


def test_an_image_without_an_object_has_no_colour_or_shape_and_scores_wrong():
    blank = np.asarray(Image.new("RGB", (32, 32), COLOURS["blue"]))
    reading = classify(blank)
    assert (reading.colour, reading.shape, reading.background) == (None, None, "blue")
    result = score([reading], ["a red circle on a blue background"])
    assert result["background"] == 1.0 and result["object_colour"] == 0.0 and result["shape"] == 0.0
    assert result["shape_misread"] == {"circle as nothing": 1}


def test_score_counts_which_shape_was_read_as_which():
    """A triangle whose point is lost (as a blurring decoder loses small ones) fills 72% of its box: a circle."""
    records = [record(i, 11, 32) for i in range(60)]
    captions = [text for text, _ in records]
    readings = [classify(np.asarray(image)) for _, image in records]
    for colour in ("red", "green"):
        image = Image.new("RGB", (32, 32), COLOURS["blue"])
        ImageDraw.Draw(image).polygon([(10, 8), (22, 8), (26, 24), (6, 24)], fill=COLOURS[colour])
        captions.append(f"a {colour} triangle on a blue background")
        readings.append(classify(np.asarray(image)))
    result = score(readings, captions)
    assert result["shape_misread"] == {"triangle as circle": 2}, result
    assert result["shape"] == 60 / 62 and result["object_colour"] == 1.0


def test_eval_prompts_cover_every_colour_background_and_shape():
    parsed = [parse_caption(p) for p in eval_prompts()]
    assert {c for c, _, _ in parsed} == set(COLOURS) == {b for _, _, b in parsed}
    assert {s for _, s, _ in parsed} == set(SHAPES)
    assert all(c != b for c, _, b in parsed)
    with pytest.raises(ValueError):
        parse_caption("a photo of a cat")


def test_autoencoder_command_scores_the_reconstructions_not_the_inputs(tmp_path, capsys):
    """`python -m apps.eval autoencoder` with an untrained autoencoder: its reconstructions carry no shape, so
    the scores must be far below the classifier's on the inputs (>= 99%, above)."""
    import json

    from ppdiffusers import AutoencoderKL

    from apps.eval import main
    from ldm.models.build import PRESETS_DIR, read_config

    folder = tmp_path / "vqvae"
    AutoencoderKL.from_config(read_config(PRESETS_DIR / "ldm-tiny" / "vqvae")).save_pretrained(str(folder))
    grid = tmp_path / "grid.png"
    assert main(["autoencoder", "--vqvae", str(folder), "--resolution", "32", "--num_images", "40",
                 "--grid", str(grid), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["vqvae"] == str(folder) and result["reconstructions"]["images"] == 40
    assert result["reconstructions"]["all_three"] < 0.5 and result["reconstructions"]["mean_abs_error"] > 0.05
    assert Image.open(grid).size == (32 * 16, 32 * 2)  # inputs above reconstructions

    with pytest.raises(SystemExit) as error:
        main(["autoencoder", "--vqvae", str(tmp_path / "missing"), "--resolution", "32"])
    assert error.value.code == 2 and "not an AutoencoderKL folder" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()  # a mistyped path is not made into an empty folder
