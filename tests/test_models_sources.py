"""Model folders of pipeline classes this framework does not train (`ldm.models.build`): Stable Diffusion XL's, told by
its `model_index.json` class, its second text encoder on disk or its UNet's added conditions, refused in one line by
training, `ldm.generate` and `ldm.export` alike, before any weight is read."""

import json
import shutil
from pathlib import Path

import pytest
from entry import said

from ldm.models.build import PRESETS_DIR

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DIFFUSERS_PIXART = FIXTURES / "pixart-diffusers" / "float32" / "pipeline"  # saved by diffusers 0.42 itself


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


def every_refusal(folder, tmp_path, capsys) -> list[str]:
    """The lines training, `ldm.generate` and `ldm.export` (in either layout) refuse `folder` with; none writes."""
    from ldm.export import main as export
    from ldm.generate import main as generate

    lines = [train_refusal(folder), said(capsys, generate, ["--model", str(folder), "--prompt", "a", "--output_dir",
                                                            str(tmp_path / "samples")])]
    for layout in ("diffusers", "ppdiffusers"):
        lines.append(said(capsys, export, ["--checkpoint", str(folder), "--output", str(tmp_path / layout),
                                           "--format", layout]))
    assert not (tmp_path / "samples").exists() and not (tmp_path / "diffusers").exists()
    return lines


def test_a_stable_diffusion_xl_pipeline_is_refused_by_its_class_by_training_generate_and_export(tmp_path, capsys):
    named = "a StableDiffusionXLPipeline folder, which this framework does not train, sample or export"
    assert all(named in line for line in every_refusal(sdxl_folder(tmp_path), tmp_path, capsys))


def test_an_sdxl_folder_without_its_model_index_is_refused_by_its_parts(tmp_path):
    """A second text encoder on disk is never left out silently; without one, SDXL's UNet conditions are named."""
    assert "its text_encoder_2, tokenizer_2 are parts this framework does not read" in train_refusal(
        sdxl_folder(tmp_path / "a", index=False))
    line = train_refusal(sdxl_folder(tmp_path / "b", index=False, second_encoder=False))
    assert "addition_embed_type 'text_time' (Stable Diffusion XL's pooled text and image sizes)" in line
    assert "cross_attention_dim" not in line and "wide" not in line


def variant(tmp_path, source, name: str, **config):
    """A copy of model folder `source` whose transformer's config says `config`."""
    folder = shutil.copytree(source, tmp_path / name)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def test_a_multi_scale_pixart_config_is_read_and_one_adaln_single_cannot_split_is_refused(tmp_path):
    """PixArt-α's 1024 px transformer (sample_size 128, its conditions by default) and a multi-scale DiT at any size
    (`use_additional_conditions`) are read (`tests/test_models_pixart.py` trains and predicts them); one whose width
    adaLN-single cannot split in three for the resolution and aspect-ratio embeddings is one line, before any weight."""
    from ldm.models.families import PIXART

    config = json.loads((DIFFUSERS_PIXART / "transformer" / "config.json").read_text())
    tiny_1024 = {**config, "sample_size": 128, "num_attention_heads": 2, "attention_head_dim": 12}
    assert PIXART.unsupported(tiny_1024) is None
    assert PIXART.unsupported({**json.loads((PRESETS_DIR / "pixart-alpha-1024" / "transformer" / "config.json")
                                            .read_text())}) is None
    line = train_refusal(variant(tmp_path, DIFFUSERS_PIXART, "conditions-16", use_additional_conditions=True))
    assert ("takes resolution and aspect-ratio conditions at a width of 16, which adaLN-single cannot split in three"
            in line), line


def test_transformer_variants_ppdiffusers_builds_otherwise_are_named_before_any_weight_is_read(tmp_path):
    """What the config says and ppdiffusers' class would not build (it would read the weights as damaged, or build
    another model): SD3.5's MMDiT, PixArt without added conditions at 128 (PixArt-Σ's), another interpolation
    scale."""
    sd35 = variant(tmp_path, PRESETS_DIR / "sd3-tiny", "sd3.5", qk_norm="rms_norm", dual_attention_layers=[0, 1])
    assert ("its transformer is a Stable Diffusion 3.5 MMDiT (qk_norm 'rms_norm' and dual attention in layers 0-1), "
            "which ppdiffusers' SD3Transformer2DModel, the one this framework trains, does not have") in \
        train_refusal(sd35)
    for name, config, named in (
            ("none-128", {"use_additional_conditions": False, "sample_size": 128},
             "a PixArt DiT at sample_size 128 without resolution and aspect-ratio conditions"),
            ("scale-2", {"interpolation_scale": 2}, "position embedding has interpolation_scale 2")):
        line = train_refusal(variant(tmp_path, DIFFUSERS_PIXART, name, **config))
        assert named in line and "does not fit" not in line, line
