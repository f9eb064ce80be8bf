"""Pickled weights (torch's zip and legacy formats, Paddle's .pdparams) read without torch and without running code:
real files are read exactly, and a file that carries code is refused before any of it runs, through the
restricted reader and through the command users call (`ldm.evaluate convert-inception`)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from conftest import ROOT

from ldm.models.pickled import TORCH_LEGACY_MAGIC, PickleError, read_pickled_weights

FIXTURES = ROOT / "tests" / "fixtures" / "eval"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())


def test_torch_checkpoints_are_read_without_torch_in_both_formats():
    """tiny_zip.pth and tiny_legacy.pth were written by torch.save (tests/reference/make_eval_fixtures.py)."""
    expected = REFERENCE["torch_checkpoint"]
    for name, kind in (("tiny_zip.pth", "torch checkpoint (zip)"), ("tiny_legacy.pth", "torch checkpoint (legacy)")):
        state, got_kind = read_pickled_weights(str(FIXTURES / name))
        assert got_kind == kind
        assert set(state) == set(expected)
        assert state["Conv2d_1a_3x3.bn.num_batches_tracked"].dtype == np.int64
        assert int(state["Conv2d_1a_3x3.bn.num_batches_tracked"]) == 7
        assert state["half"].dtype == np.float16 and state["half"].tolist() == expected["half"]
        assert state["transposed"].shape == (32, 32)  # a view stored with its strides
        for key, digest in expected.items():
            if isinstance(digest, str):
                assert hashlib.sha256(np.ascontiguousarray(state[key]).tobytes()).hexdigest() == digest, key
    assert "torch" not in sys.modules


def test_a_paddle_state_dict_reads_as_paddle_load_reads_it(tmp_path):
    import paddle

    layer = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.BatchNorm1D(4), paddle.nn.Embedding(5, 2))
    path = str(tmp_path / "model.pdparams")
    paddle.save(layer.state_dict(), path)
    expected = paddle.load(path, return_numpy=True)
    state, kind = read_pickled_weights(path)
    assert kind == "Paddle state dict"
    assert set(state) == set(expected) - {"StructuredToParameterName@@"}
    for name, value in state.items():
        assert value.dtype == expected[name].dtype
        np.testing.assert_array_equal(value, expected[name])


class _Reduced:
    """An object that pickles as `factory(*args)`: how Paddle 2.x saved its tensors, and how a payload hides."""

    def __init__(self, factory, *args):
        self.factory, self.args = factory, args

    def __reduce__(self):
        return self.factory, self.args


def test_the_older_paddle_forms_of_a_tensor_are_read(tmp_path):
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "old.pdparams"
    with open(path, "wb") as f:  # Paddle 2.x: (name, array) tuples; a LoDTensor as eval('data', {'data': array})
        pickle.dump({"w": _Reduced(tuple, ("linear_0.w_0", weight)),
                     "lod": _Reduced(eval, "data", {"data": weight + 1})}, f, protocol=2)
    state, _ = read_pickled_weights(str(path))
    np.testing.assert_array_equal(state["w"], weight)
    np.testing.assert_array_equal(state["lod"], weight + 1)


def _torch_zip(path, tree) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(tree, protocol=2))


def _torch_legacy(path, tree) -> None:
    with open(path, "wb") as f:
        for part in (TORCH_LEGACY_MAGIC, 1001, {"little_endian": True}, tree, []):
            pickle.dump(part, f, protocol=2)


def _paddle(path, tree) -> None:
    with open(path, "wb") as f:
        pickle.dump(tree, f, protocol=4)


WRITERS = {"evil_zip.pth": _torch_zip, "evil_legacy.pth": _torch_legacy, "evil.pdparams": _paddle}


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("payload", ["system", "eval"])
def test_a_pickle_that_carries_code_is_refused_before_it_runs(tmp_path, name, payload):
    marker = tmp_path / "PWNED"
    command = f"echo PWNED > {marker}"
    code = (_Reduced(os.system, command) if payload == "system"
            else _Reduced(eval, f"__import__('os').system({command!r})"))
    path = tmp_path / name
    WRITERS[name](path, {"Conv2d_1a_3x3.conv.weight": np.zeros(2, np.float32), "a": code})
    with pytest.raises(PickleError, match="not read \\(a pickle can run code\\)"):
        read_pickled_weights(str(path))
    assert not marker.exists()

    # the command users run, as they run it
    result = subprocess.run([sys.executable, "-m", "ldm.evaluate", "convert-inception", str(path), "--output",
                             str(tmp_path / "x.safetensors")], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "a pickle can run code" in lines[0], result.stderr[-2000:]
    assert not marker.exists()
    assert not (tmp_path / "x.safetensors").exists()


def test_files_that_are_no_weights_are_one_clear_error(tmp_path):
    (tmp_path / "text.pth").write_text("not weights")
    (tmp_path / "cut.pdparams").write_bytes(pickle.dumps({"w": np.zeros(1000, np.float32)}, protocol=4)[:300])
    (tmp_path / "list.pdparams").write_bytes(pickle.dumps([1, 2], protocol=4))
    for name, message in (("text.pth", "neither a torch checkpoint nor a Paddle state dict"),
                          ("cut.pdparams", "cannot read it as a Paddle state dict"),
                          ("list.pdparams", "holds a list, not a state dict"),
                          ("missing.pth", "no such file")):
        with pytest.raises(PickleError, match=message):
            read_pickled_weights(str(tmp_path / name))


def test_a_torch_checkpoint_cut_short_says_so(tmp_path):
    """A zip whose end (its central directory) is missing is not read as another format."""
    data = (FIXTURES / "tiny_zip.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(PickleError, match="torch checkpoint .zip. cut short or damaged"):
        read_pickled_weights(str(tmp_path / "cut.pth"))
