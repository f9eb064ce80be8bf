"""PixArt-α by composition (`ldm.models.families`): ppdiffusers' PixArt `Transformer2DModel` with a frozen T5, trained
from a diffusers `PixArtAlphaPipeline` folder in an aspect-ratio bucket, exported in diffusers' layout and sampled by
ppdiffusers' `PixArtAlphaPipeline` with its own sampler as by `ldm.generate`; its position embedding on a non-square
patch grid; the 0.6 B preset's architecture."""

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from corpus import write_corpus
from entry import refused_at_start, run_entry
from safetensors.numpy import load_file

from ldm.models.build import PRESETS_DIR

RESOLUTION = 32


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from interop_models import tiny_pixart_pipeline

    return tiny_pixart_pipeline(str(tmp_path_factory.mktemp("pixart")))


def test_the_pixart_preset_is_pixart_alpha_512s_architecture():
    transformer = json.loads((PRESETS_DIR / "pixart-alpha-512" / "transformer" / "config.json").read_text())
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["attention_head_dim"]) == (
        28, 16, 72)
    assert (transformer["patch_size"], transformer["sample_size"], transformer["caption_channels"]) == (2, 64, 4096)
    assert transformer["norm_type"] == "ada_norm_single" and transformer["out_channels"] == 8
    t5 = json.loads((PRESETS_DIR / "pixart-alpha-512" / "text_encoder" / "config.json").read_text())
    assert (t5["d_model"], t5["num_layers"], t5["model_type"]) == (4096, 24, "t5")


def test_a_non_square_patch_grid_gets_the_position_embedding_stretched_over_the_trained_span():
    """A 12 x 6 latent (a 48x24 bucket of pixart-tiny: 6 x 3 patches of 2) on a transformer trained on 8 x 8 (4 x 4
    patches): the sin-cos embedding of token (i, j) is at (i 4/6, j 4/3), both axes spanning the 4 x 4 grid."""
    from ppdiffusers.models.embeddings import get_2d_sincos_pos_embed_from_grid

    from ldm.models.build import build_components
    from ldm.models.conditioning import Conditioning
    from ldm.models.families import predict

    c = build_components("pixart-tiny", seed=0)
    patches = c.unet.pos_embed
    latents = paddle.randn([2, 4, 12, 6])
    projected = patches.proj(latents).flatten(2).transpose([0, 2, 1])
    positions = (patches(latents) - projected)[0].numpy()
    rows, cols = np.meshgrid(np.arange(6) * 4 / 6, np.arange(3) * 4 / 3, indexing="ij")
    expected = get_2d_sincos_pos_embed_from_grid(positions.shape[-1], np.stack([cols, rows]).reshape(2, 1, 6, 3))
    np.testing.assert_allclose(positions, expected, atol=1e-5)
    prediction = predict(c.unet, latents, paddle.to_tensor([10, 900]), Conditioning(paddle.randn([2, 5, 32])))
    assert prediction.shape == [2, 4, 12, 6]  # the noise half of the 8 channels learned sigma makes


def test_a_pixart_pipeline_trains_in_a_bucket_and_exports_what_ppdiffusers_pipeline_samples(pipeline, tmp_path):
    from ppdiffusers import PixArtAlphaPipeline
    from transformer_fixtures import export_to_diffusers, sampled_as_by_the_pipeline

    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    run = tmp_path / "run"
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--pretrained_model_name_or_path", pipeline, "--file_list", listing, "--resolution", str(RESOLUTION),
        "--aspect_buckets", "48x24,32x32", "--train_batch_size", "2", "--max_train_steps", "2", "--save_steps", "2",
        "--num_workers", "0", "--report_to", "none", "--model_max_length", "16", "--learning_rate", "1e-3",
        "--output_dir", str(run)])
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())["model"]
    assert record["class"] == "Transformer2DModel" and record["text_encoder_identity"]["family"] == "t5"
    assert (run / "checkpoint-2" / "transformer").is_dir()
    exported = tmp_path / "hf"
    index = export_to_diffusers(run / "checkpoint-2", exported, pipeline, ("text_encoder",))  # the frozen T5 as it came
    assert index["_class_name"] == "PixArtAlphaPipeline"
    assert index["scheduler"] == ["diffusers", "DPMSolverMultistepScheduler"]  # the source's sampler, kept
    theirs = sampled_as_by_the_pipeline(exported, PixArtAlphaPipeline, use_resolution_binning=False,
                                        clean_caption=False)
    assert type(theirs.scheduler).__name__ == "DPMSolverMultistepScheduler"


def test_the_pixart_pipeline_computes_what_diffusers_and_transformers_compute(pipeline):
    """diffusers' PixArtAlphaPipeline on the same seeded weights (tests/reference/make_transformer_fixtures.py): the T5
    states and masks of a prompt and of the empty one, the transformer's prediction (both halves of learned sigma), a
    decode and two guided steps of the source's DPM-Solver++."""
    from transformer_fixtures import check_against_diffusers

    check_against_diffusers(pipeline, "pixart")


def test_pixart_trains_with_flow_matching_on_the_trainer_path(tmp_path):
    listing = write_corpus(str(tmp_path / "corpus"), num_records=4, records_per_shard=4)
    result = run_entry("train_txt2img_laion400m_trainer.py", [
        "--do_train", "--model_name_or_path", "pixart-tiny", "--allow_untrained_vae", "--allow_untrained_text_encoder",
        "--file_list", listing, "--resolution", str(RESOLUTION), "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_steps", "2", "--dataloader_num_workers", "0",
        "--report_to", "none", "--model_max_length", "16", "--prediction_type", "flow_matching",
        "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    scheduler = json.loads((tmp_path / "run" / "checkpoint-2" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert (tmp_path / "run" / "checkpoint-2" / "transformer" / "config.json").is_file()


def test_a_t5_saved_without_its_tied_embedding_is_read_as_transformers_reads_it(pipeline, tmp_path):
    """transformers writes a tied weight once (`shared.weight`, not `encoder.embed_tokens.weight`)."""
    import shutil

    from safetensors.numpy import save_file

    from ldm.models.text import T5
    from ldm.models.torch_layout import load_pretrained

    folder = tmp_path / "text_encoder"
    shutil.copytree(f"{pipeline}/text_encoder", folder)
    state = load_file(folder / "model.safetensors")
    del state["encoder.embed_tokens.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_pretrained(T5.model_class(), str(folder))
    np.testing.assert_array_equal(model.encoder.embed_tokens.weight.numpy(), state["shared.weight"])


def test_learned_sigma_trains_on_improved_ddpms_variational_bound():
    """guided-diffusion's `_vb_terms_bpd` (KL of the posterior to the model's step, the decoder's likelihood at t = 0)
    on known tensors, and the variance half of the DiT's output gets gradients."""
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion
    from ldm.models.noise import variational_bound

    c = build_components("pixart-tiny", seed=0)
    s = c.noise_scheduler
    x0, eps, t = paddle.randn([3, 4, 8, 8]), paddle.randn([3, 4, 8, 8]), paddle.to_tensor([0, 10, 500])
    xt = s.add_noise(x0, eps, t)
    exact = variational_bound(s, x0, xt, eps, -paddle.ones([3, 4, 8, 8]), t).numpy()  # the posterior's own step
    assert exact[0] > 0.1 and abs(exact[1]) < 1e-6 and abs(exact[2]) < 1e-6
    b, ab = s.betas.numpy().astype("float64"), s.alphas_cumprod.numpy().astype("float64")
    prev = np.append(1.0, ab[:-1])
    posterior = b * (1 - prev) / (1 - ab)
    k, x, e, n = 500, x0.numpy()[2], eps.numpy()[2] * 0.9, xt.numpy()[2]
    c1, c2 = b[k] * np.sqrt(prev[k]) / (1 - ab[k]), (1 - prev[k]) * np.sqrt(1 - b[k]) / (1 - ab[k])
    true_log_variance = np.log(posterior[k])
    log_variance = 0.65 * np.log(b[k]) + 0.35 * true_log_variance  # v = 0.3
    mean = c1 * (np.sqrt(1 / ab[k]) * n - np.sqrt(1 / ab[k] - 1) * e) + c2 * n
    kl = 0.5 * (-1 + log_variance - true_log_variance + np.exp(true_log_variance - log_variance)
                + (c1 * x + c2 * n - mean) ** 2 * np.exp(-log_variance))
    ours = variational_bound(s, x0, xt, eps * 0.9, paddle.full([3, 4, 8, 8], 0.3), t).numpy()[2]
    assert ours == pytest.approx(kl.mean() / np.log(2), rel=1e-3)

    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, s, freeze_text_encoder=True)
    model(paddle.rand([2, 3, 32, 32]) * 2 - 1, paddle.ones([2, 16], dtype="int64")).backward()
    grad = c.unet.proj_out.weight.grad.numpy()
    assert np.abs(grad.reshape(grad.shape[0], 4, 8)[:, :, 4:]).sum() > 0  # (patch, channel): the variance half


DIFFUSERS_SAVED = Path(__file__).resolve().parent / "fixtures" / "pixart-diffusers"  # make_diffusers_pixart_fixtures


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pipeline_diffusers_saved_computes_what_diffusers_computes_on_it(dtype):
    """A PixArtAlphaPipeline as diffusers 0.42 saves it (its transformer a PixArtTransformer2DModel, without
    `y_embedding`; its T5 tokenizer a tokenizer.json alone), in float32 and saved again with torch_dtype bfloat16: the
    T5 states and masks, the prediction, a decode, and two guided steps whose unconditional branch is the empty
    caption's T5 states with their mask, as diffusers computes them on the same folder read in float32."""
    from transformer_fixtures import check_against_diffusers

    check_against_diffusers(str(DIFFUSERS_SAVED / dtype / "pipeline"), f"pixart-diffusers/{dtype}", "diffusers.npz")


def test_bfloat16_weights_are_read_as_the_float32_they_were_rounded_from_widened():
    """diffusers' bfloat16 save rounds each float32 to nearest even; reading widens it back exactly."""
    from ldm.models.torch_layout import read_safetensors

    for part in ("transformer/diffusion_pytorch_model", "vae/diffusion_pytorch_model", "text_encoder/model"):
        wide = read_safetensors(str(DIFFUSERS_SAVED / "bfloat16" / "pipeline" / f"{part}.safetensors"))
        full = load_file(DIFFUSERS_SAVED / "float32" / "pipeline" / f"{part}.safetensors")
        assert wide.keys() == full.keys()
        for name, value in full.items():
            bits = value.view(np.uint32).astype(np.uint64)
            rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
            assert wide[name].dtype == np.float32 and np.array_equal(wide[name], rounded), name


def test_a_transformer_without_y_embedding_reads_it_as_zero_and_no_prediction_reads_it():
    from ldm.models.conditioning import Conditioning
    from ldm.models.families import PIXART, predict
    from ldm.models.torch_layout import load_pretrained

    transformer = load_pretrained(PIXART.model_class(), str(DIFFUSERS_SAVED / "float32" / "pipeline" / "transformer"))
    y_embedding = transformer.caption_projection.y_embedding
    assert not y_embedding.numpy().any()
    latents, states = paddle.randn([2, 4, 8, 8]), paddle.randn([2, 5, 16])
    mask = paddle.to_tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])  # a caption, and the empty one's end token
    with paddle.no_grad():
        before = predict(transformer, latents, paddle.to_tensor([10, 900]), Conditioning(states, mask)).numpy()
        y_embedding.set_value(paddle.randn(y_embedding.shape))
        after = predict(transformer, latents, paddle.to_tensor([10, 900]), Conditioning(states, mask)).numpy()
    np.testing.assert_array_equal(before, after)


def test_a_pipeline_diffusers_saved_trains_with_dropped_captions_samples_and_exports(tmp_path):
    from entry import run_python

    source = shutil.copytree(DIFFUSERS_SAVED / "float32" / "pipeline", tmp_path / "source")
    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    run = tmp_path / "run"
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--pretrained_model_name_or_path", str(source), "--file_list", listing, "--resolution", str(RESOLUTION),
        "--train_batch_size", "2", "--max_train_steps", "2", "--save_steps", "2", "--num_workers", "0",
        "--report_to", "none", "--model_max_length", "16", "--caption_dropout_prob", "0.5",
        "--output_dir", str(run)])
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["model"]["class"] == "Transformer2DModel"
    assert record["arguments"]["DataArguments"]["caption_dropout_prob"] == 0.5
    sampled = run_python(["-m", "ldm.generate", "--model", str(run / "checkpoint-2"), "--prompt", "a red circle",
                          "--num_inference_steps", "2", "--output_dir", str(tmp_path / "samples")])
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert (tmp_path / "samples" / "grid.png").is_file()
    exported = run_python(["-m", "ldm.export", "--checkpoint", str(run / "checkpoint-2"), "--output",
                           str(tmp_path / "hf"), "--format", "diffusers"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "model_index.json").read_text())["_class_name"] == "PixArtAlphaPipeline"
    trained = load_file(tmp_path / "hf" / "transformer" / "diffusion_pytorch_model.safetensors")
    start = load_file(source / "transformer" / "diffusion_pytorch_model.safetensors")
    assert not np.array_equal(trained["proj_out.weight"], start["proj_out.weight"])


def test_what_a_pixart_model_cannot_make_is_refused_at_start_in_one_line(tmp_path, capsys):
    """SD3's 16-channel autoencoder, a resolution of no whole number of patches, a damaged weights file (named, by
    training and by `ldm.generate`)."""
    from entry import said

    from ldm.generate import main as generate

    line = refused_at_start(["--model_name_or_path", "pixart-tiny", "--vae_name_or_path", "sd3-tiny", "--resolution",
                             "32"], tmp_path / "a")
    assert "reads latents of 4 channels and the autoencoder of --vae_name_or_path sd3-tiny makes 16" in line
    patch4 = shutil.copytree(PRESETS_DIR / "pixart-tiny", tmp_path / "patch4")
    config = json.loads((patch4 / "transformer" / "config.json").read_text())
    (patch4 / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": 4}))
    line = refused_at_start(["--model_name_or_path", str(patch4), "--resolution", "40"], tmp_path / "b")
    assert ("--resolution 40: each side must be a positive multiple of 16 (the DiT's size step: patch 4 x the "
            "autoencoder's downsampling 4)") in line
    for part in ("transformer/diffusion_pytorch_model", "vae/diffusion_pytorch_model"):
        damaged = shutil.copytree(DIFFUSERS_SAVED / "float32" / "pipeline", tmp_path / part.split("/")[0])
        weights = damaged / f"{part}.safetensors"
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])  # a copy cut short
        named = f"{weights} is damaged: it cannot be read as safetensors"
        assert named in refused_at_start(["--model_name_or_path", str(damaged), "--resolution", "32"],
                                         tmp_path / f"{part}-run")
        assert named in said(capsys, generate, ["--model", str(damaged), "--prompt", "a", "--output_dir",
                                                str(tmp_path / "samples")])


MULTI_SCALE = DIFFUSERS_SAVED / "multi-scale"  # make_diffusers_pixart_fixtures.py --multi-scale


def test_a_multi_scale_transformer_predicts_from_the_geometry_what_diffusers_predicts_from_its_conditions():
    """diffusers' `PixArtTransformer2DModel` with `use_additional_conditions` (sample_size 128, as PixArt-α's 1024 px
    models), saved by diffusers: our prediction from each image's geometry (original 300 x 200 and 96 x 64, a 48 x 32
    crop) equals diffusers' from resolution (the original size) and aspect ratio (the crop's height / width), within
    1e-4 of the largest value, as every transformer fixture here: float32 sums of at most 2^6 terms through at most 2^4
    reductions (K·D·u = 2^-14) and the sin-cos size embedding's arguments, at most 300, known to 300·u (2e-5 of the
    embedding's unit scale). Sampling 48 x 32 conditions on what diffusers' `PixArtAlphaPipeline` gives."""
    import hashlib

    from transformer_fixtures import relative

    from ldm.models.conditioning import GEOMETRY, Conditioning
    from ldm.models.families import PIXART, predict_with_variance
    from ldm.models.families.pixart import size_conditions
    from ldm.models.torch_layout import load_pretrained

    reference = json.loads((MULTI_SCALE / "reference.json").read_text())
    for name, digest in reference["weights_sha256"].items():
        assert hashlib.sha256((MULTI_SCALE / name).read_bytes()).hexdigest() == digest, name
    expected = dict(np.load(MULTI_SCALE / "multi_scale.npz"))
    transformer = load_pretrained(PIXART.model_class(), str(MULTI_SCALE / "transformer"))
    assert transformer.use_additional_conditions and PIXART.reads_added(transformer) == (GEOMETRY,)
    geometry = paddle.to_tensor([[300, 200, 3, 5, 48, 32], [96, 64, 0, 0, 48, 32]], dtype="float32")
    conditioning = Conditioning(paddle.to_tensor(expected["states"]), paddle.to_tensor(expected["mask"]),
                                added={GEOMETRY: geometry})
    with paddle.no_grad():
        prediction, variance = predict_with_variance(transformer, paddle.to_tensor(expected["latents"]),
                                                     paddle.to_tensor(expected["timesteps"]), conditioning)
    assert relative(paddle.concat([prediction, variance], axis=1).numpy(), expected["prediction"]) < 1e-4
    sampled = size_conditions(PIXART.sampling_added(48, 32, 2, transformer)[GEOMETRY])
    np.testing.assert_array_equal(sampled["resolution"].numpy(), expected["sampled_resolution"])
    np.testing.assert_array_equal(sampled["aspect_ratio"].numpy(), expected["sampled_aspect_ratio"])


def test_multi_scale_pixart_trains_on_cached_states_on_the_trainer_path_with_ema_exports_samples_and_evaluates(
        tmp_path, monkeypatch):
    """A seeded pixart-ms-tiny pipeline: its corpus encoded in buckets with the T5 states (`encode --text_embeddings`),
    trained on the Trainer entry point with EMA (each batch one bucket, conditioned on its records' stored geometry),
    exported in both layouts (the conditions kept in the config: diffusers' pipeline gives them only at sample_size
    128, so this one is sampled here), sampled by `ldm.generate --negative_prompt` at 48x24, and evaluated by
    `ldm.evaluate loss`: the export holds the checkpoint's EMA weights, not its trained ones."""
    from corpus import write_aspect_corpus
    from entry import run_python
    from interop_models import tiny_pixart_pipeline
    from scored import fid_and_clip_score

    from ldm.data.dataset import CONSUMED_LOG

    source = tiny_pixart_pipeline(str(tmp_path / "source"), to_diffusers=False, preset="pixart-ms-tiny")
    corpus = write_aspect_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=4)
    buckets = ["--resolution", str(RESOLUTION), "--aspect_buckets", "48x24,32x32"]
    encoded = run_python(["-m", "ldm.prepare", "encode", "--file_list", corpus, "--vae_name_or_path", source,
                          "--model_name_or_path", source, "--output_dir", str(tmp_path / "cached"), *buckets,
                          "--dtype", "float32", "--num_workers", "0", "--model_max_length", "16", "--text_embeddings",
                          "--text_dtype", "float32"])
    assert encoded.returncode == 0, encoded.stderr[-3000:]
    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    run = tmp_path / "run"
    trained = run_entry("train_txt2img_laion400m_trainer.py", [
        "--do_train", "--model_name_or_path", source, "--file_list", str(tmp_path / "cached" / "latents.filelist.list"),
        *buckets, "--per_device_train_batch_size", "2", "--max_steps", "2", "--save_steps", "2",
        "--dataloader_num_workers", "0", "--report_to", "none", "--model_max_length", "16", "--use_ema",
        "--output_dir", str(run)])
    assert trained.returncode == 0, trained.stderr[-3000:]
    shapes = {}
    for *_, shape, _, batch in (row.split() for row in log.read_text().splitlines()):
        shapes.setdefault(batch, set()).add(shape)
    assert len(shapes) == 2 and all(len(s) == 1 for s in shapes.values())
    assert json.loads((run / "run.json").read_text())["model"]["text_encoder_trained"] is False

    checkpoint = run / "checkpoint-2"
    for layout in ("ppdiffusers", "diffusers"):
        exported = run_python(["-m", "ldm.export", "--checkpoint", str(checkpoint), "--output",
                               str(tmp_path / layout), "--format", layout])
        assert exported.returncode == 0 and "(EMA weights)" in exported.stdout + exported.stderr, exported.stderr
        assert json.loads((tmp_path / layout / "transformer" / "config.json").read_text())["use_additional_conditions"]
        assert json.loads((tmp_path / layout / "model_index.json").read_text())["_class_name"] == "PixArtAlphaPipeline"
    sampled = run_python(["-m", "ldm.generate", "--model", str(tmp_path / "ppdiffusers"), "--prompt", "photo 1",
                          "--negative_prompt", "photo 2", "--height", "48", "--width", "24", "--num_inference_steps",
                          "2", "--output_dir", str(tmp_path / "samples")])
    assert sampled.returncode == 0 and (tmp_path / "samples" / "grid.png").is_file(), sampled.stderr[-3000:]

    losses = {}
    for name, model, extra in (("exported", tmp_path / "ppdiffusers", []), ("ema", checkpoint, []),
                               ("raw", checkpoint, ["--weights", "raw"])):
        evaluated = run_python(["-m", "ldm.evaluate", "loss", "--model", str(model), "--file_list", corpus, *buckets,
                                "--validation_samples", "4", "--json", *extra])
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        losses[name] = json.loads(evaluated.stdout.strip().splitlines()[-1])["loss"]
    assert losses["exported"] == losses["ema"] != losses["raw"] and np.isfinite(losses["raw"]), losses
    fid_and_clip_score(tmp_path / "ppdiffusers", corpus, tmp_path / "scored")
