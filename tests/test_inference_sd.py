"""Stable Diffusion pipelines (a frozen CLIP text encoder) in and out of the PyTorch ecosystem, checked against
diffusers' and transformers' own outputs (tests/reference/make_sd_fixtures.py computed them; nothing here imports
torch), and a run that continues one:
- the project's sd-tiny pipeline exported with `--format diffusers` is what diffusers' StableDiffusionPipeline loads
  and runs;
- a pipeline diffusers and transformers saved (transformers 5's tokenizer.json alone) loads and runs as there;
- a run starts from such a folder, keeps its text encoder frozen and out of its checkpoints, and exports it again."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from conftest import ROOT
from entry import run_entry
from interop_models import tiny_sd_pipeline
from test_inference_interop import RELATIVE, relative

from ldm.inference.load import load_for_inference

FIXTURES = ROOT / "tests" / "fixtures" / "sd"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
PROMPTS = ["a red circle on a blue background", ""]


def compare(unet, text_encoder, vae, tokenizer, expected) -> dict[str, float]:
    """Our parts' outputs on the reference's inputs, each part given the reference's inputs: {output: relative
    difference}; the tokenizer's ids equal."""
    ids = tokenizer(PROMPTS, padding="max_length", max_length=expected["input_ids"].shape[1],
                    truncation=True)["input_ids"]
    np.testing.assert_array_equal(ids, expected["input_ids"])
    with paddle.no_grad():
        hidden = text_encoder(paddle.to_tensor(expected["input_ids"]))[0]
        prediction = unet(paddle.to_tensor(expected["latents"]), paddle.to_tensor(expected["timesteps"]),
                          encoder_hidden_states=paddle.to_tensor(expected["hidden_states"])).sample
        image = vae.decode(paddle.to_tensor(expected["decode_latents"])).sample
    return {"hidden_states": relative(hidden.numpy(), expected["hidden_states"]),
            "prediction": relative(prediction.numpy(), expected["prediction"]),
            "image": relative(image.numpy(), expected["image"])}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The seeded sd-tiny pipeline (ppdiffusers' layout) and its export to diffusers' layout, by the command."""
    from ldm.export import main

    folder = tmp_path_factory.mktemp("sd")
    source = tiny_sd_pipeline(str(folder))
    assert main(["--checkpoint", source, "--output", str(folder / "diffusers"), "--format", "diffusers"]) == 0
    return source, folder / "diffusers"


def test_an_exported_stable_diffusion_pipeline_is_what_diffusers_loads_and_runs(exported):
    import hashlib

    source, folder = exported
    for name, digest in REFERENCE["exported"]["weights_sha256"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name  # the weights diffusers ran
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert "StableDiffusionPipeline.from_pretrained" in (folder / "README.md").read_text()
    expected = dict(np.load(FIXTURES / "exported.npz"))
    unet, text_encoder, vae, tokenizer, _, used_ema = load_for_inference(str(folder))
    assert not used_ema
    differences = compare(unet, text_encoder, vae, tokenizer, expected)
    assert max(differences.values()) < RELATIVE, differences


def test_the_whole_exported_pipeline_samples_as_diffusers_does(exported):
    """ppdiffusers' StableDiffusionPipeline on our folder, two DDIM steps with guidance from the reference's latents:
    the image diffusers' pipeline made."""
    from ppdiffusers import StableDiffusionPipeline

    source, _ = exported
    expected = dict(np.load(FIXTURES / "exported.npz"))
    pipeline = StableDiffusionPipeline.from_pretrained(source)
    image = pipeline(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, output_type="np",
                     latents=paddle.to_tensor(expected["latents"][:1])).images
    assert relative(image, expected["generated"]) < RELATIVE


def test_a_pipeline_diffusers_and_transformers_saved_loads_and_runs_as_there():
    folder = FIXTURES / "diffusers"
    assert not (folder / "tokenizer" / "vocab.json").exists()  # transformers 5 writes tokenizer.json alone
    unet, text_encoder, vae, tokenizer, _, _ = load_for_inference(str(folder))
    assert type(text_encoder).__name__ == "CLIPTextModel"
    differences = compare(unet, text_encoder, vae, tokenizer, dict(np.load(FIXTURES / "diffusers.npz")))
    assert max(differences.values()) < RELATIVE, differences


def test_a_run_continues_a_stable_diffusion_pipeline_with_its_text_encoder_frozen(exported, tmp_path):
    """The sd-tiny architecture preset, its weights from the exported pipeline (--init_from_checkpoint, with the
    text encoder and tokenizer from there too): the UNet trains from those weights, the text encoder stays as it was
    and in no checkpoint, the lineage names the pipeline, a resume with the text encoder trained is refused in one
    line, and the run's export loads in ppdiffusers' StableDiffusionPipeline."""
    from corpus import write_corpus
    from ppdiffusers import StableDiffusionPipeline
    from safetensors.numpy import load_file

    _, folder = exported
    file_list = write_corpus(str(tmp_path / "corpus"), 8, 4)
    out = tmp_path / "run"
    args = ["--model_name_or_path", "sd-tiny", "--init_from_checkpoint", str(folder), "--vae_name_or_path",
            str(folder), "--file_list", file_list, "--resolution", "32", "--train_batch_size", "2",
            "--max_train_steps", "2", "--save_steps", "2", "--num_workers", "0", "--report_to", "none",
            "--learning_rate", "1e-3", "--use_ema", "--output_dir", str(out)]
    result = run_entry("train_txt2img_laion400m_no_trainer.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = out / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.iterdir() if p.is_dir()) == ["scheduler", "tokenizer", "unet"]
    record = json.loads((checkpoint / "ldm_model.json").read_text())
    assert record["text_encoder"] == "../text_encoder" and record["text_encoder_identity"]["family"] == "clip"
    source = load_file(str(folder / "text_encoder" / "model.safetensors"))
    frozen = load_file(str(out / "text_encoder" / "model.safetensors"))
    for name, value in source.items():  # torch layout there, Paddle's here: a Linear's weight is transposed
        np.testing.assert_array_equal(frozen[name], value.T if value.ndim == 2 and "embedding" not in name else value)
    run = json.loads((out / "run.json").read_text())
    assert run["lineage"]["kind"] == "pipeline" and run["lineage"]["init_from"] == str(folder)
    assert run["model"]["text_encoder_trained"] is False
    ema = json.loads((checkpoint / "ema.json").read_text())
    assert not any("text_encoder" in name for name in json.dumps(ema).split('"') if name.startswith("shadow."))
    unet = load_file(str(checkpoint / "unet" / "diffusion_paddle_model.safetensors"))
    start = load_file(str(folder / "unet" / "diffusion_pytorch_model.safetensors"))
    assert not np.array_equal(unet["conv_in.weight"], start["conv_in.weight"])  # trained
    assert np.abs(unet["conv_in.weight"] - start["conv_in.weight"]).max() < 0.05  # from those weights, not afresh
    pipeline = StableDiffusionPipeline.from_pretrained(str(out / "pipeline"))
    assert pipeline("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images.shape == (
        1, 32, 32, 3)

    refused = run_entry("train_txt2img_laion400m_no_trainer.py", [
        *args, "--max_train_steps", "4", "--resume_from_checkpoint", "auto", "--train_text_encoder", "true"])
    assert refused.returncode != 0
    error = refused.stderr.strip().splitlines()[-1]
    assert "text encoder" in error and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    # resumed, saving at every update and keeping one checkpoint: the one it resumed from (whose tokenizer it read)
    # is rotated away before the next save writes the tokenizer again
    resumed = run_entry("train_txt2img_laion400m_no_trainer.py", [
        *args, "--max_train_steps", "4", "--save_steps", "1", "--checkpoints_total_limit", "1",
        "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4"]
    assert (out / "checkpoint-4" / "tokenizer" / "vocab.json").is_file()
