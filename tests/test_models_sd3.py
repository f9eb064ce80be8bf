"""Stable Diffusion 3 by composition: ppdiffusers' `SD3Transformer2DModel` (an MMDiT reading the pooled text vector)
with SD3's three frozen text encoders read as one (`ldm.models.text_set`) and the 16-channel autoencoder's shift,
trained with flow matching from a diffusers `StableDiffusion3Pipeline` folder in an aspect-ratio bucket, resumed,
exported in diffusers' layout and sampled by ppdiffusers' `StableDiffusion3Pipeline` as by `ldm.generate`; the
outputs of diffusers' own pipeline on the same weights (tests/fixtures/sd3); the Trainer path from the preset; the
2 B preset's architecture."""

import json

import numpy as np
import paddle
import pytest
from corpus import write_corpus
from entry import run_entry, run_python
from safetensors.numpy import load_file

from ldm.models.build import PRESETS_DIR

RESOLUTION = 32


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from interop_models import tiny_sd3_pipeline

    return tiny_sd3_pipeline(str(tmp_path_factory.mktemp("sd3")))


def test_the_sd3_preset_is_sd3_mediums_architecture():
    """Its parts fit together as SD3's do: CLIP-L and CLIP-G projections side by side are the pooled vector, T5-XXL's
    width the joint attention's, 24 heads of 64 the caption projection's width."""
    configs = {part: json.loads((PRESETS_DIR / "sd3-medium" / part / "config.json").read_text())
               for part in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")}
    t, clip_l, clip_g, t5, vae = configs.values()
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["patch_size"]) == (24, 24, 64, 2)
    assert t["caption_projection_dim"] == t["num_attention_heads"] * t["attention_head_dim"] == 1536
    assert t["pooled_projection_dim"] == clip_l["projection_dim"] + clip_g["projection_dim"] == 2048
    assert t["joint_attention_dim"] == t5["d_model"] == 4096 and t5["num_layers"] == 24
    assert (clip_g["hidden_size"], clip_g["num_hidden_layers"]) == (1280, 32)
    assert t["in_channels"] == vae["latent_channels"] == 16 and vae["shift_factor"] == 0.0609
    scheduler = json.loads((PRESETS_DIR / "sd3-medium" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler["shift"] == 3.0


def test_the_encoder_set_encodes_as_stable_diffusion_3s_pipeline_and_latents_are_shifted(pipeline, tmp_path):
    import shutil

    from ppdiffusers import StableDiffusion3Pipeline

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_for_inference
    from ldm.models.autoencoder import scaled_latents, unscaled_latents
    from ldm.models.text import encode_prompt

    _, text_encoder, vae, tokenizer, _, _ = load_for_inference(pipeline)
    ids = paddle.to_tensor(np.stack([CaptionTokenizer(tokenizer, 16)(p) for p in ("a red circle", "")]))
    assert ids.shape == [2, 48]  # each tokenizer's 16 ids, end to end
    encoded = encode_prompt(text_encoder, ids)
    states, mask, pooled = encoded.states, encoded.mask, encoded.pooled
    copy = shutil.copytree(pipeline, tmp_path / "copy")  # ppdiffusers writes its conversion beside the weights
    theirs = StableDiffusion3Pipeline.from_pretrained(str(copy), from_diffusers=True)
    expected, _, expected_pooled, _ = theirs.encode_prompt("a red circle", "a red circle", "a red circle",
                                                           do_classifier_free_guidance=False)
    assert mask is None and states.shape == [2, 32, 96] and pooled.shape == [2, 80]
    np.testing.assert_allclose(states[:1].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled[:1].numpy(), expected_pooled.numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(states[0, :16, 80:].numpy()).max() == 0  # the CLIP states padded to T5's width

    latents = paddle.to_tensor([[0.5, -1.0]])
    np.testing.assert_allclose(scaled_latents(vae, latents, 1.5305).numpy(), [[(0.5 - 0.0609) * 1.5305,
                                                                               (-1.0 - 0.0609) * 1.5305]], rtol=1e-6)
    np.testing.assert_allclose(unscaled_latents(vae, scaled_latents(vae, latents, 1.5305)).numpy(), latents.numpy(),
                               rtol=1e-6)


def test_the_sd3_pipeline_computes_what_diffusers_and_transformers_compute(pipeline):
    """diffusers' StableDiffusion3Pipeline on the same seeded weights (tests/reference/make_transformer_fixtures.py):
    the states and pooled vectors of a prompt and of the empty one, the transformer's prediction, a decode and two
    guided flow Euler steps."""
    from transformer_fixtures import check_against_diffusers

    check_against_diffusers(pipeline, "sd3")


def test_an_sd3_pipeline_trains_in_a_bucket_resumes_and_exports_what_ppdiffusers_pipeline_samples(pipeline,
                                                                                                  tmp_path):
    from ppdiffusers import StableDiffusion3Pipeline
    from transformer_fixtures import export_to_diffusers, sampled_as_by_the_pipeline

    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    run = tmp_path / "run"
    args = ["--pretrained_model_name_or_path", pipeline, "--file_list", listing, "--resolution", str(RESOLUTION),
            "--aspect_buckets", "48x24,32x32", "--train_batch_size", "2", "--save_steps", "2", "--num_workers", "0",
            "--report_to", "none", "--learning_rate", "1e-3", "--output_dir", str(run)]
    for more in (["--max_train_steps", "2"], ["--max_train_steps", "3", "--resume_from_checkpoint", "latest"]):
        result = run_entry("train_txt2img_laion400m_no_trainer.py", [*args, *more])  # then resumed, frozen encoders too
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resum" in result.stderr
    record = json.loads((run / "run.json").read_text())["model"]
    assert record["class"] == "SD3Transformer2DModel" and record["text_encoder_identity"]["family"] == "sd3"
    assert record["prediction_type"] == "flow_matching" and record["text_encoder_identity"]["max_length"] == 16
    exported = tmp_path / "hf"
    index = export_to_diffusers(run / "checkpoint-3", exported, pipeline,  # the frozen encoders as they came
                                ("text_encoder", "text_encoder_2", "text_encoder_3"))
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert "max_sequence_length=16" in (exported / "README.md").read_text()
    sampled_as_by_the_pipeline(exported, StableDiffusion3Pipeline)


def test_sd3_trains_from_its_preset_on_the_trainer_path(tmp_path):
    listing = write_corpus(str(tmp_path / "corpus"), num_records=4, records_per_shard=4)
    result = run_entry("train_txt2img_laion400m_trainer.py", [
        "--do_train", "--model_name_or_path", "sd3-tiny", "--allow_untrained_vae", "--allow_untrained_text_encoder",
        "--file_list", listing, "--resolution", str(RESOLUTION), "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_steps", "2", "--dataloader_num_workers", "0",
        "--report_to", "none", "--model_max_length", "16", "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoint-2"
    scheduler = json.loads((checkpoint / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"  # the preset's: flow matching by default
    assert json.loads((checkpoint / "transformer" / "config.json").read_text())["_class_name"] == \
        "SD3Transformer2DModel"
    assert {p.name for p in (tmp_path / "run" / "text_encoder").iterdir()} >= {"text_encoder", "text_encoder_2",
                                                                               "text_encoder_3", "config.json"}
    own = json.loads((tmp_path / "run" / "text_encoder" / "config.json").read_text())
    assert (own["max_position_embeddings"], own["hidden_size"], own["projection_dim"]) == (77, 96, 80)


def test_cached_sd3_states_and_pooled_vectors_train_to_the_losses_of_encoding_on_the_fly(pipeline, tmp_path):
    """`encode --text_embeddings` of an SD3 model stores each caption's joint states and its pooled vector; a run on
    them (captions dropped for the empty caption's) has the losses of one that runs the three encoders."""
    from conftest import metrics_lines

    from ldm.data.latents import parse_latent_record
    from ldm.data.shard import iter_lines

    corpus = write_corpus(str(tmp_path / "corpus"), num_records=12, records_per_shard=6)
    losses = {}
    for name, extra in (("cached", ["--text_embeddings", "--text_dtype", "float32"]), ("plain", [])):
        result = run_python(["-m", "ldm.prepare", "encode", "--file_list", corpus, "--vae_name_or_path", pipeline,
                             "--model_name_or_path", pipeline, "--output_dir", str(tmp_path / name), "--resolution",
                             str(RESOLUTION), "--dtype", "float32", "--num_workers", "0", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        result = run_entry("train_txt2img_laion400m_no_trainer.py", [
            "--model_name_or_path", pipeline, "--file_list", str(tmp_path / name / "latents.filelist.list"),
            "--resolution", str(RESOLUTION), "--train_batch_size", "2", "--max_train_steps", "6", "--save_steps", "6",
            "--num_workers", "0", "--report_to", "none", "--logging_steps", "1", "--learning_rate", "1e-3",
            "--caption_dropout_prob", "0.3", "--output_dir", str(tmp_path / f"run-{name}")])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = [line["train/loss"] for line in metrics_lines(tmp_path / f"run-{name}") if "train/loss" in line]
    _, (_, meta, _) = parse_latent_record(next(iter(iter_lines(str(tmp_path / "cached" / "latents-000000.gz")))))
    assert meta.text["shape"] == [32, 96] and meta.text["pooled"] == [80]  # 2 x 16 tokens of T5's width
    assert len(losses["cached"]) == 6 and len(set(losses["cached"])) == 6
    np.testing.assert_allclose(losses["cached"], losses["plain"], rtol=1e-5)


def test_a_diffusers_sd3_transformer_lacks_two_layer_norm_biases_of_ppdiffusers_and_reads_them_as_zero(pipeline,
                                                                                                       tmp_path):
    """diffusers' SD3Transformer2DModel has no bias on its weightless layer norms (the last block's context norm, the
    output norm), so its folders lack what ppdiffusers' class holds: read as zero, frozen, the same prediction."""
    import shutil

    from safetensors.numpy import save_file

    from ldm.models.conditioning import Conditioning
    from ldm.models.families import SD3, predict
    from ldm.models.torch_layout import load_pretrained

    folder = shutil.copytree(f"{pipeline}/transformer", tmp_path / "transformer")
    weights = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    lacking = {"norm_out.norm.bias", "transformer_blocks.1.norm1_context.norm.bias"}
    assert lacking <= state.keys()
    save_file({k: v for k, v in state.items() if k not in lacking}, weights, metadata={"format": "pt"})
    theirs, ours = load_pretrained(SD3.model_class(), str(folder)), load_pretrained(SD3.model_class(),
                                                                                    f"{pipeline}/transformer")
    assert set(SD3.freeze_unexported(theirs)) == lacking
    parameters = dict(theirs.named_parameters())
    assert all(parameters[name].stop_gradient and not parameters[name].numpy().any() for name in lacking)
    latents, states, pooled = paddle.randn([1, 16, 8, 8]), paddle.randn([1, 5, 96]), paddle.randn([1, 80])
    with paddle.no_grad():
        conditioning = Conditioning(states, pooled=pooled)
        np.testing.assert_array_equal(predict(theirs, latents, paddle.to_tensor([500.0]), conditioning).numpy(),
                                      predict(ours, latents, paddle.to_tensor([500.0]), conditioning).numpy())


def test_sd3_with_recompute_gives_the_gradients_of_sd3_without():
    """ppdiffusers 0.29's SD3 loop takes a checkpointed block's (text, image) output as the image tokens
    (`ldm.models.families.sd3.sd3_recompute_unpacks` mends it)."""
    from interop_models import fill_seeded

    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion

    grads = []
    for recompute in (False, True):
        c = build_components("sd3-tiny", seed=0)
        fill_seeded(c.unet, 5)  # no zero-initialised output layer: every block gets gradients
        model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, freeze_text_encoder=True,
                                recompute=recompute)
        model.train()
        paddle.seed(1)
        model(paddle.rand([2, 3, 32, 32]) * 2 - 1, paddle.ones([2, 48], dtype="int64")).backward()
        grads.append(c.unet.transformer_blocks[0].attn.to_q.weight.grad.numpy())
    assert np.abs(grads[0]).sum() > 0
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_what_sd3_cannot_do_here_is_refused_in_one_line(tmp_path):
    """An SD3 transformer without SD3's encoders; its encoders trained; --attention sdpa (its joint attention has a
    processor of its own); a Stable Diffusion (1/2) pipeline whose CLIP has a projection."""
    import shutil
    from types import SimpleNamespace

    from ldm.models.attention import set_attention
    from ldm.models.build import ModelSourceError, build_components, check_model_index
    from ldm.runtime.errors import UserError
    from ldm.train.setup import text_source

    with pytest.raises(ModelSourceError, match="three text encoders train frozen here"):
        text_source(SimpleNamespace(model_name_or_path="sd3-tiny", train_text_encoder=True, init_from_checkpoint=None))
    with pytest.raises(UserError, match="--attention sdpa: ppdiffusers' SD3Transformer2DModel takes no attention"):
        set_attention(build_components("sd3-tiny").unet, "sdpa")
    index = tmp_path / "sd" / "model_index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                 "unet": ["diffusers", "UNet2DConditionModel"],
                                 "text_encoder": ["transformers", "CLIPTextModelWithProjection"]}))
    with pytest.raises(ModelSourceError, match="its text_encoder is a transformers CLIPTextModelWithProjection"):
        check_model_index(str(index.parent))

    folder = tmp_path / "one-clip"
    shutil.copytree(PRESETS_DIR / "sd3-tiny", folder)
    for part in ("text_encoder_2", "text_encoder_3", "tokenizer_2", "tokenizer_3"):
        shutil.rmtree(folder / part)
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    (folder / "text_encoder" / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    with pytest.raises(ModelSourceError, match="reads a pooled text vector 80 wide and its text encoders make none"):
        build_components(str(folder))


def test_what_sd3_cannot_make_is_refused_at_start_in_one_line(pipeline, tmp_path, capsys):
    """A 4-channel autoencoder; a side of more patches than `pos_embed_max_size` (sd3-tiny: 16 patches of 2 latents
    of 4 px, 128 px) in training, in a bucket list and in `ldm.generate`, the auto buckets kept within it; a damaged
    `text_encoder_3` named, by training and by `ldm.generate`."""
    import shutil

    from entry import refused_at_start, said

    from ldm.generate import main as generate
    from ldm.models.build import model_buckets

    line = refused_at_start(["--model_name_or_path", pipeline, "--vae_name_or_path", "pixart-tiny", "--resolution",
                             "32"], tmp_path / "a")
    assert "reads latents of 16 channels and the autoencoder of --vae_name_or_path pixart-tiny makes 4" in line
    largest = "the largest side this SD3Transformer2DModel takes is 128 px"
    assert largest in refused_at_start(["--model_name_or_path", pipeline, "--resolution", "256"], tmp_path / "b")
    line = refused_at_start(["--model_name_or_path", pipeline, "--resolution", "128", "--aspect_buckets",
                             "96x160,128x128"], tmp_path / "c")
    assert "96x160 has a side longer than 128 px" in line
    assert model_buckets("auto", 128, 2.0, pipeline) == ((128, 128),)
    within = model_buckets("auto", 96, 2.0, pipeline)
    assert max(max(bucket) for bucket in within) == 128 and len(within) > 1
    assert largest in said(capsys, generate, ["--model", pipeline, "--prompt", "a", "--height", "256", "--output_dir",
                                              str(tmp_path / "samples")])
    damaged = shutil.copytree(pipeline, tmp_path / "damaged")
    weights = damaged / "text_encoder_3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size - 100])  # a copy cut short
    named = f"{weights} is damaged: it cannot be read as safetensors"
    assert named in refused_at_start(["--model_name_or_path", str(damaged), "--resolution", "32"], tmp_path / "d")
    assert named in said(capsys, generate, ["--model", str(damaged), "--prompt", "a", "--output_dir",
                                            str(tmp_path / "samples")])
    assert not (tmp_path / "samples").exists()
