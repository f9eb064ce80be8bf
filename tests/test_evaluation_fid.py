"""FID against the reference tools: the Paddle FID Inception, both preprocessing modes, the statistics, the Fréchet
distance and the weights converter, checked against values pytorch-fid and clean-fid computed
(tests/reference/make_eval_fixtures.py, run in a virtualenv with torch) on the same seeded weights and images.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

import eval_weights as ew
import numpy as np
import pytest
from conftest import ROOT
from PIL import Image
from safetensors.numpy import load_file, save_file

from ldm.evaluate import main
from ldm.evaluation.fid import (
    FID_METHODS,
    MODES,
    FIDError,
    Statistics,
    check_comparable,
    frechet_distance,
    inception_features,
    small_sample_warning,
    statistics,
)

FIXTURES = ROOT / "tests" / "fixtures" / "eval"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
SET_A, SET_B = REFERENCE["fid_sets"]


@pytest.fixture(scope="module")
def weights():
    state = ew.random_inception()
    assert ew.weights_digest(state) == REFERENCE["weights_digest"], (
        "tests/eval_weights.py no longer makes the weights the reference values were computed with (another "
        "numpy?): run tests/reference/make_eval_fixtures.py again")
    return state


@pytest.fixture(scope="module")
def weights_file(weights, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("inception") / "inception.safetensors")
    save_file(weights, path)
    return path


@pytest.fixture(scope="module")
def inception(weights):
    from ldm.evaluation.inception import Inception

    return Inception(weights)


@pytest.fixture(scope="module")
def images():
    made = ew.make_images()
    import hashlib

    assert hashlib.sha256(b"".join(i.tobytes() for i in made)).hexdigest() == REFERENCE["images_sha256"]
    return made


@pytest.fixture(scope="module")
def features(inception, images):
    return {mode: inception_features(images, inception, mode, batch_size=4) for mode in MODES}


@pytest.fixture(scope="module")
def folders(images, tmp_path_factory):
    """The test images as PNG files: all of them, and the two halves the reference FID compares."""
    root = tmp_path_factory.mktemp("images")
    for name, indices in (("all", range(len(images))), ("a", SET_A), ("b", SET_B)):
        (root / name).mkdir()
        for i in indices:
            Image.fromarray(images[i]).save(root / name / f"{i:02d}.png")
    return root


def run(argv, capsys) -> tuple[int, str, str]:
    code = main([*argv, "--threads", "1"] if argv[0] != "convert-inception" else argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *words: str) -> None:
    """Exit 2 with one `error:` line on stderr naming what is wrong, and no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]


# -- the network and the preprocessing against pytorch-fid -------------------------------------------------
def test_pool3_features_match_pytorch_fid_in_both_modes(features):
    reference = np.load(FIXTURES / "inception_features.npz")
    for mode in MODES:
        ours, theirs = features[mode], reference[mode]
        assert ours.shape == theirs.shape == (8, 2048)
        relative = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
        assert relative.max() < 1e-3, (mode, relative)
    # the modes differ (the resize is not the same), and by more than the port's error
    assert np.abs(features["clean"] - features["legacy_pytorch"]).max() > 1e-2


def low_rank_fid(a: np.ndarray, b: np.ndarray) -> float:
    """FID of two small feature sets in exact closed form: with X centered and S = X^T X / (n - 1), the nonzero
    eigenvalues of S_a^1/2 S_b S_a^1/2 are those of the n x n matrix (X_a X_b^T)(X_b X_a^T) / (n - 1)^2.
    (scipy's sqrtm of the 2048 x 2048 product takes ~10 s on 2 cores: the command's test runs it once.)"""
    xa, xb = a - a.mean(0), b - b.mean(0)
    cross = xa @ xb.T / np.sqrt((len(a) - 1) * (len(b) - 1))
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh(cross @ cross.T), 0, None)).sum()
    diff = a.mean(0) - b.mean(0)
    return float(diff @ diff + (xa * xa).sum() / (len(a) - 1) + (xb * xb).sum() / (len(b) - 1) - 2 * trace_root)


def test_fid_matches_pytorch_fid_on_the_same_images(features):
    for mode in MODES:
        a, b = features[mode][SET_A].astype(np.float64), features[mode][SET_B].astype(np.float64)
        assert low_rank_fid(a, b) == pytest.approx(REFERENCE["fid"][mode], rel=0.01)
    # pytorch-fid's calculate_fid_given_paths on the two folders (its whole path) gave the same value
    assert REFERENCE["fid"]["legacy_pytorch"] == pytest.approx(
        REFERENCE["fid"]["legacy_pytorch_calculate_fid_given_paths"], rel=1e-6)


def test_the_stats_and_fid_commands_match_pytorch_fid_end_to_end(weights_file, folders, tmp_path, capsys):
    code, out, err = run(["stats", "--images", str(folders / "a"), "--inception", weights_file, "--mode",
                          "legacy_pytorch", "--output", str(tmp_path / "a.npz"), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["images"] == 4
    assert "fewer than 2048" in err  # FID of 4 images is biased: said
    stats = Statistics.load(str(tmp_path / "a.npz"))
    assert (stats.mode, stats.num_images, stats.resolution) == ("legacy_pytorch", 4, None)
    assert stats.weights_sha256 and len(stats.weights_sha256) == 64
    # a folder against statistics: measured the way the statistics were (their mode: the clean FID is 1.5%
    # away), with the same weights; the distance is pytorch-fid's (scipy's sqrtm of rank-3 covariances)
    code, out, err = run(["fid", str(tmp_path / "a.npz"), str(folders / "b"), "--inception", weights_file, "--json"],
                         capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["mode"] == "legacy_pytorch" and result["images"] == [4, 4]
    assert result["fid"] == pytest.approx(REFERENCE["fid"]["legacy_pytorch"], rel=0.01)


def test_in_memory_float_images_give_the_features_of_their_uint8_files(inception, images, features):
    """Generated images reach the metric as arrays: float in [0, 1] is the same as the uint8 it rounds to."""
    as_float = [images[3].astype(np.float32) / 255, images[5].astype(np.float64) / 255]
    got = inception_features(as_float, inception, "clean", batch_size=2)
    np.testing.assert_allclose(got, features["clean"][[3, 5]], rtol=1e-4, atol=1e-5)


# -- the Fréchet distance ------------------------------------------------------------------------------
def sqrtm_trace_by_eigenvalues(sigma1, sigma2) -> float:
    """Tr sqrt(S1 S2) for symmetric PSD S1, S2: the eigenvalues of S1^1/2 S2 S1^1/2, without sqrtm."""
    w, v = np.linalg.eigh(sigma1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    return float(np.sqrt(np.clip(np.linalg.eigvalsh(root @ sigma2 @ root), 0, None)).sum())


@pytest.mark.parametrize("kind", ["well_conditioned", "rank_deficient"])
def test_frechet_distance_is_pytorch_fids_on_full_and_rank_deficient_covariances(kind):
    mu1, sigma1, mu2, sigma2 = ew.covariance_pair(kind)
    # the default (eigenvalues) to 1e-4 of pytorch-fid's function on the same inputs; sqrtm is that function
    assert frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(REFERENCE["frechet"][kind], rel=1e-4)
    assert frechet_distance(mu1, sigma1, mu2, sigma2, method="sqrtm") == pytest.approx(REFERENCE["frechet"][kind],
                                                                                       rel=1e-6)
    diff = mu1 - mu2
    closed_form = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * sqrtm_trace_by_eigenvalues(sigma1, sigma2)
    assert frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(closed_form, rel=1e-9)
    if kind == "rank_deficient":
        assert np.linalg.matrix_rank(sigma1) < sigma1.shape[0]


def test_the_eigenvalue_form_gives_pytorch_fids_value_on_real_inception_features():
    """pool3 features pytorch-fid computed of real images (2048 wide, rank 3 per side: the singular case its eps
    retry exists for): its calculate_frechet_distance's value to 1e-4, without scipy's sqrtm."""
    reference = np.load(FIXTURES / "inception_features.npz")["legacy_pytorch"]  # (one mode: a 2048-wide eigh each)
    a, b = reference[SET_A].astype(np.float64), reference[SET_B].astype(np.float64)
    value = frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))
    assert value == pytest.approx(REFERENCE["fid"]["legacy_pytorch"], rel=1e-4)
    with pytest.raises(FIDError, match="unknown FID method"):
        frechet_distance(a.mean(0), np.eye(2048), b.mean(0), np.eye(2048), method="schur")


def test_frechet_distance_of_equal_statistics_is_zero_and_a_non_psd_one_is_refused():
    mu, sigma, _, _ = ew.covariance_pair("well_conditioned")
    assert frechet_distance(mu, sigma, mu, sigma) == pytest.approx(0, abs=1e-6)
    for method in FID_METHODS:
        with pytest.raises(FIDError, match="imaginary"):
            frechet_distance(np.zeros(2), np.diag([1.0, -4.0]), np.zeros(2), np.eye(2), method=method)
    with pytest.raises(FIDError, match="dimensions"):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))


# -- statistics files --------------------------------------------------------------------------------------
def test_statistics_files_round_trip_and_pytorch_fids_plain_files_load(tmp_path):
    rng = np.random.default_rng(0)
    stats = statistics(rng.standard_normal((5, 16)), "clean", "ab" * 32, 256)
    stats.save(str(tmp_path / "s.npz"))
    back = Statistics.load(str(tmp_path / "s.npz"))
    np.testing.assert_array_equal(back.mu, stats.mu)
    np.testing.assert_array_equal(back.sigma, stats.sigma)
    assert (back.mode, back.num_images, back.weights_sha256, back.resolution) == ("clean", 5, "ab" * 32, 256)
    assert "fewer than 2048" in small_sample_warning(back)
    assert small_sample_warning(statistics(rng.standard_normal((2048, 3)))) is None

    np.savez(tmp_path / "plain.npz", mu=stats.mu, sigma=stats.sigma)  # what pytorch-fid --save-stats writes
    plain = Statistics.load(str(tmp_path / "plain.npz"))
    assert plain.mode is None and plain.num_images is None
    notes = check_comparable(back, plain, "ours", "theirs")
    assert len(notes) == 1 and "theirs does not record" in notes[0]


def test_statistics_of_another_mode_weights_or_resolution_are_refused():
    rng = np.random.default_rng(1)
    base = statistics(rng.standard_normal((4, 8)), "clean", "a" * 64, 256)
    for change, word in (({"mode": "legacy_pytorch"}, "mode"), ({"weights_sha256": "b" * 64}, "weights"),
                         ({"resolution": 512}, "resolution")):
        other = Statistics(**{**base.__dict__, **change})
        with pytest.raises(FIDError, match=word):
            check_comparable(base, other)
    with pytest.raises(FIDError, match="at least two"):
        statistics(rng.standard_normal((1, 8)))


# -- the weights converter --------------------------------------------------------------------------------
def test_paddlemix_names_map_one_to_one_onto_pytorch_fids():
    """PaddleMIX's FID Inception (ppdiffusers/ppdiffusers/metrics/inception.py) is paddle.vision's
    `inception_v3(num_classes=1008)` with the FID blocks swapped in under paddle.vision's attribute names
    (`branch_pool_conv`, ConvNormActivation's `0`/`1`): its pdparams are named as this model's state dict."""
    import paddle

    from ldm.evaluation.inception import expected_shapes, from_paddle_vision_name

    with paddle.LazyGuard():
        vision = paddle.vision.models.inception_v3(num_classes=1008, with_pool=True)
    names = {k: tuple(v.shape) for k, v in vision.state_dict().items()}
    mapped = {from_paddle_vision_name(k): (v[::-1] if k == "fc.weight" else v) for k, v in names.items()}
    assert len(mapped) == len(names)
    assert mapped == {**expected_shapes(), "fc.weight": (1008, 2048), "fc.bias": (1008,)}


def test_convert_inception_from_paddlemix_pdparams(weights, tmp_path, capsys):
    import paddle

    from ldm.evaluation.inception import from_paddle_vision_name, weights_fingerprint

    with paddle.LazyGuard():
        vision = paddle.vision.models.inception_v3(num_classes=1008, with_pool=True)
    state = {}
    for name in vision.state_dict():
        value = weights[from_paddle_vision_name(name)]
        state[name] = paddle.to_tensor(value.T.copy() if name == "fc.weight" else value)
    paddle.save(state, str(tmp_path / "pp_inception.pdparams"))
    del state
    code, out, err = run(["convert-inception", str(tmp_path / "pp_inception.pdparams"), "--output",
                          str(tmp_path / "w.safetensors")], capsys)
    assert code == 0, err
    assert "PaddleMIX" in out
    converted = load_file(str(tmp_path / "w.safetensors"))
    assert set(converted) == {k for k in weights if not k.startswith("fc.")}
    for key, value in converted.items():
        np.testing.assert_array_equal(value, weights[key])
    assert weights_fingerprint(converted) == weights_fingerprint(weights)


def test_convert_inception_reads_a_torch_checkpoint_and_names_what_it_lacks(tmp_path, capsys):
    code, _, err = run(["convert-inception", str(FIXTURES / "tiny_zip.pth"), "--output",
                        str(tmp_path / "w.safetensors")], capsys)
    # read (no pickle error), then refused as incomplete: the tiny checkpoint holds a few of the 470 weights
    assert_user_error(code, err, "unknown key")
    assert not (tmp_path / "w.safetensors").exists()


# -- user errors ----------------------------------------------------------------------------------------
def test_weights_that_are_a_pickle_unknown_misshapen_or_missing_are_one_line(weights, folders, tmp_path, capsys):
    out = str(tmp_path / "s.npz")
    base = ["stats", "--images", str(folders / "a"), "--output", out, "--inception"]

    code, _, err = run([*base, str(FIXTURES / "tiny_legacy.pth")], capsys)
    assert_user_error(code, err, "is a pickle", "convert-inception")
    code, _, err = run([*base, str(tmp_path / "absent.safetensors")], capsys)
    assert_user_error(code, err, "no such file")
    (tmp_path / "text.safetensors").write_text("not weights")
    code, _, err = run([*base, str(tmp_path / "text.safetensors")], capsys)
    assert_user_error(code, err, "not a safetensors file")

    save_file({**weights, "Mixed_8a.branch1x1.conv.weight": np.zeros(3, np.float32)}, str(tmp_path / "extra.st"))
    code, _, err = run([*base, str(tmp_path / "extra.st")], capsys)
    assert_user_error(code, err, "unknown key", "Mixed_8a.branch1x1.conv.weight")

    wrong = dict(weights)
    wrong["Mixed_6b.branch7x7_2.conv.weight"] = np.zeros((128, 128, 7, 1), np.float32)  # (1, 7) transposed
    save_file(wrong, str(tmp_path / "wrong.st"))
    code, _, err = run([*base, str(tmp_path / "wrong.st")], capsys)
    assert_user_error(code, err, "wrong shape", "Mixed_6b.branch7x7_2.conv.weight")

    partial = {k: v for k, v in weights.items() if not k.startswith("Mixed_7c.")}
    save_file(partial, str(tmp_path / "partial.st"))
    code, _, err = run([*base, str(tmp_path / "partial.st")], capsys)
    assert_user_error(code, err, "missing", "Mixed_7c")
    assert not os.path.exists(out)

    code, _, err = run(["stats", "--images", str(folders / "a"), "--output", out], capsys)
    assert_user_error(code, err, "--inception")


def test_fewer_than_two_images_and_an_unreadable_image_are_one_line(weights_file, folders, tmp_path, capsys):
    one = tmp_path / "one"
    one.mkdir()
    Image.open(folders / "a" / "00.png").save(one / "00.png")
    code, _, err = run(["stats", "--images", str(one), "--inception", weights_file, "--output",
                        str(tmp_path / "s.npz")], capsys)
    assert_user_error(code, err, "1 image", "at least two")

    (one / "01.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"cut short")
    code, _, err = run(["stats", "--images", str(one), "--inception", weights_file, "--output",
                        str(tmp_path / "s.npz")], capsys)
    assert_user_error(code, err, "01.png", "not a readable image")
    assert not (tmp_path / "s.npz").exists()


def test_fid_of_statistics_of_another_mode_or_weights_is_one_line(tmp_path, capsys):
    rng = np.random.default_rng(2)
    features = rng.standard_normal((6, 2048))
    statistics(features, "clean", "a" * 64).save(str(tmp_path / "clean.npz"))
    statistics(features, "legacy_pytorch", "a" * 64).save(str(tmp_path / "legacy.npz"))
    statistics(features, "clean", "b" * 64).save(str(tmp_path / "other.npz"))
    code, _, err = run(["fid", str(tmp_path / "clean.npz"), str(tmp_path / "legacy.npz")], capsys)
    assert_user_error(code, err, "mode clean", "legacy_pytorch")
    code, _, err = run(["fid", str(tmp_path / "clean.npz"), str(tmp_path / "other.npz")], capsys)
    assert_user_error(code, err, "weights")
    with open(tmp_path / "pickled.npz", "wb") as f:
        pickle.dump({"mu": features.mean(0)}, f)
    code, _, err = run(["fid", str(tmp_path / "clean.npz"), str(tmp_path / "pickled.npz")], capsys)
    assert_user_error(code, err, "not a statistics .npz")
    code, _, err = run(["fid", str(tmp_path / "clean.npz"), str(tmp_path / "nothing.npz")], capsys)
    assert_user_error(code, err, "no such")


def test_stats_of_a_corpus_counts_its_bad_records(weights_file, images, tmp_path, capsys):
    from ldm.prepare.write import ShardWriter, encode_image, record_line

    with ShardWriter(str(tmp_path / "corpus"), "val", 10) as writer:
        for i in (0, 1):
            writer.write(record_line(f"caption {i}", encode_image(Image.fromarray(images[i]), "PNG")))
        writer.write(b"a caption\tkey\t!!!not base64!!!\n")
        writer.write(record_line("garbage", b"not an image"))
        writer.write(record_line("last", encode_image(Image.fromarray(images[2]), "JPEG", quality=90)))
    listing = str(tmp_path / "corpus" / "val.filelist.list")
    code, out, err = run(["stats", "--file_list", listing, "--inception", weights_file, "--resolution", "64",
                          "--output", str(tmp_path / "c.npz"), "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["images"] == 3 and report["resolution"] == 64
    assert report["skipped"] == {"bad_base64": 1, "bad_image": 1}
    assert Statistics.load(str(tmp_path / "c.npz")).resolution == 64


def test_the_module_runs_as_a_command_and_answers_a_user_error_in_one_line(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "ldm.evaluate", "convert-inception", str(tmp_path / "none.pth"),
                             "--output", str(tmp_path / "w.safetensors")], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {tmp_path / 'none.pth'}: no such file"] and "Traceback" not in result.stderr


def test_equal_statistics_are_at_fid_0_and_non_finite_ones_are_one_line(tmp_path, capsys):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((64, 16))
    np.savez(tmp_path / "a.npz", mu=features.mean(0), sigma=np.cov(features, rowvar=False))
    code, out, err = run(["fid", str(tmp_path / "a.npz"), str(tmp_path / "a.npz")], capsys)
    assert code == 0, err
    assert out.startswith("FID 0.0000") and "-" not in out.split()[1]
    mu = features.mean(0)
    mu[3] = np.nan
    np.savez(tmp_path / "nan.npz", mu=mu, sigma=np.cov(features, rowvar=False))
    code, _, err = run(["fid", str(tmp_path / "a.npz"), str(tmp_path / "nan.npz")], capsys)
    assert_user_error(code, err, "mu hold non-finite values")


def test_a_grid_beside_the_samples_is_not_a_sample(tmp_path):
    from ldm.evaluation.fid import list_images

    for name in ("000000.png", "000001.png", "grid.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    assert [os.path.basename(p) for p in list_images(str(tmp_path))] == ["000000.png", "000001.png"]


def test_outputs_are_written_whole_and_a_damaged_or_wrong_input_is_one_line(tmp_path, capsys):
    """A full disk mid-write keeps the good file; a truncated .npz, or a PNG named .npz, is one error line."""
    import subprocess

    rng = np.random.default_rng(1)
    features = rng.standard_normal((32, 8))
    good = tmp_path / "good.npz"
    np.savez(good, mu=features.mean(0), sigma=np.cov(features, rowvar=False))
    before = good.read_bytes()
    from ldm.evaluation.fid import Statistics

    code = ("import resource, signal, sys, numpy as np; from ldm.evaluation.fid import Statistics; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000)); "
            "s = Statistics(np.zeros(64), np.eye(64)); s.save(sys.argv[1])")
    full = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, cwd=ROOT)
    assert full.returncode != 0
    assert good.read_bytes() == before and not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
    assert Statistics.load(str(good)).mu.shape == (8,)

    (tmp_path / "cut.npz").write_bytes(before[: len(before) // 2])
    Image.new("RGB", (4, 4)).save(tmp_path / "image.png")
    os.rename(tmp_path / "image.png", tmp_path / "image.npz")
    for name, words in (("cut.npz", "a damaged statistics .npz"), ("image.npz", "a PNG image")):
        code, _, err = run(["fid", str(good), str(tmp_path / name)], capsys)
        assert_user_error(code, err, words)
