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
from entry import run_entry, said
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


@pytest.fixture(scope="module")
def sd_run(exported, tmp_path_factory):
    """A run that continues the exported pipeline (the sd-tiny architecture preset, its weights from there, with the
    text encoder and tokenizer) for 2 updates on captions of 16 tokens (CLIP keeps its 77 positions): (its flags
    but --output_dir, its folder). Tests that change the run work on a copy."""
    from corpus import write_corpus

    _, folder = exported
    root = tmp_path_factory.mktemp("sd-run")
    file_list = write_corpus(str(root / "corpus"), 8, 4)
    args = ["--model_name_or_path", "sd-tiny", "--init_from_checkpoint", str(folder), "--vae_name_or_path",
            str(folder), "--file_list", file_list, "--resolution", "32", "--train_batch_size", "2",
            "--max_train_steps", "2", "--save_steps", "2", "--num_workers", "0", "--report_to", "none",
            "--learning_rate", "1e-3", "--use_ema", "--model_max_length", "16"]
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [*args, "--output_dir", str(root / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    return args, root / "run"


def copy_run(run, tmp_path):
    import shutil

    return shutil.copytree(run, tmp_path / "run")


def test_a_run_continues_a_stable_diffusion_pipeline_with_its_text_encoder_frozen(exported, sd_run, tmp_path):
    """The sd-tiny architecture preset, its weights from the exported pipeline (--init_from_checkpoint, with the
    text encoder and tokenizer from there too): the UNet trains from those weights, the text encoder stays as it was
    and in no checkpoint, the lineage names the pipeline, a resume with the text encoder trained is refused in one
    line, and the run's export loads in ppdiffusers' StableDiffusionPipeline."""
    from ppdiffusers import StableDiffusionPipeline
    from safetensors.numpy import load_file

    _, folder = exported
    base, run = sd_run
    out = copy_run(run, tmp_path)
    args = [*base, "--output_dir", str(out)]
    checkpoint = out / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.iterdir() if p.is_dir()) == ["scheduler", "tokenizer", "unet"]
    record = json.loads((checkpoint / "ldm_model.json").read_text())
    assert record["text_encoder"] == "../text_encoder" and record["text_encoder_identity"]["family"] == "clip"
    source = load_file(str(folder / "text_encoder" / "model.safetensors"))
    frozen = load_file(str(out / "text_encoder" / "model.safetensors"))
    for name, value in source.items():  # torch layout there, Paddle's here: a Linear's weight is transposed
        np.testing.assert_array_equal(frozen[name], value.T if value.ndim == 2 and "embedding" not in name else value)
    run_record = json.loads((out / "run.json").read_text())
    assert run_record["lineage"]["kind"] == "pipeline" and run_record["lineage"]["init_from"] == str(folder)
    assert run_record["model"]["text_encoder_trained"] is False
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


def pipeline_and_ours(folder, prompt: str, negative_prompt: str, steps: int = 2, guidance: float = 3.0):
    """(ppdiffusers' StableDiffusionPipeline's image, ldm.generate's) of a pipeline folder from the same noise:
    what diffusers' pipeline does on the same folder (test_the_whole_exported_pipeline_samples_as_diffusers_does)."""
    from ppdiffusers import StableDiffusionPipeline

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.sampling import ddim_scheduler, generate, initial_noise
    from ldm.models.text import prompt_length

    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(str(folder))
    ours = generate(unet, text_encoder, vae, ddim_scheduler(scheduler_config),
                    CaptionTokenizer(tokenizer, prompt_length(text_encoder, tokenizer)), [prompt],
                    guidance_scale=guidance, num_inference_steps=steps, seed=0, negative_prompt=negative_prompt)
    pipeline = StableDiffusionPipeline.from_pretrained(str(folder))
    latents = paddle.to_tensor(initial_noise([unet.config.in_channels, unet.config.sample_size,
                                              unet.config.sample_size], 0, 0))[None]
    theirs = pipeline(prompt, negative_prompt=negative_prompt, num_inference_steps=steps, guidance_scale=guidance,
                      latents=latents, output_type="np").images
    return np.round(theirs * 255), ours.astype(np.float64)


def test_ldm_generate_samples_with_the_caption_length_the_model_was_trained_with_and_a_negative_prompt(sd_run,
                                                                                                    tmp_path):
    """A CLIP model trained on 16 tokens (its encoder keeps 77 positions) is sampled on 16: from its checkpoint (its
    model record) and from its export, which records 16 wherever a pipeline reads the length, so ldm.generate makes
    the image the pipeline makes from the same noise, with a negative prompt as the unconditional input."""
    from ldm.export import main as export
    from ldm.generate import main as generate_main
    from ldm.models.text import prompt_length

    _, run = sd_run
    checkpoint = run / "checkpoint-2"
    _, text_encoder, _, tokenizer, _, _ = load_for_inference(str(checkpoint))
    assert text_encoder.config.max_position_embeddings == 77 and prompt_length(text_encoder, tokenizer) == 16
    folder = tmp_path / "diffusers"
    assert export(["--checkpoint", str(checkpoint), "--output", str(folder), "--format", "diffusers"]) == 0
    config = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 16 and config.get("max_len", 16) == 16
    assert "prompts of 16 tokens" in (folder / "README.md").read_text()
    ppdiffusers = tmp_path / "ppdiffusers"
    assert export(["--checkpoint", str(folder), "--output", str(ppdiffusers)]) == 0  # what the pipeline reads
    for negative in ("", "a blue square"):
        theirs, ours = pipeline_and_ours(ppdiffusers, "a red circle on a blue background", negative)
        assert np.abs(theirs - ours).max() <= 1, negative  # uint8 rounding
    assert np.abs(pipeline_and_ours(ppdiffusers, "a red circle", "a blue square")[1]
                  - pipeline_and_ours(ppdiffusers, "a red circle", "")[1]).max() > 0  # the negative prompt is used
    out = tmp_path / "samples"
    assert generate_main(["--model", str(checkpoint), "--prompt", "a red circle", "--negative_prompt", "a blue square",
                          "--num_inference_steps", "2", "--guidance_scale", "3", "--output_dir", str(out)]) == 0
    assert len(list(out.glob("000-00-*.png"))) == 1


def test_an_export_stands_alone_and_names_the_diffusers_release_of_its_layout(exported, sd_run):
    """`_diffusers_version` is the diffusers release the layout was checked against (the fixtures' reference), not
    ppdiffusers' version; the tokenizer's config names no file of the folder it was read from (a checkpoint, which a
    run's rotation deletes)."""
    from ldm.inference.export import DIFFUSERS_VERSION

    _, folder = exported
    _, run = sd_run
    assert REFERENCE["versions"]["diffusers"] == DIFFUSERS_VERSION  # the release the export was checked against
    for config in [folder / "model_index.json", *folder.glob("*/*config.json")]:
        written = json.loads(config.read_text()).get("_diffusers_version")
        assert written in (None, DIFFUSERS_VERSION), config
    assert json.loads((folder / "model_index.json").read_text())["_diffusers_version"] == DIFFUSERS_VERSION
    for exported_folder in (folder, run / "pipeline"):
        tokenizer = json.loads((exported_folder / "tokenizer" / "tokenizer_config.json").read_text())
        assert "special_tokens_map_file" not in tokenizer and "name_or_path" not in tokenizer, exported_folder




def flip_exponent_bit(weights) -> None:
    """One exponent bit of the first tensor's first value flipped, the size unchanged: a wrong encoder that loads."""
    import struct

    data = bytearray(weights.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + 3] ^= 0x40
    weights.write_bytes(bytes(data))


def test_a_damaged_frozen_text_encoder_is_refused_wherever_it_is_read(sd_run, tmp_path, capsys):
    """One bit of the run's text_encoder/ flipped: generate, export, evaluate and a resume each stop in one line that
    names the file and both digests, rather than use a wrong encoder (or call it another model)."""
    import hashlib

    from ldm.evaluate import main as evaluate
    from ldm.export import main as export
    from ldm.generate import main as generate_main

    base, run = sd_run
    out = copy_run(run, tmp_path)
    weights = out / "text_encoder" / "model.safetensors"
    expected = json.loads((out / "text_encoder" / "manifest.json").read_text())["files"]["model.safetensors"]
    flip_exponent_bit(weights)
    found = hashlib.sha256(weights.read_bytes()).hexdigest()
    checkpoint = str(out / "checkpoint-2")
    file_list = base[base.index("--file_list") + 1]

    lines = [
        said(capsys, generate_main, ["--model", checkpoint, "--prompt", "a", "--output_dir",
                                     str(tmp_path / "samples")]),
        said(capsys, export, ["--checkpoint", checkpoint, "--output", str(tmp_path / "export"), "--format",
                              "diffusers"]),
        said(capsys, evaluate, ["loss", "--model", checkpoint, "--file_list", file_list, "--validation_samples", "2"]),
    ]
    resumed = run_entry("train_txt2img_laion400m_no_trainer.py", [*base, "--output_dir", str(out),
                                                                  "--max_train_steps", "3", "--resume_from_checkpoint",
                                                                  "latest"])
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    lines.append(resumed.stderr.strip().splitlines()[-1])
    for line in lines:
        assert line.startswith("error: ") and "damaged" in line, line
        assert "model.safetensors" in line and found in line and expected["sha256"] in line, line
    assert not (tmp_path / "samples").exists() and not (tmp_path / "export").exists()


def test_a_resume_with_another_caption_length_says_what_differs(sd_run, tmp_path):
    base, run = sd_run
    out = copy_run(run, tmp_path)
    args = [*base, "--output_dir", str(out), "--max_train_steps", "3", "--resume_from_checkpoint", "latest",
            "--model_max_length", "12"]
    refused = run_entry("train_txt2img_laion400m_no_trainer.py", args)
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = refused.stderr.strip().splitlines()[-1]
    assert "max_length 12, the checkpoint recorded 16" in error and "Traceback" not in refused.stderr, error


@pytest.fixture
def pipeline_copy(exported, tmp_path):
    """A copy of the seeded sd-tiny pipeline (ppdiffusers' layout) to break."""
    import shutil

    source, _ = exported
    return shutil.copytree(source, tmp_path / "pipeline")


def test_a_tokenizer_larger_than_its_encoders_embedding_is_refused_in_one_line(pipeline_copy, tmp_path, capsys):
    """By ldm.generate and by a run's start, naming both parts, rather than Paddle's "expected >= 0 and < N" at the
    first caption that uses a token past the embedding's end."""
    import re

    from ldm.config.args import DataArguments, ModelArguments
    from ldm.generate import main as generate_main
    from ldm.models.build import ModelSourceError
    from ldm.models.text import write_clip_vocab
    from ldm.train import setup

    words = [f"word{i}x" for i in range(40)] + ["zebra", "giraffe", "elephant", "photograph", "mountain", "sunset",
                                                 "landscape", "portrait"]
    write_clip_vocab(words, str(pipeline_copy / "tokenizer"))  # 650 tokens: more than sd-tiny's 601
    line = said(capsys, generate_main, ["--model", str(pipeline_copy), "--prompt", "word1x", "--output_dir",
                                        str(tmp_path / "out")])
    assert re.search(r"has 650 tokens and the text encoder of .* embeds 601", line), line
    assert f"{pipeline_copy / 'tokenizer'} has" in line and f"{pipeline_copy / 'text_encoder'} embeds" in line, line
    model_args = ModelArguments(model_name_or_path=str(pipeline_copy), vae_name_or_path=str(pipeline_copy))
    data = DataArguments(resolution=32)
    text = setup.text_source(model_args)
    with pytest.raises(ModelSourceError, match=r"650 tokens and the text encoder of .* embeds 601: not a pair"):
        setup.build_model(model_args, data, setup.build_tokenizer(data, text), recompute=False, seed=0, text=text)


def test_a_pipeline_without_its_scheduler_or_with_parts_it_cannot_read_is_refused_in_one_line(pipeline_copy, tmp_path,
                                                                                             capsys):
    import shutil

    from ldm.generate import main as generate_main
    from ldm.models.build import check_model_index

    index_file = pipeline_copy / "model_index.json"
    index = json.loads(index_file.read_text())
    argv = ["--model", str(pipeline_copy), "--prompt", "a", "--output_dir", str(tmp_path / "out")]
    for part, value, expected in (
            ("text_encoder_2", ["transformers", "CLIPTextModelWithProjection"],
             "its text_encoder_2 (transformers CLIPTextModelWithProjection) is a part this framework does not read"),
            ("vae", ["diffusers", "AutoencoderTiny"], "its vae is a diffusers AutoencoderTiny, which this framework "
                                                      "does not read")):
        index_file.write_text(json.dumps({**index, part: value}))
        assert expected in said(capsys, generate_main, argv)
    # any scheduler (its noise schedule is read), and the parts text-to-image sampling does not use
    index_file.write_text(json.dumps({**index, "scheduler": ["diffusers", "PNDMScheduler"],
                                      "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"]}))
    check_model_index(str(pipeline_copy))
    shutil.rmtree(pipeline_copy / "scheduler")
    line = said(capsys, generate_main, argv)
    assert "has no scheduler/scheduler_config.json" in line and "copy the scheduler/ folder" in line, line
    assert not (tmp_path / "out").exists()


def test_a_t5_model_exported_for_diffusers_is_refused_in_one_line(tmp_path, capsys):
    """The documented refusal, before the model card (which read the position table T5 does not have)."""
    from interop_models import tiny_t5_model

    from ldm.export import main as export

    folder = tiny_t5_model(str(tmp_path))
    index = {"_class_name": "StableDiffusionPipeline", "scheduler": ["diffusers", "DDPMScheduler"],
             "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "T5Tokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
    with open(f"{folder}/model_index.json", "w") as f:  # the model folder as a pipeline folder
        json.dump(index, f)
    line = said(capsys, export, ["--checkpoint", folder, "--output", str(tmp_path / "out"), "--format", "diffusers"])
    assert "a UNet with a T5 text encoder is not exported as a pipeline" in line, line
    assert not (tmp_path / "out").exists()
