"""The export's host memory (issue 58: an export doubled it; issue 66: its load held the model 2.5 times): the
pipeline's weights written from the live tensors one at a time, the same bytes ppdiffusers' `save_pretrained` writes,
the EMA applied and each part loaded one tensor at a time. The model card, and what diffusers made of each export
(tests/fixtures/model_cards.json)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from host_memory import MIB, peak_added
from interop_models import MAX_LENGTH, WORDS

from ldm.checkpoint.serialization import save_state
from ldm.data.tokenize import load_tokenizer, write_vocab
from ldm.inference.export import export_pipeline, write_pipeline
from ldm.inference.load import apply_ema, load_tokenizer_of
from ldm.inference.sampling import ddim_scheduler
from ldm.models.build import build_components


def tiny_parts(folder, preset: str):
    """A preset's parts and tokenizer (ldm-tiny: a 12-word vocabulary written into `folder`)."""
    if preset == "sd-tiny":
        c = build_components(preset)
        return c, load_tokenizer_of(c.family, os.path.join(c.source, "tokenizer"))
    write_vocab(WORDS, str(folder / "vocab"))
    tokenizer = load_tokenizer(str(folder / "vocab"), MAX_LENGTH)
    return build_components(preset, vocab_size=tokenizer.vocab_size, model_max_length=MAX_LENGTH), tokenizer


def files_of(folder) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


@pytest.mark.parametrize("preset", ["ldm-tiny", "sd-tiny"])
def test_the_streamed_pipeline_is_what_ppdiffusers_writes_byte_for_byte(tmp_path, preset):
    from ppdiffusers import LDMTextToImagePipeline, StableDiffusionPipeline

    c, tokenizer = tiny_parts(tmp_path, preset)
    scheduler = ddim_scheduler(dict(c.noise_scheduler.config))
    if preset == "ldm-tiny":
        pipeline = LDMTextToImagePipeline(vqvae=c.vae, bert=c.text_encoder, tokenizer=tokenizer, unet=c.unet,
                                          scheduler=scheduler)
    else:
        pipeline = StableDiffusionPipeline(vae=c.vae, text_encoder=c.text_encoder, tokenizer=tokenizer, unet=c.unet,
                                           scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                           requires_safety_checker=False)
    pipeline.save_pretrained(str(tmp_path / "theirs"))
    write_pipeline(pipeline, str(tmp_path / "ours"))
    theirs, ours = files_of(tmp_path / "theirs"), files_of(tmp_path / "ours")
    assert sorted(ours) == sorted(theirs)
    assert [name for name in theirs if ours[name] != theirs[name]] == []


def wide_unet(width: int):
    """ldm-tiny's UNet with `width` channels (128: 47.5 MiB of weights, the largest 4.5 MiB)."""
    from ppdiffusers import UNet2DConditionModel

    with open(os.path.join(ROOT, "ldm", "models", "presets", "ldm-tiny", "unet", "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    config["block_out_channels"] = [width, 2 * width]
    return UNet2DConditionModel(**config)


def test_an_export_writes_the_weights_one_tensor_at_a_time(tmp_path):
    """ppdiffusers' own save held a numpy copy of the whole UNet and a bytes object of it at its peak."""
    c, tokenizer = tiny_parts(tmp_path, "ldm-tiny")
    unet = wide_unet(128)
    total = sum(int(t.numel()) * t.element_size() for t in unet.state_dict().values())
    _, added = peak_added(export_pipeline, unet, c.text_encoder, c.vae, tokenizer, dict(c.noise_scheduler.config),
                          str(tmp_path / "pipeline"))
    assert added < 4 * 4.5 * MIB < total / 2, f"{added / MIB:.0f} MiB at the peak for {total / MIB:.0f} MiB"
    from ppdiffusers import LDMTextToImagePipeline

    loaded = LDMTextToImagePipeline.from_pretrained(str(tmp_path / "pipeline"))
    for name, tensor in unet.state_dict().items():
        np.testing.assert_array_equal(loaded.unet.state_dict()[name].numpy(), tensor.numpy())


def test_the_ema_is_applied_one_tensor_at_a_time(tmp_path):
    """Reading the whole EMA beside the model (and mapping its file) held the trained weights twice more."""
    c, _ = tiny_parts(tmp_path, "ldm-tiny")
    unet = wide_unet(128)
    rng = np.random.default_rng(0)
    shadow = {f"shadow.unet.{name}": rng.standard_normal(tuple(p.shape)).astype("float32")
              for name, p in unet.named_parameters()}
    save_state(str(tmp_path), "ema", {"num_updates": 3, "max_decay": 0.9999, **shadow})
    total = sum(array.nbytes for array in shadow.values())
    used, added = peak_added(apply_ema, str(tmp_path), unet, c.text_encoder)
    assert used
    assert added < 4 * 4.5 * MIB < total / 2, f"{added / MIB:.0f} MiB at the peak for {total / MIB:.0f} MiB"
    for name, parameter in unet.named_parameters():
        np.testing.assert_array_equal(parameter.numpy(), shadow[f"shadow.unet.{name}"])
    assert not apply_ema(str(tmp_path / "none"), unet, c.text_encoder)  # no EMA: the weights as they are


@pytest.mark.parametrize("preset", ["ldm-tiny", "sd-tiny", "pixart-tiny", "sdxl-tiny"])
def test_the_model_cards_loading_section_is_written_for_the_pipeline_class_exported(tmp_path, preset):
    """How diffusers and ppdiffusers load the folder, and what each does with the caption length, for its class: an
    LDM's LDMBert needs 77 tokens and ldm-laion; a Stable Diffusion pipeline pads to its tokenizer's length and
    ppdiffusers reads ldm-laion's export; PixArt's takes `max_sequence_length` and loads in ppdiffusers directly;
    SDXL's pads both prompts to its tokenizers' length and conditions on the requested size."""
    from ldm.inference.model_card import model_card
    from ldm.models.noise import scheduler_config
    from ldm.models.text import prompt_length

    if preset in ("pixart-tiny", "sdxl-tiny"):
        c, tokenizer = build_components(preset), None
    else:
        c, tokenizer = tiny_parts(tmp_path, preset)
    tokens = 120 if tokenizer is None else prompt_length(c.text_encoder, tokenizer)
    card = model_card(c.source, c.unet, c.text_encoder, c.vae, scheduler_config(c.noise_scheduler), False,
                      tokens=tokens)
    loading = card.split("## Loading")[1]
    pipeline = {"ldm-tiny": "LDMTextToImagePipeline", "sd-tiny": "StableDiffusionPipeline",
                "pixart-tiny": "PixArtAlphaPipeline", "sdxl-tiny": "StableDiffusionXLPipeline"}[preset]
    assert f'{pipeline}.from_pretrained("THIS_FOLDER")' in loading
    assert ("LDMBert" in loading) == (preset == "ldm-tiny")
    assert ("gives the text encoder 77 tokens" in loading) == (preset == "ldm-tiny")
    if preset == "sd-tiny":
        assert f"`model_max_length` ({tokens} tokens)" in loading and "StableDiffusionPipeline.from_pretrained` loads" \
            in loading
    if preset == "sdxl-tiny":
        assert "`model_max_length` (120 tokens)" in loading and "crop (0, 0)" in loading
        assert 'StableDiffusionXLPipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)' in loading
    if preset == "pixart-tiny":
        assert "max_sequence_length=120, use_resolution_binning=False, clean_caption=False" in loading
        assert 'PixArtAlphaPipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)' in loading
        assert "PIXART.prepare_library()" in loading  # plain ppdiffusers 0.29 cannot build the transformer


MODEL_CARDS = os.path.join(ROOT, "tests", "fixtures", "model_cards.json")
with open(MODEL_CARDS) as f:
    CARD_RUNS = json.load(f)  # {"with sentencepiece" | "without sentencepiece": {"versions", "results"}}
COMBINATIONS = sorted(next(iter(CARD_RUNS.values()))["results"])


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_an_export_for_diffusers_runs_its_cards_snippet_there_or_is_refused_in_one_line(tmp_path, capsys,
                                                                                          combination):
    """What tests/reference/run_model_cards.py saw, for each family and objective: the model card's diffusers
    snippet ran in diffusers 0.42 with and without sentencepiece (its T5 tokenizers read from the tokenizer.json
    exported beside spiece.model, these very bytes), or the export refuses it in the line it refused with there (a
    flow-matching model for a pipeline that cannot step its sampler, which failed at the first call before)."""
    from interop_models import tiny_objective_pipeline

    from ldm.export import main

    preset, objective = combination.split()
    source = tiny_objective_pipeline(str(tmp_path), preset, objective)
    capsys.readouterr()
    code = main(["--checkpoint", source, "--output", str(tmp_path / "diffusers"), "--format", "diffusers"])
    error = capsys.readouterr().err.strip()
    seen = [run["results"][combination] for run in CARD_RUNS.values()]
    assert len(seen) == 2  # one run in each virtualenv
    if seen[0]["export"] == "refused":
        assert code == 2 and all(run == seen[0] for run in seen), (error, seen)
        assert error.splitlines()[-1] == seen[0]["reason"]
        assert not (tmp_path / "diffusers").exists()
        return
    assert code == 0, error
    assert all(run["snippet"] == "ran" for run in seen), seen
    written = {os.path.relpath(os.path.join(root, "tokenizer.json"), tmp_path / "diffusers"):
               hashlib.sha256(Path(root, "tokenizer.json").read_bytes()).hexdigest()
               for root, _, names in os.walk(tmp_path / "diffusers") if "tokenizer.json" in names}
    assert all(run["tokenizer_json_sha256"] == written for run in seen), (written, seen)
    # T5's: spiece.model alone did not load without sentencepiece (CLIP's tokenizers need no tokenizer.json)
    assert written or preset in ("ldm-tiny", "sd-tiny", "sdxl-tiny")


def test_a_part_is_loaded_beside_one_tensor_not_a_second_model(tmp_path):
    """ppdiffusers' and PaddleNLP's `from_pretrained` built the part with fresh weights, then read its file whole
    beside it: 2.9 times the 47.5 MiB UNet at the peak. Built without initialising its weights and filled one tensor
    at a time, the load holds the model and at most a few of its largest tensors (4.5 MiB)."""
    from ppdiffusers import UNet2DConditionModel

    from ldm.inference.export import write_weights
    from ldm.models.torch_layout import load_pretrained

    unet = wide_unet(128)
    write_weights(unet, str(tmp_path / "unet"))
    total = sum(int(t.numel()) * t.element_size() for t in unet.state_dict().values())
    loaded, added = peak_added(load_pretrained, UNet2DConditionModel, str(tmp_path / "unet"))
    assert added < total + 4 * 4.5 * MIB, f"{added / MIB:.0f} MiB at the peak for {total / MIB:.0f} MiB"
    assert not loaded.training
    for name, tensor in unet.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), tensor.numpy())
