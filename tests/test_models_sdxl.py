"""Stable Diffusion XL by composition (`ldm.models.families.sdxl`): ppdiffusers' UNet with its added text and time
embedding, CLIP-L and OpenCLIP-bigG frozen and read as one (`ldm.models.text_set.SDXLTextEncoders`), conditioned on
each image's geometry (`ldm.models.conditioning.GEOMETRY`). Against diffusers' own `StableDiffusionXLPipeline`
(tests/reference/make_sdxl_fixtures.py, tests/fixtures/sdxl): its folders read as saved (float32, the fp16 variant
alone, sharded), and the export it loads back.

diffusers' outputs are compared to 1e-4 of their largest value: both libraries compute the same float32 products in
other orders, each sum of K terms within K·u of its terms (u = 2^-24, tests/tolerance.py); the widest here is the
UNet's (K ≤ 16 x 9 for its 3x3 convolutions), a few dozen such reductions deep, so 2^14·u ≈ 6e-5 bounds them all. The
image: two guided Euler steps from diffusers' own noise, within one grey level of its rounding.
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from corpus import write_corpus
from entry import run_entry, run_python
from scored import fid_and_clip_score
from transformer_fixtures import relative

from ldm.models.build import PRESETS_DIR

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sdxl"
PROMPTS = ["a red circle on a blue background", ""]
LENGTH = 16
BOUND = 1e-4


def test_the_sdxl_preset_is_sdxl_bases_architecture():
    """stabilityai/stable-diffusion-xl-base-1.0: the two CLIPs' widths side by side are the cross-attention's, bigG's
    projection and six time ids of 256 the added embedding's input."""
    configs = {part: json.loads((PRESETS_DIR / "sdxl-base" / part / "config.json").read_text())
               for part in ("unet", "text_encoder", "text_encoder_2", "vae")}
    unet, clip_l, clip_g, vae = configs.values()
    assert unet["block_out_channels"] == [320, 640, 1280] and unet["transformer_layers_per_block"] == [1, 2, 10]
    assert unet["cross_attention_dim"] == clip_l["hidden_size"] + clip_g["hidden_size"] == 2048
    assert unet["projection_class_embeddings_input_dim"] == clip_g["projection_dim"] + 6 * 256 == 2816
    assert (clip_g["num_hidden_layers"], clip_l["num_hidden_layers"]) == (32, 12)
    assert unet["sample_size"] * 8 == 1024 and vae["scaling_factor"] == 0.13025


def outputs_of(folder: str) -> dict[str, np.ndarray]:
    """What this framework computes on a folder, as the fixtures hold diffusers' (`make_sdxl_fixtures.outputs`)."""
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.inference.sampling import generate, sampling_scheduler
    from ldm.models.conditioning import GEOMETRY, Conditioning
    from ldm.models.families import predict
    from ldm.models.text import encode_prompt

    expected = dict(np.load(FIXTURES / "diffusers.npz"))
    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(folder)
    tokenize = CaptionTokenizer(tokenizer, LENGTH)
    found = {}
    with paddle.no_grad():
        text = encode_prompt(text_encoder, paddle.to_tensor(np.stack([tokenize(p) for p in PROMPTS])))
        found.update(states=text.states.numpy(), pooled=text.pooled.numpy())
        for name in ("square", "non_square"):
            conditioning = Conditioning(paddle.to_tensor(expected["states"]), pooled=paddle.to_tensor(
                expected["pooled"]), added={GEOMETRY: paddle.to_tensor(expected[f"{name}_time_ids"])})
            found[f"{name}_prediction"] = predict(unet, paddle.to_tensor(expected[f"{name}_latents"]),
                                                  paddle.to_tensor(expected[f"{name}_timesteps"]), conditioning).numpy()
    found["generated"] = generate(unet, text_encoder, vae, sampling_scheduler(scheduler_config), tokenize,
                                  PROMPTS[:1], guidance_scale=3.0, num_inference_steps=2, seed=7, height=48, width=24)
    return found


def check(found: dict, outputs: str) -> None:
    expected = dict(np.load(FIXTURES / outputs))
    differences = {name: relative(found[name], expected[name]) for name in found if name != "generated"}
    assert max(differences.values()) < BOUND, differences
    np.testing.assert_allclose(found["generated"][0], np.round(expected["generated"][0] * 255), atol=1)


def test_a_diffusers_sdxl_folder_computes_what_diffusers_computes_with_its_time_ids():
    """The states and pooled vectors of a prompt and the empty one, the UNet's prediction for a square and a
    non-square batch (each row its own original size and crop), and two guided steps at 48x24 px (original = target =
    the requested size, crop (0, 0); the negative zeros, `force_zeros_for_empty_prompt`)."""
    check(outputs_of(str(FIXTURES / "float32")), "diffusers.npz")


def test_the_fp16_variant_and_the_sharded_save_read_as_the_float32_folder(tmp_path):
    """The fp16 variant alone is read without being asked (its weights rounded to float16), and a UNet in shards with
    its index reads the very weights of the single file."""
    from ldm.inference.load import load_for_inference

    sharded = shutil.copytree(FIXTURES / "float32", tmp_path / "sharded")
    shutil.rmtree(sharded / "unet")
    shutil.copytree(FIXTURES / "sharded" / "unet", sharded / "unet")
    float32 = load_for_inference(str(FIXTURES / "float32"))
    for folder, exact in ((sharded, True), (FIXTURES / "fp16", False)):
        loaded = load_for_inference(str(folder))
        for ours, theirs in zip(loaded[:3], float32[:3], strict=True):
            state = theirs.state_dict()
            for name, tensor in ours.state_dict().items():
                want = state[name].numpy()
                want = want if exact or want.dtype != np.float32 else want.astype(np.float16).astype(np.float32)
                np.testing.assert_array_equal(tensor.numpy().astype(want.dtype), want, err_msg=f"{folder}: {name}")


def test_the_export_for_diffusers_is_what_diffusers_loads_and_computes_as_here(tmp_path):
    """`python -m ldm.export --format diffusers` of the float32 folder: the weight files diffusers read back when the
    fixtures were made (their sha256), its model index with the negative's setting, and its outputs there (with
    the time ids) what this framework computes on it."""
    from ldm.export import main as export

    exported = tmp_path / "exported"
    assert export(["--checkpoint", str(FIXTURES / "float32"), "--output", str(exported), "--format", "diffusers"]) \
        in (0, None)
    reference = json.loads((FIXTURES / "reference.json").read_text())
    for name, digest in reference["exported_weights_sha256"].items():
        assert hashlib.sha256((exported / name).read_bytes()).hexdigest() == digest, name
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is True
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    check(outputs_of(str(exported)), "exported.npz")


def test_a_dropped_caption_is_zeros_where_the_pipeline_says_so_and_keeps_its_geometry(tmp_path):
    """`force_zeros_for_empty_prompt` (the model index's, True unless it says otherwise): a dropped caption trains on
    zeros, states and pooled vector, as the negative samples (Stability's base model learned its unconditional so);
    its size and crop stay, they describe the image. A pipeline that says False trains on the empty caption's
    encoding."""
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components
    from ldm.models.conditioning import GEOMETRY
    from ldm.models.diffusion import LatentDiffusion

    plain = shutil.copytree(FIXTURES / "float32", tmp_path / "plain")
    index = json.loads((plain / "model_index.json").read_text())
    (plain / "model_index.json").write_text(json.dumps({**index, "force_zeros_for_empty_prompt": False}))
    geometry = np.array([[64, 48, 8, 0, 32, 32], [40, 30, 2, 3, 32, 32]], "float32")
    for folder, zeros in ((FIXTURES / "float32", True), (plain, False)):
        c = build_components(str(folder))
        assert c.text_encoder.config.force_zeros_for_empty_prompt is zeros
        model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, freeze_text_encoder=True)
        tokenize = CaptionTokenizer(load_tokenizer_of(c.family, str(folder / "tokenizer")), LENGTH)
        model.keep_empty_caption(tokenize(""))
        ids = paddle.to_tensor(np.stack([tokenize(PROMPTS[0]), tokenize("")]))
        found = model.context(ids, {"added": {GEOMETRY: geometry}})
        assert np.abs(found.states[0].numpy()).max() > 0 and np.abs(found.pooled[0].numpy()).max() > 0
        assert bool(np.abs(found.states[1].numpy()).max() == 0) is zeros
        assert bool(np.abs(found.pooled[1].numpy()).max() == 0) is zeros
        np.testing.assert_array_equal(found.added[GEOMETRY].numpy(), geometry)


# The tests below train: each batch needs its images' geometry from the data path (`conditioning["added"]`).
def test_an_sdxl_folder_trains_in_buckets_with_ema_resumes_and_exports_what_ppdiffusers_samples(tmp_path):
    """The fp16 variant folder as diffusers saved it, trained on the loop entry point in two aspect-ratio buckets with
    EMA and --phase_timing, resumed, exported for diffusers (the frozen encoders as they came) and sampled by
    ppdiffusers' `StableDiffusionXLPipeline` as by `ldm.generate`; `ldm.generate --negative_prompt` runs, and
    `ldm.evaluate run` scores it."""
    from ppdiffusers import StableDiffusionXLPipeline
    from transformer_fixtures import sampled_as_by_the_pipeline

    from ldm.generate import main as generate

    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    run = tmp_path / "run"
    args = ["--pretrained_model_name_or_path", str(FIXTURES / "fp16"), "--file_list", listing, "--resolution", "32",
            "--aspect_buckets", "48x24,32x32", "--train_batch_size", "2", "--save_steps", "2", "--num_workers", "0",
            "--report_to", "none", "--learning_rate", "1e-3", "--use_ema", "--phase_timing", "--output_dir", str(run)]
    for more in (["--max_train_steps", "2"], ["--max_train_steps", "3", "--resume_from_checkpoint", "latest"]):
        result = run_entry("train_txt2img_laion400m_no_trainer.py", [*args, *more])
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resum" in result.stderr
    record = json.loads((run / "run.json").read_text())["model"]
    assert record["text_encoder_identity"]["family"] == "sdxl"
    exported = tmp_path / "hf"
    result = run_python(["-m", "ldm.export", "--checkpoint", str(run / "checkpoint-3"), "--output", str(exported),
                         "--format", "diffusers"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((exported / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLPipeline"
    sampled_as_by_the_pipeline(exported, StableDiffusionXLPipeline)
    assert generate(["--model", str(run / "checkpoint-3"), "--prompt", "a red circle", "--negative_prompt", "blue",
                     "--height", "48", "--width", "24", "--num_inference_steps", "2", "--output_dir",
                     str(tmp_path / "samples")]) in (0, None)
    fid_and_clip_score(run / "checkpoint-3", listing, tmp_path / "evaluate")


def test_sdxl_trains_from_its_preset_on_the_trainer_path(tmp_path):
    listing = write_corpus(str(tmp_path / "corpus"), num_records=4, records_per_shard=4)
    result = run_entry("train_txt2img_laion400m_trainer.py", [
        "--do_train", "--model_name_or_path", "sdxl-tiny", "--allow_untrained_vae", "--allow_untrained_text_encoder",
        "--file_list", listing, "--resolution", "32", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_steps", "2", "--dataloader_num_workers", "0",
        "--report_to", "none", "--model_max_length", "16", "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    own = json.loads((tmp_path / "run" / "text_encoder" / "config.json").read_text())
    assert own["model_type"] == "sdxl_text_encoders" and own["force_zeros_for_empty_prompt"] is True
    assert (own["hidden_size"], own["projection_dim"]) == (40, 16)


def test_cached_sdxl_states_and_pooled_vectors_train_to_the_losses_of_encoding_on_the_fly(tmp_path):
    """`encode --text_embeddings` stores each caption's states and pooled vector (and the geometry, with the
    latents); a run on them, captions dropped for zeros, has the losses of one that runs both encoders."""
    from conftest import metrics_lines

    folder = str(FIXTURES / "float32")
    corpus = write_corpus(str(tmp_path / "corpus"), num_records=12, records_per_shard=6)
    losses = {}
    for name, extra in (("cached", ["--text_embeddings", "--text_dtype", "float32"]), ("plain", [])):
        result = run_python(["-m", "ldm.prepare", "encode", "--file_list", corpus, "--vae_name_or_path", folder,
                             "--model_name_or_path", folder, "--output_dir", str(tmp_path / name), "--resolution",
                             "32", "--dtype", "float32", "--num_workers", "0", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        result = run_entry("train_txt2img_laion400m_no_trainer.py", [
            "--model_name_or_path", folder, "--file_list", str(tmp_path / name / "latents.filelist.list"),
            "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "6", "--save_steps", "6",
            "--num_workers", "0", "--report_to", "none", "--logging_steps", "1", "--learning_rate", "1e-3",
            "--model_max_length", str(LENGTH), "--caption_dropout_prob", "0.3", "--output_dir",
            str(tmp_path / f"run-{name}")])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = [line["train/loss"] for line in metrics_lines(tmp_path / f"run-{name}") if "train/loss" in line]
    assert len(losses["cached"]) == 6 and len(set(losses["cached"])) == 6
    np.testing.assert_allclose(losses["cached"], losses["plain"], rtol=1e-5)


def test_a_batch_without_the_images_geometry_is_refused_in_one_line():
    from ldm.models.build import build_components
    from ldm.models.conditioning import Conditioning
    from ldm.models.families import SDXL

    c = build_components("sdxl-tiny")
    assert SDXL is c.model_family
    try:
        SDXL.check_conditioning(Conditioning(paddle.zeros([1, 4, 40]), pooled=paddle.zeros([1, 16])))
    except ValueError as e:
        assert "reads the added conditions geometry, which the batch does not carry" in str(e)
    else:
        raise AssertionError("a batch without geometry was taken")


@pytest.mark.distributed
@pytest.mark.slow
def test_sdxl_shards_resumes_on_one_rank_after_a_kill_under_ldm_launch_reading_each_record_once(tmp_path,
                                                                                               monkeypatch):
    """sdxl-tiny on the loop: 2 ranks with --sharding stage1, EMA and --phase_timing; then under `python -m
    ldm.launch` on 1 rank, resumed from the sharded checkpoint (the global batch halved: max_steps 6 -> 10), its rank
    killed after update 4 and restarted from the newest complete checkpoint. Every record of the first pass reaches a
    trainer once over the three tries; `ldm.evaluate loss` reads the sharded checkpoint with its images' geometry."""
    import os
    import signal
    import time
    from collections import Counter

    from conftest import ROOT, metrics_lines
    from entry import launch_report, rank_pid, start_python

    from ldm.data.dataset import CONSUMED_LOG
    from ldm.runtime.heartbeat import read_try

    listing = write_corpus(str(tmp_path / "corpus"), num_records=16, records_per_shard=4)
    run, logs = tmp_path / "run", tmp_path / "logs"
    common = ["--pretrained_model_name_or_path", "sdxl-tiny", "--allow_untrained_vae", "--allow_untrained_text_encoder",
              "--file_list", listing, "--resolution", "32", "--model_max_length", str(LENGTH), "--train_batch_size",
              "2", "--num_workers", "0", "--use_ema", "--report_to", "none", "--logging_steps", "1", "--output_dir",
              str(run)]
    monkeypatch.setenv(CONSUMED_LOG, str(tmp_path / "sharded.log"))
    first = run_entry("train_txt2img_laion400m_no_trainer.py", [
        *common, "--sharding", "stage1", "--phase_timing", "--max_train_steps", "2", "--save_steps", "2"],
        launch=True, cwd=tmp_path)
    assert first.returncode == 0, launch_report(first, tmp_path)
    sharded = run / "checkpoint-2"
    for part in ("optimizer", "ema"):  # each rank's share, with an index
        files = set(json.loads((sharded / f"{part}.index.json").read_text())["weight_map"].values())
        assert files == {f"{part}-00001-of-00002.safetensors", f"{part}-00002-of-00002.safetensors"}
    timed = [line for line in metrics_lines(run) if "train/loss" in line]
    assert len(timed) == 2 and all(abs(sum(v for k, v in line.items() if k.startswith("train/phase_")) - 1) < 1e-6
                                   for line in timed)  # the phases of each window: all of its time

    evaluated = run_python(["-m", "ldm.evaluate", "loss", "--model", str(sharded), "--file_list", listing,
                            "--validation_samples", "4", "--json"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert np.isfinite(json.loads(evaluated.stdout.strip().splitlines()[-1])["loss"])

    monkeypatch.setenv(CONSUMED_LOG, str(tmp_path / "try-{restarts}.log"))
    out = str(tmp_path / "launch.out")
    job = start_python(["-m", "ldm.launch", "--max_restarts", "1", "--restart_pause", "0", "--nproc_per_node", "1",
                        "--log_dir", logs, ROOT / "train_txt2img_laion400m_no_trainer.py", *common,
                        "--max_train_steps", "6", "--save_steps", "2", "--resume_from_checkpoint", "latest"],
                       tmp_path, out, out, new_session=True)
    killed = None
    try:
        status, deadline = str(logs / "ldm-launch" / "try-0"), time.monotonic() + 300
        while killed is None and job.exitcode is None and time.monotonic() < deadline:
            step = read_try(status).get(0, {}).get("step")
            pid = rank_pid(status, 0) if step is not None and step >= 4 else None
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)  # no further update: the one it fails in is known
                killed = read_try(status)[0]["step"]
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        job.join(300)
    finally:
        if job.exitcode is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.join()
    said = (tmp_path / "launch.out").read_text()
    assert job.exitcode == 0 and killed is not None, said[-4000:]
    assert "global batch 4 -> 2" in said and "max_steps 6 -> 10" in said
    restarts = json.loads((run / "run.json").read_text())["restarts"]
    assert [(r["rank"], r["cause"], r["update"]) for r in restarts] == [(0, "killed by SIGKILL", killed + 1)]
    assert (run / "checkpoint-10").is_dir()

    # the updates each record was trained in: the first try's past where the restart resumed were done again
    taken = [(2 + int(batch) + 1, pass_index, shard, line) for pass_index, _, shard, line, _, _, batch in
             (row.split() for row in (tmp_path / "try-0.log").read_text().splitlines())]
    taken = [entry for entry in taken if entry[0] <= restarts[0]["resumed_from"]]
    taken += [(0, pass_index, shard, line) for pass_index, _, shard, line, *_ in
              (row.split() for row in (tmp_path / "try-1.log").read_text().splitlines())]
    taken += [(0, pass_index, shard, line) for pass_index, _, shard, line, *_ in
              (row.split() for row in (tmp_path / "sharded.log").read_text().splitlines())]
    assert len(taken) == 2 * 2 * 2 + 8 * 2  # 2 updates of 2 x 2 ranks, 8 of 2 on one
    first_pass = Counter((shard, line) for _, pass_index, shard, line in taken if pass_index == "0")
    assert len(first_pass) == 16 and set(first_pass.values()) == {1}
