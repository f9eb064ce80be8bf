"""Checkpoint formats: nothing a checkpoint carries is ever unpickled, and an earlier version's pickled
checkpoint, once upgraded, resumes to the weights the current format resumes to."""

import os
import pickle
import random
import shutil

import numpy as np
import paddle
import pytest
from corpus import write_corpus
from entry import run_entry, run_python, weights

from ldm.checkpoint.format import EMA, OPTIMIZER, TRAINING_STATE, pickled_files, read_training_state
from ldm.checkpoint.run_folder import LEGACY_STATE_FILE, checkpoint_problem, write_manifest
from ldm.checkpoint.serialization import load_state, save_state, to_paddle

SCRIPT = "train_txt2img_laion400m_no_trainer.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, vocab_dir):
    """A two-update run with EMA: (its arguments, its folder)."""
    folder = tmp_path_factory.mktemp("checkpoint_corpus")
    listing = write_corpus(str(folder / "corpus"), num_records=24, records_per_shard=8, kinds=("jpeg",))
    args = ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32",
            "--train_batch_size", "4", "--num_workers", "0", "--use_ema", "--save_steps", "2"]
    out = folder / "run"
    result = run_entry(SCRIPT, args + ["--max_train_steps", "2", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return args, out


class Payload:
    """Unpickling this writes `marker`: what a malicious checkpoint would run instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_what_a_run_writes_holds_no_pickle(trained):
    args, out = trained
    for folder in (out / "checkpoint-2", out / "pipeline", out / "vqvae"):
        names = [os.path.relpath(os.path.join(root, n), folder) for root, _, files in os.walk(folder) for n in files]
        assert [n for n in names if n.endswith(".safetensors")], folder  # the weights are there, as safetensors
        assert pickled_files(str(folder)) == [], folder


def test_a_crafted_pickle_in_a_checkpoint_is_never_executed(trained, tmp_path):
    args, out = trained
    crafted = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(out, tmp_path / "run", ignore=shutil.ignore_patterns("pipeline"))
    shutil.copytree(out / "checkpoint-2", crafted)
    marker = tmp_path / "pwned"
    for name in ("training_state", "optimizer", "ema"):
        for ext in (".json", ".safetensors"):
            if (crafted / f"{name}{ext}").exists():
                os.remove(crafted / f"{name}{ext}")
    os.remove(crafted / "bert" / "model.safetensors")
    for rel in (LEGACY_STATE_FILE, "optimizer.pdopt", "ema.pdparams", "bert/model_state.pdparams"):
        with open(crafted / rel, "wb") as f:
            pickle.dump(Payload(marker), f)
    os.remove(crafted / "manifest.json")
    write_manifest(str(crafted))  # an attacker seals it too: it passes as complete
    assert checkpoint_problem(str(crafted)) is None

    resumed = run_entry(SCRIPT, args + ["--max_train_steps", "4", "--output_dir", str(tmp_path / "run"),
                                        "--resume_from_checkpoint", str(crafted)])
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert "pickle format of an earlier version" in resumed.stderr
    assert "python -m ldm.checkpoint upgrade" in resumed.stderr
    for tool in (["-m", "ldm.generate", "--model", str(crafted), "--prompt", "a red square",
                  "--output_dir", str(tmp_path / "generated")],
                 ["-m", "ldm.export", "--checkpoint", str(crafted), "--output", str(tmp_path / "pipeline")]):
        result = run_python(tool)
        assert result.returncode != 0 and "pickle format" in result.stderr, result.stderr[-3000:]
    assert not marker.exists()
    assert not (tmp_path / "pipeline").exists()


def downgrade(checkpoint):
    """Rewrite a checkpoint as the previous version wrote it (pickles), from its current files."""
    from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertModel

    state = read_training_state(str(checkpoint))
    generator_type = type(paddle.get_rng_state()[0])
    state["rng"], state["numpy"], state["python"] = [], [], []
    for rank_state in state.pop("random"):
        generators = []
        for values in rank_state["paddle"]:
            generator = generator_type.__new__(generator_type)
            generator.__setstate__(tuple(values))
            generators.append(generator)
        state["rng"].append(generators)
        state["numpy"].append(tuple(rank_state["numpy"]))
        version, internal, gauss = rank_state["python"]
        state["python"].append((version, tuple(internal), gauss))
    state["stream"] = [{**s, "slots": {int(k): v for k, v in s["slots"].items()}} for s in state["stream"]]
    with open(checkpoint / LEGACY_STATE_FILE, "wb") as f:
        pickle.dump(state, f)
    paddle.save(to_paddle(load_state(str(checkpoint), OPTIMIZER)), str(checkpoint / "optimizer.pdopt"))
    paddle.save(to_paddle(load_state(str(checkpoint), EMA)), str(checkpoint / "ema.pdparams"))
    bert = LDMBertModel.from_pretrained(str(checkpoint / "bert"))
    shutil.rmtree(checkpoint / "bert")
    bert.save_pretrained(str(checkpoint / "bert"))  # PaddleNLP's default: model_state.pdparams
    for name in (TRAINING_STATE, OPTIMIZER, EMA):
        for ext in (".json", ".safetensors"):
            os.remove(checkpoint / f"{name}{ext}")
    os.remove(checkpoint / "manifest.json")
    write_manifest(str(checkpoint))


@pytest.mark.slow
def test_an_upgraded_checkpoint_of_the_earlier_format_resumes_as_the_current_one_does(trained, tmp_path):
    args, out = trained
    current, legacy = tmp_path / "current", tmp_path / "legacy"
    for run in (current, legacy):
        shutil.copytree(out, run, ignore=shutil.ignore_patterns("pipeline"))
    downgrade(legacy / "checkpoint-2")
    assert (legacy / "checkpoint-2" / "bert" / "model_state.pdparams").exists()

    refused = run_entry(SCRIPT, args + ["--max_train_steps", "3", "--output_dir", str(legacy),
                                        "--resume_from_checkpoint", "latest"])
    assert refused.returncode == 2 and "python -m ldm.checkpoint upgrade" in refused.stderr, refused.stderr[-2000:]
    upgraded = run_python(["-m", "ldm.checkpoint", "upgrade", str(legacy)])
    assert upgraded.returncode == 0 and "converted" in upgraded.stdout, upgraded.stderr[-2000:]
    assert checkpoint_problem(str(legacy / "checkpoint-2")) is None
    assert not [n for n in os.listdir(legacy / "checkpoint-2" / "bert") if n.endswith(".pdparams")]

    for run in (current, legacy):
        result = run_entry(SCRIPT, args + ["--max_train_steps", "3", "--output_dir", str(run),
                                           "--resume_from_checkpoint", "latest"])
        assert result.returncode == 0, result.stderr[-3000:]
    expected, expected_updates = weights(current / "checkpoint-3")
    got, got_updates = weights(legacy / "checkpoint-3")
    assert got_updates == expected_updates == 3
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_state_trees_round_trip_without_pickle(tmp_path):
    tree = {"step": 3, "nested": {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": (1, "x", None)},
            "tensor": paddle.to_tensor([1.5, 2.25]).astype("bfloat16"), "list": [np.int64(4), 0.5],
            "random": random.getstate()}
    save_state(str(tmp_path), "s", tree)
    back = load_state(str(tmp_path), "s")
    assert back["step"] == 3 and back["nested"]["t"] == (1, "x", None) and back["list"] == [4, 0.5]
    np.testing.assert_array_equal(back["nested"]["a"], tree["nested"]["a"])
    assert to_paddle(back)["tensor"].dtype == paddle.bfloat16
    np.testing.assert_array_equal(to_paddle(back)["tensor"].astype("float32").numpy(), [1.5, 2.25])
    with pytest.raises(TypeError, match="without pickling"):
        save_state(str(tmp_path), "bad", {"object": object()})


def files_of(folder) -> dict:
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("content", [b"not a pickle at all", pickle.dumps(["a", "list"])])
def test_an_upgrade_that_fails_leaves_the_checkpoint_as_it_found_it(tmp_path, capsys, content):
    from ldm.checkpoint.format import main

    checkpoint = tmp_path / "checkpoint-4"
    (checkpoint / "unet").mkdir(parents=True)
    (checkpoint / "unet" / "config.json").write_text("{}")
    (checkpoint / LEGACY_STATE_FILE).write_bytes(content)
    paddle.save({"w": paddle.ones([2])}, str(checkpoint / "optimizer.pdopt"))
    write_manifest(str(checkpoint))
    before = files_of(checkpoint)

    assert main(["upgrade", str(checkpoint)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and "left as it was" in error, error
    assert files_of(checkpoint) == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]  # nothing of the attempt left beside it
    (tmp_path / "checkpoint-4.pre-upgrade").mkdir()  # what a kill between the swap's two renames leaves
    assert main(["upgrade", str(checkpoint)]) == 2
    assert "an earlier upgrade was interrupted" in capsys.readouterr().err
    assert files_of(checkpoint) == before


def test_upgrade_of_a_current_but_damaged_checkpoint_says_it_cannot_repair_it(tmp_path, capsys):
    from ldm.checkpoint.format import main

    checkpoint = tmp_path / "checkpoint-3"
    (checkpoint / "unet").mkdir(parents=True)
    (checkpoint / "unet" / "weights.safetensors").write_bytes(b"w" * 64)
    (checkpoint / "ldm_model.json").write_text("{}")
    write_manifest(str(checkpoint))
    with open(checkpoint / "unet" / "weights.safetensors", "ab") as f:
        f.write(b"x")
    assert main(["upgrade", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not complete" in err and err.count("\n") == 1


def test_a_damaged_run_autoencoder_is_called_damaged_not_another_one(trained, tmp_path):
    args, out = trained
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    weights_file = next(p for p in (copy / "vqvae").iterdir() if p.suffix == ".safetensors")
    data = bytearray(weights_file.read_bytes())
    data[-3] ^= 0x01  # one weight's bytes, the size unchanged
    weights_file.write_bytes(bytes(data))
    result = run_entry(SCRIPT, args + ["--max_train_steps", "3", "--output_dir", str(copy), "--resume_from_checkpoint",
                                       "latest"])
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "damaged or modified after it was written" in error, error
    assert f"{weights_file.name} does not match its checksum" in error and "--vae_name_or_path" not in error
