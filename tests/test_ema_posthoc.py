"""Post-hoc EMA (`ldm.models.posthoc_ema`, `ldm.inference.posthoc`, `python -m ldm.ema`): the method against an
independent implementation (tests/reference/make_posthoc_ema_fixtures.py), the tracked profiles against the
recurrence computed update by update in numpy in every form of the update, and the real entry points on ldm-tiny:
snapshots sealed beside the checkpoints, reconstruction, refusals, a sweep, a resume after a crash, the Trainer path."""

import json
import os
import shutil

import numpy as np
import paddle
import pytest
from conftest import ROOT
from corpus import write_corpus
from entry import launch_report, part_weights, run_entry, run_python
from tolerance import UNIT_ROUNDOFF

from ldm.checkpoint.run_folder import checkpoint_problem
from ldm.checkpoint.serialization import load_state
from ldm.models.posthoc_ema import (
    MAX_SIGMA_REL,
    EMAProfiles,
    PosthocEMAError,
    coefficients,
    exponent,
    relative_width,
)
from ldm.train.flat import FlatAdamW, FlatEMA
from ldm.train.native import load as load_kernel

FIXTURE = ROOT / "tests" / "fixtures" / "posthoc_ema" / "coefficients.json"
LOOP = "train_txt2img_laion400m_no_trainer.py"
WIDTHS = (0.05, 0.10)


# -- the method -----------------------------------------------------------------------------------------
def reference_cases() -> list[dict]:
    return json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: f"{len(c['snapshots'])}-{c['sigma_rel']}@{c['step']}")
def test_the_coefficients_are_the_least_squares_solution_of_an_independent_implementation(case):
    """50-digit inner products by quadrature, the normal equations by LU (tests/reference): the coefficients agree to
    1e-6 (float64's solve loses about log10 of the condition number, at most 7 of its 16 digits here)."""
    got = coefficients([s["step"] for s in case["snapshots"]], [s["sigma_rel"] for s in case["snapshots"]],
                       case["step"], case["sigma_rel"])
    np.testing.assert_allclose(got, case["coefficients"], rtol=0, atol=1e-6)


def test_a_width_is_a_power_functions_only_below_the_plain_average():
    for sigma_rel in (0.01, 0.05, 0.1, 0.2, 0.28):
        assert exponent(sigma_rel) > 0
        assert relative_width(exponent(sigma_rel)) == pytest.approx(sigma_rel, rel=1e-12)
    assert relative_width(0.0) == pytest.approx(MAX_SIGMA_REL)
    for sigma_rel in (0.0, -0.1, 0.2887, 0.3):
        with pytest.raises(PosthocEMAError, match="outside what a power-function EMA can have"):
            exponent(sigma_rel)


@pytest.mark.parametrize("form", ["off", "on", "fused"])
def test_a_tracked_profile_is_the_power_function_ema_of_the_weights_update_by_update(form):
    """Each form of the update (per tensor, flat with Paddle's lerp_, one fused pass with the EMA) tracks
    θ̂_t = β_t θ̂_{t-1} + (1 - β_t) θ_t, β_t = (1 - 1/t)^(γ+1), t the update (a skipped one counts, its weights are
    not averaged in), as numpy computes it in float64 from the weights each update left. Each float32 update of an
    average rounds its decay or weight, a product, a difference or a sum: at most 8 roundings of the largest value
    involved, added over the updates (the recurrence only shrinks earlier errors)."""
    paddle.seed(0)
    model = paddle.nn.Linear(16, 8)
    trained = list(model.parameters())
    optimizer = (paddle.optimizer.AdamW if form == "off" else FlatAdamW)(1e-2, parameters=trained)
    profiles = EMAProfiles(model, WIDTHS)
    if form != "off":
        flat = optimizer.flatten()
        for profile in profiles.profiles:
            FlatEMA.adopt(profile, flat)
        if form == "fused":
            assert optimizer.fuse(load_kernel()[0], [profile.flat for profile in profiles.profiles])
    updates, skipped = 12, {5}
    history = []
    rng = np.random.default_rng(0)
    for t in range(1, updates + 1):
        (model(paddle.to_tensor(rng.normal(size=(4, 16)).astype("float32"))) ** 2).mean().backward()
        optimizer._set_auxiliary_var("found_inf", t in skipped)
        optimizer.step()
        optimizer.clear_grad()
        history.append({n: p.numpy().astype(np.float64) for n, p in model.named_parameters()})
        profiles.updated(t in skipped)
    largest = max(np.abs(w).max() for weights in history for w in weights.values())
    for sigma_rel, profile in zip(WIDTHS, profiles.profiles, strict=True):
        gamma = exponent(sigma_rel)
        expected = {n: np.zeros_like(w) for n, w in history[0].items()}  # β_1 = 0: the start never counts
        for t, weights in enumerate(history, start=1):
            if t in skipped:
                continue
            beta = (1 - 1 / t) ** (gamma + 1)
            expected = {n: beta * expected[n] + (1 - beta) * weights[n] for n in expected}
        assert profile.num_updates == updates
        for name, value in expected.items():
            got = profile.shadow[name].numpy().astype(np.float64)
            assert np.abs(got - value).max() <= updates * 8 * UNIT_ROUNDOFF * largest, (sigma_rel, name)
        assert any(not np.allclose(expected[n], history[-1][n]) for n in expected)  # an average, not the weights


# -- the entry points -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("posthoc_corpus")
    listing = write_corpus(str(folder), num_records=24, records_per_shard=8)
    return ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32", "--train_batch_size", "4",
            "--learning_rate", "1e-3", "--seed", "5", "--use_ema", "--ema_sigma_rels", "0.05,0.10",
            "--ema_snapshot_steps", "2", "--save_steps", "3", "--max_train_steps", "6", "--report_to", "none"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """One loop run of 6 updates: snapshots at 2, 4, 6, checkpoints at 3 and 6 (shared by the tests below)."""
    out = tmp_path_factory.mktemp("posthoc") / "run"
    result = run_entry(LOOP, corpus + ["--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stderr


def profile_arrays(folder, sigma_rel) -> dict[str, np.ndarray]:
    state = load_state(str(folder), f"ema_sigma_rel-{sigma_rel:g}")
    return {k: np.asarray(v) for k, v in state.items() if k.startswith("shadow.")}


def test_snapshots_are_sealed_beside_the_checkpoints_with_their_cost_recorded(trained):
    out, log = trained
    snapshots = out / "ema_snapshots"
    assert sorted(os.listdir(snapshots)) == ["step-000002", "step-000004", "step-000006"]
    for name in os.listdir(snapshots):
        assert checkpoint_problem(str(snapshots / name)) is None
    record = json.loads((snapshots / "step-000004" / "snapshot.json").read_text())
    assert record["step"] == 4 and record["dtype"] == "float32"
    assert [(p["sigma_rel"], p["num_updates"]) for p in record["profiles"]] == [(0.05, 4), (0.1, 4)]
    # a snapshot is the checkpoint's profile parts at that update
    for sigma_rel in WIDTHS:
        in_checkpoint, in_snapshot = profile_arrays(out / "checkpoint-6", sigma_rel), profile_arrays(
            snapshots / "step-000006", sigma_rel)
        assert in_checkpoint.keys() == in_snapshot.keys() and in_checkpoint
        assert all(np.array_equal(in_checkpoint[k], in_snapshot[k]) for k in in_checkpoint)
    run = json.loads((out / "run.json").read_text())
    trained_elements = sum(v.size for v in profile_arrays(out / "checkpoint-6", 0.05).values())
    assert run["ema_profiles"]["snapshot_bytes"] == 2 * 4 * trained_elements
    assert run["ema_profiles"]["bytes_per_1000_updates"] == 500 * 2 * 4 * trained_elements
    assert run["memory"]["ranks"][0]["ema_profiles"] == 2 * run["memory"]["ranks"][0]["ema"]
    assert "post-hoc EMA: profiles of sigma_rel 0.05 (gamma 16.97), 0.1 (gamma 6.94); a snapshot every 2 updates" in log


def test_reconstruction_at_a_tracked_width_and_step_is_that_snapshot(trained, tmp_path):
    """The profile of width 0.10 at update 4 is the snapshot of that profile at 4: coefficients as the independent
    implementation's (1e-6), and weights within the roundings of their sum: each other snapshot's weight times its
    coefficient, the coefficient's own distance from 1, float64's roundings of the sum and the final float32 one."""
    out, _ = trained
    result = run_python(["-m", "ldm.ema", "reconstruct", out, "--sigma_rel", "0.1", "--step", "4", "--output",
                         tmp_path / "rebuilt", "--json"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = next(c for c in reference_cases() if c["step"] == 4 and c["sigma_rel"] == 0.1)
    assert report["snapshots"] == expected["snapshots"] and report["step"] == 4 and report["sigma_rel"] == 0.1
    np.testing.assert_allclose(report["coefficients"], expected["coefficients"], rtol=0, atol=1e-6)
    used = [profile_arrays(out / "ema_snapshots" / f"step-{s['step']:06d}", s["sigma_rel"])
            for s in report["snapshots"]]
    target = report["snapshots"].index({"step": 4, "sigma_rel": 0.1})
    got = {f"shadow.unet.{k}": v for k, v in part_weights(tmp_path / "rebuilt" / "unet",
                                                          "diffusion_paddle_model").items()}
    got.update({f"shadow.text_encoder.{k}": v for k, v in part_weights(tmp_path / "rebuilt" / "bert",
                                                                       "model").items()})
    c = np.array(report["coefficients"])
    for key, value in used[target].items():
        terms = [abs(ci - (i == target)) * np.abs(u[key].astype(np.float64)) for i, (ci, u) in enumerate(zip(
            c, used, strict=True))]
        magnitude = sum(abs(ci) * np.abs(u[key].astype(np.float64)) for ci, u in zip(c, used, strict=True))
        bound = sum(terms) + len(c) * 2.0 ** -53 * magnitude + UNIT_ROUNDOFF * np.abs(value)
        assert (np.abs(got[key].astype(np.float64) - value) <= bound).all(), key
    # and the folder is a pipeline like the run's own
    assert sorted(os.listdir(tmp_path / "rebuilt")) == sorted(os.listdir(out / "pipeline"))


@pytest.mark.parametrize("args, message", [
    (["--sigma_rel", "0.3"], "sigma_rel 0.3 is outside what a power-function EMA can have"),
    (["--sigma_rel", "0.1", "--step", "1"], "no EMA snapshot at or before update 1 (the first is at update 2)"),
    (["--sigma_rel", "0.1", "--step", "7"], "update 7 is past"),
])
def test_a_width_or_step_the_snapshots_cannot_give_is_refused_in_one_line(trained, tmp_path, args, message):
    out, _ = trained
    result = run_python(["-m", "ldm.ema", "reconstruct", out, *args, "--output", tmp_path / "rebuilt"])
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") <= 1 and "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "rebuilt")


def test_a_sweep_scores_each_width_beside_the_standard_ema_and_names_the_best(trained, corpus, tmp_path):
    out, _ = trained
    listing = corpus[corpus.index("--file_list") + 1]
    result = run_python(["-m", "ldm.ema", "sweep", out, "--sigma_rel", "0.05,0.15", "--metric", "heldout_loss",
                         "--output", tmp_path / "sweep", "--", "--file_list", listing, "--validation_samples", "4",
                         "--validation_timesteps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [row["sigma_rel"] for row in report["results"]] == [0.05, 0.15] and report["step"] == 6
    losses = [row["heldout_loss"] for row in report["results"]]
    assert all(np.isfinite(losses)) and losses[0] != losses[1]
    assert report["best"]["heldout_loss"] == min(losses)
    assert report["standard_ema"]["checkpoint"] == str(out / "checkpoint-6")
    assert f"best: sigma_rel {report['best']['sigma_rel']:g}" in result.stdout
    assert {"sweep.md", "sweep.png"} <= set(os.listdir(tmp_path / "sweep"))
    assert "standard EMA" in (tmp_path / "sweep" / "sweep.md").read_text()


def test_a_crash_between_snapshots_loses_nothing_the_resume_does_not_rebuild(trained, corpus, tmp_path):
    """The run killed after update 5 (its snapshot of 4 written, checkpoint-6 not): resumed from checkpoint-3, it
    removes the snapshot newer than that, restores the profiles and writes snapshots 4 and 6 again as the
    uninterrupted run did, to the bit."""
    out, _ = trained
    crashed = tmp_path / "run"
    shutil.copytree(out, crashed, ignore=shutil.ignore_patterns("checkpoint-6", "pipeline", "step-000006"))
    result = run_entry(LOOP, corpus + ["--output_dir", str(crashed), "--resume_from_checkpoint", "latest"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removed the newer EMA snapshot" in result.stderr and "step-000004" in result.stderr
    for step in (4, 6):
        for sigma_rel in WIDTHS:
            name = f"step-{step:06d}"
            a = profile_arrays(out / "ema_snapshots" / name, sigma_rel)
            b = profile_arrays(crashed / "ema_snapshots" / name, sigma_rel)
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (step, sigma_rel)


def test_the_trainer_path_tracks_and_snapshots_the_profiles_in_half_precision_if_asked(corpus, tmp_path):
    common = corpus[corpus.index("--file_list"):corpus.index("--train_batch_size")] + [
        "--do_train", "--model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--per_device_train_batch_size",
        "2", "--max_steps", "2", "--save_steps", "2", "--ema_sigma_rels", "0.1", "--ema_snapshot_steps", "1",
        "--ema_snapshot_dtype", "float16", "--seed", "3", "--report_to", "none", "--output_dir", str(tmp_path)]
    result = run_entry("train_txt2img_laion400m_trainer.py", common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "ema_snapshots")) == ["step-000001", "step-000002"]
    snapshot, checkpoint = profile_arrays(tmp_path / "ema_snapshots" / "step-000002", 0.1), profile_arrays(
        tmp_path / "checkpoint-2", 0.1)
    assert all(snapshot[k].dtype == np.float16 and checkpoint[k].dtype == np.float32 for k in snapshot)
    assert all(np.array_equal(snapshot[k], checkpoint[k].astype(np.float16)) for k in snapshot)
    rebuilt = run_python(["-m", "ldm.ema", "reconstruct", tmp_path, "--sigma_rel", "0.1", "--output",
                          tmp_path / "rebuilt", "--json"])
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert json.loads(rebuilt.stdout.strip().splitlines()[-1])["step"] == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_profiles_are_snapshotted_in_each_ranks_shard_and_reconstructed_whole(corpus, tmp_path):
    """Under --sharding stage1 each rank keeps and writes its share of every profile (an index names the shard of
    every average, as for the EMA); a snapshot is still the checkpoint's profiles, and a reconstruction reads it
    whole."""
    out = tmp_path / "run"
    args = corpus[:corpus.index("--max_train_steps")] + ["--max_train_steps", "4", "--num_workers", "0",
                                                         "--sharding", "stage1", "--output_dir", str(out)]
    result = run_entry(LOOP, args, launch=True, cwd=tmp_path)
    assert result.returncode == 0, launch_report(result, tmp_path)
    snapshot = out / "ema_snapshots" / "step-000004"
    index = json.loads((snapshot / "ema_sigma_rel-0.05.index.json").read_text())
    assert index["world_size"] == 2 and len(set(index["weight_map"].values())) == 2
    for sigma_rel in WIDTHS:
        in_snapshot, in_checkpoint = profile_arrays(snapshot, sigma_rel), profile_arrays(out / "checkpoint-3",
                                                                                          sigma_rel)
        assert in_snapshot.keys() == in_checkpoint.keys()
    rebuilt = run_python(["-m", "ldm.ema", "reconstruct", out, "--sigma_rel", "0.05", "--output",
                          tmp_path / "rebuilt", "--json"])
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert json.loads(rebuilt.stdout.strip().splitlines()[-1])["coefficients"][-2] == pytest.approx(1, abs=1e-6)
