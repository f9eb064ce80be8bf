"""Model folders of pipeline classes this framework does not train (`ldm.models.build`): Stable Diffusion XL's, told by
its `model_index.json` class, its second text encoder on disk or its UNet's added conditions, refused in one line by
training, `ldm.generate` and `ldm.export` alike, before any weight is read."""

import json
import shutil

import pytest
from entry import said

from ldm.models.build import PRESETS_DIR


def sdxl_folder(tmp_path, index: bool = True, second_encoder: bool = True):
    """sd-tiny's configs laid out as a Stable Diffusion XL pipeline: a UNet with SDXL's added text and time
    conditions, a second CLIP (with projection) and tokenizer, model_index.json naming StableDiffusionXLPipeline."""
    folder = tmp_path / "sdxl"
    shutil.copytree(PRESETS_DIR / "sd-tiny", folder)
    unet = json.loads((folder / "unet" / "config.json").read_text())
    unet.update(addition_embed_type="text_time", addition_time_embed_dim=8, cross_attention_dim=64,
                projection_class_embeddings_input_dim=80)
    (folder / "unet" / "config.json").write_text(json.dumps(unet))
    parts = {}
    if second_encoder:
        shutil.copytree(folder / "text_encoder", folder / "text_encoder_2")
        shutil.copytree(folder / "tokenizer", folder / "tokenizer_2")
        config = json.loads((folder / "text_encoder_2" / "config.json").read_text())
        config["architectures"] = ["CLIPTextModelWithProjection"]
        (folder / "text_encoder_2" / "config.json").write_text(json.dumps(config))
        parts = {"text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                 "tokenizer_2": ["transformers", "CLIPTokenizer"]}
    if index:
        (folder / "model_index.json").write_text(json.dumps({
            "_class_name": "StableDiffusionXLPipeline", "_diffusers_version": "0.30.0",
            "force_zeros_for_empty_prompt": True, "scheduler": ["diffusers", "EulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"], **parts}))
    return folder


def train_refusal(folder) -> str:
    from ldm.config.args import DataArguments, ModelArguments, SamplingArguments
    from ldm.models.build import ModelSourceError
    from ldm.train.objective import TextToImage

    with pytest.raises(ModelSourceError) as e:
        TextToImage(ModelArguments(model_name_or_path=str(folder), allow_untrained_vae=True,
                                   allow_untrained_text_encoder=True), DataArguments(resolution=32),
                    SamplingArguments(), recompute=False, seed=0)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_stable_diffusion_xl_pipeline_is_refused_by_its_class_by_training_generate_and_export(tmp_path, capsys):
    from ldm.export import main as export
    from ldm.generate import main as generate

    folder = sdxl_folder(tmp_path)
    named = "a StableDiffusionXLPipeline folder, which this framework does not train, sample or export"
    assert named in train_refusal(folder)
    assert named in said(capsys, generate, ["--model", str(folder), "--prompt", "a", "--output_dir",
                                            str(tmp_path / "samples")])
    for layout in ("diffusers", "ppdiffusers"):
        assert named in said(capsys, export, ["--checkpoint", str(folder), "--output", str(tmp_path / layout),
                                              "--format", layout])
    assert not (tmp_path / "samples").exists() and not (tmp_path / "diffusers").exists()


def test_an_sdxl_folder_without_its_model_index_is_refused_by_its_parts(tmp_path):
    """A second text encoder on disk is never left out silently; without one, SDXL's UNet conditions are named."""
    assert "its text_encoder_2, tokenizer_2 are parts this framework does not read" in train_refusal(
        sdxl_folder(tmp_path / "a", index=False))
    line = train_refusal(sdxl_folder(tmp_path / "b", index=False, second_encoder=False))
    assert "addition_embed_type 'text_time' (Stable Diffusion XL's pooled text and image sizes)" in line
    assert "cross_attention_dim" not in line and "wide" not in line
