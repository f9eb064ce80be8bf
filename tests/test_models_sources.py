"""Model folders this framework does not train (`ldm.models.build`): Stable Diffusion XL's refiner, told by its
`model_index.json` or its parts on disk, and PixArt's 1024 px DiT, refused in one line by training, `ldm.generate` and
`ldm.export` alike, before any weight is read."""

import json
import shutil
from pathlib import Path

import pytest
from entry import said

from ldm.models.build import PRESETS_DIR

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DIFFUSERS_PIXART = FIXTURES / "pixart-diffusers" / "float32" / "pipeline"  # saved by diffusers 0.42 itself


def refiner_folder(tmp_path, index: bool = True):
    """sdxl-tiny's configs laid out as Stable Diffusion XL's refiner: OpenCLIP-bigG alone (`text_encoder_2/`), a UNet
    whose added embedding reads five time ids (an aesthetic score for the target size), and the refiner's
    model_index.json (`StableDiffusionXLImg2ImgPipeline`, `requires_aesthetics_score`)."""
    folder = tmp_path / "refiner"
    shutil.copytree(PRESETS_DIR / "sdxl-tiny", folder)
    for part in ("text_encoder", "tokenizer"):
        shutil.rmtree(folder / part)
    unet = json.loads((folder / "unet" / "config.json").read_text())
    unet.update(cross_attention_dim=24, projection_class_embeddings_input_dim=16 + 5 * 8)
    (folder / "unet" / "config.json").write_text(json.dumps(unet))
    if index:
        (folder / "model_index.json").write_text(json.dumps({
            "_class_name": "StableDiffusionXLImg2ImgPipeline", "_diffusers_version": "0.19.0.dev0",
            "force_zeros_for_empty_prompt": False, "requires_aesthetics_score": True,
            "scheduler": ["diffusers", "EulerDiscreteScheduler"], "text_encoder": [None, None],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "tokenizer": [None, None],
            "tokenizer_2": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"]}))
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


def test_the_sdxl_refiner_is_refused_by_training_generate_and_export_before_any_weight(tmp_path, capsys):
    """By its pipeline (`requires_aesthetics_score`), and without a model index by its parts: bigG alone."""
    named = "a Stable Diffusion XL refiner (an aesthetic score among its time ids, OpenCLIP-bigG alone"
    assert all(named in line for line in every_refusal(refiner_folder(tmp_path), tmp_path, capsys))
    assert named in train_refusal(refiner_folder(tmp_path / "bare", index=False))


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
