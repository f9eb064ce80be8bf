"""The model in and out of the PyTorch ecosystem, checked against the PyTorch tools' own outputs
(tests/reference/make_interop_fixtures.py computed them with diffusers, transformers and the original
latent-diffusion code; nothing here imports torch):
- the project's pipeline exported with `--format diffusers` is what diffusers loads and runs;
- pipelines diffusers saved (safetensors, and `.bin` read without running code) load and run as in diffusers;
- a CompVis txt2img checkpoint converts to a pipeline that runs as the original modules did.
Each comparison: the largest difference relative to the largest reference value, below RELATIVE."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import paddle
import pytest
from conftest import ROOT
from interop_models import MAX_LENGTH, PROMPT, plant_code, tiny_pipeline

from ldm.checkpoint.run_folder import CheckpointError
from ldm.inference.compvis import CompVisError, split_checkpoint
from ldm.inference.load import load_for_inference
from ldm.models.pickled import read_pickled_weights
from ldm.models.torch_layout import TORCH_FORMAT, safetensors_format

FIXTURES = ROOT / "tests" / "fixtures" / "interop"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
RELATIVE = 1e-4


def relative(ours, reference) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert ours.shape == reference.shape
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def compare(unet, text_encoder, vae, tokenizer, expected) -> dict[str, float]:
    """Our parts' outputs on the reference's inputs, each part given the reference's inputs (so a difference
    is that part's): {output: relative difference}."""
    ids = tokenizer([PROMPT, ""], padding="max_length", max_length=expected["input_ids"].shape[1])["input_ids"]
    np.testing.assert_array_equal(ids, expected["input_ids"])  # the tokenizer reads the same vocabulary
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
    """The seeded tiny pipeline (ppdiffusers' layout) and its export to diffusers' layout, by the command."""
    from ldm.export import main

    folder = tmp_path_factory.mktemp("interop")
    source = tiny_pipeline(str(folder))
    # the reference outputs were computed part by part for a text encoder of MAX_LENGTH positions, which diffusers'
    # pipeline (77 tokens always) cannot run whole: the export's refusal of such a model is tested below
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ldm.inference.export.DIFFUSERS_PROMPT_TOKENS", MAX_LENGTH)
        assert main(["--checkpoint", source, "--output", str(folder / "diffusers"), "--format", "diffusers"]) == 0
    return source, folder / "diffusers"


def test_a_model_of_fewer_than_77_tokens_is_refused_for_diffusers_in_one_line(exported, tmp_path, capsys):
    from ldm.export import main

    source, _ = exported
    assert main(["--checkpoint", source, "--output", str(tmp_path / "diffusers"), "--format", "diffusers"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"reads {MAX_LENGTH} tokens" in error and "always gives it 77" in error
    assert "--model_max_length 77" in error
    assert os.listdir(tmp_path) == []  # nothing left behind
    assert main(["--checkpoint", source, "--output", str(tmp_path / "paddle")]) == 0  # its own layout still works


def test_the_export_to_diffusers_runs_in_diffusers_as_in_paddle(exported):
    source, folder = exported
    import hashlib

    for name, digest in REFERENCE["exported"]["weights_sha256"].items():  # the weights diffusers ran
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
        assert safetensors_format(str(folder / name)) == TORCH_FORMAT
    index = json.loads((folder / "model_index.json").read_text())
    assert index["bert"] == ["latent_diffusion", "LDMBertModel"] and index["unet"][0] == "diffusers"
    assert index["tokenizer"] == ["transformers", "BertTokenizer"]
    assert REFERENCE["exported"]["bert_class"].startswith("diffusers.")
    card = (folder / "README.md").read_text()
    assert "LDMTextToImagePipeline.from_pretrained" in card and "## Training" in card
    unet, text_encoder, vae, tokenizer, _, _ = load_for_inference(source)  # the Paddle pipeline itself
    differences = compare(unet, text_encoder, vae, tokenizer, np.load(FIXTURES / "exported.npz"))
    assert max(differences.values()) < RELATIVE, differences


def test_the_exported_folder_reads_back_exactly(exported):
    source, folder = exported
    ours, back = load_for_inference(source), load_for_inference(str(folder))
    for a, b in zip(ours[:3], back[:3], strict=True):
        for name, value in a.state_dict().items():
            np.testing.assert_array_equal(b.state_dict()[name].numpy(), value.numpy(), err_msg=name)
    schedule = ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "prediction_type")
    assert [ours[4][k] for k in schedule] == [back[4][k] for k in schedule]


@pytest.mark.parametrize("name", ["diffusers-safetensors", "diffusers-bin"])
def test_a_pipeline_diffusers_saved_runs_here_as_in_diffusers(name):
    unet, text_encoder, vae, tokenizer, _, used_ema = load_for_inference(str(FIXTURES / name))
    assert not used_ema
    differences = compare(unet, text_encoder, vae, tokenizer, np.load(FIXTURES / "diffusers.npz"))
    assert max(differences.values()) < RELATIVE, differences
    assert "torch" not in sys.modules


def test_a_bin_that_carries_code_is_refused_before_it_runs(tmp_path):
    folder = tmp_path / "pipeline"
    shutil.copytree(FIXTURES / "diffusers-bin", folder)
    marker = tmp_path / "PWNED"
    plant_code(folder / "bert" / "pytorch_model.bin", "model.embed_tokens.weight", marker)
    with pytest.raises(CheckpointError, match="a pickle can run code"):
        load_for_inference(str(folder))
    assert not marker.exists()


def test_a_diffusers_folder_is_a_model_source_and_an_autoencoder_source(exported):
    """--model_name_or_path and --vae_name_or_path accept diffusers' layout: every part loaded, as exported."""
    from ldm.models.build import build_components

    source, folder = exported
    c = build_components(str(folder), vae_name_or_path=str(FIXTURES / "diffusers-bin"))
    assert c.pretrained == {"unet": True, "text_encoder": True, "vae": True}
    unet, text_encoder, *_ = load_for_inference(source)
    np.testing.assert_array_equal(c.unet.conv_in.weight.numpy(), unet.conv_in.weight.numpy())
    np.testing.assert_array_equal(c.text_encoder.model.layers[0].fc1.weight.numpy(),
                                  text_encoder.model.layers[0].fc1.weight.numpy())
    assert c.vae.config.block_out_channels == [8, 16]


def test_a_compvis_checkpoint_runs_here_as_in_the_original_code(tmp_path, capsys):
    from ldm.export import main

    compvis = FIXTURES / "compvis"
    output = tmp_path / "pipeline"
    assert main(["--from_compvis", str(compvis / "model.ckpt"), "--config", str(compvis / "txt2img-tiny.yaml"),
                 "--tokenizer", str(compvis / "vocab"), "--output", str(output)]) == 0
    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(str(output))
    assert tokenizer.model_max_length == MAX_LENGTH
    assert (scheduler_config["beta_schedule"], scheduler_config["beta_end"]) == ("scaled_linear", 0.012)
    assert vae.config.scaling_factor == 0.18215
    differences = compare(unet, text_encoder, vae, tokenizer, np.load(FIXTURES / "compvis.npz"))
    assert max(differences.values()) < RELATIVE, differences

    from ldm.data.tokenize import write_vocab

    capsys.readouterr()
    write_vocab(["another", "vocabulary"], str(tmp_path / "other"))
    assert main(["--from_compvis", str(compvis / "model.ckpt"), "--config", str(compvis / "txt2img-tiny.yaml"),
                 "--tokenizer", str(tmp_path / "other"), "--output", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "not its vocabulary" in err and not (tmp_path / "bad").exists()


def test_compvis_keys_without_a_place_are_an_error_naming_them():
    state, _ = read_pickled_weights(str(FIXTURES / "compvis" / "model.ckpt"))
    parts, used_ema = split_checkpoint(state, layers=1, levels=2, use_ema=True)
    assert not used_ema and set(parts) == {"unet", "vqvae", "bert"}
    extra = {**state, "model.diffusion_model.label_emb.weight": np.zeros(2, np.float32),
             "first_stage_model.loss.logvar": np.zeros(1, np.float32)}
    with pytest.raises(CompVisError, match="2 key.*label_emb.weight, first_stage_model.loss.logvar"):
        split_checkpoint(extra, layers=1, levels=2, use_ema=True)
    # a weight the model needs that the checkpoint lacks
    from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel

    from ldm.inference.compvis import bert_config, read_compvis_config
    from ldm.models.torch_layout import TorchLayoutError, set_torch_state

    config = read_compvis_config(str(FIXTURES / "compvis" / "txt2img-tiny.yaml"))
    bert = LDMBertModel(LDMBertConfig(**bert_config(config["model"]["params"]["cond_stage_config"]["params"])))
    del parts["bert"]["model.layer_norm.weight"]
    with pytest.raises(TorchLayoutError, match="missing: model.layer_norm.weight"):
        set_torch_state(bert, parts["bert"], "model.ckpt", "txt2img-tiny.yaml")


def test_a_new_stage_starts_from_a_diffusers_folder(exported):
    """--init_from_checkpoint: the exported diffusers folder's weights, as the Paddle pipeline holds them."""
    from ldm.checkpoint.format import load_initial_weights
    from ldm.models.autoencoder import autoencoder_identity
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion

    source, folder = exported
    c = build_components(source)  # the same architecture and autoencoder, these weights replaced below
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler)
    for parameter in model.unet.parameters():
        parameter.set_value(paddle.zeros_like(parameter))
    parts = {"unet": model.unet, "bert": model.text_encoder}
    lineage = load_initial_weights(str(folder), parts, model, None, autoencoder_identity(c.vae))
    assert lineage["kind"] == "pipeline"
    unet, *_ = load_for_inference(source)
    for name, value in unet.state_dict().items():
        np.testing.assert_array_equal(model.unet.state_dict()[name].numpy(), value.numpy(), err_msg=name)


def test_diffusers_older_attention_names_are_read(tmp_path):
    """Autoencoders saved before diffusers renamed its attention (query, key, value, proj_attn), as on the hub."""
    from ppdiffusers import AutoencoderKL
    from safetensors.numpy import load_file, save_file

    from ldm.models.torch_layout import load_pretrained

    source = FIXTURES / "diffusers-safetensors" / "vqvae"
    shutil.copytree(source, tmp_path / "vqvae")
    weights = tmp_path / "vqvae" / "diffusion_pytorch_model.safetensors"
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    state = {}
    for name, value in load_file(str(weights)).items():
        for new, before in old.items():
            name = name.replace(f".attentions.0.{new}.", f".attentions.0.{before}.")
        state[name] = value
    assert any(".query." in name for name in state)
    save_file(state, str(weights), metadata={"format": TORCH_FORMAT})
    renamed, current = load_pretrained(AutoencoderKL, str(tmp_path / "vqvae")), load_pretrained(AutoencoderKL,
                                                                                                 str(source))
    for name, value in current.state_dict().items():
        np.testing.assert_array_equal(renamed.state_dict()[name].numpy(), value.numpy(), err_msg=name)


def test_the_model_card_tells_what_the_run_recorded(exported, tmp_path):
    """Training files, updates and samples seen, lineage and the last FID and CLIP score, from the run's records."""
    from ldm.inference.model_card import model_card

    source, _ = exported
    run = tmp_path / "run"
    checkpoint = run / "checkpoint-40"
    shutil.copytree(source, checkpoint)
    lineage = {"init_from": "/runs/stage1/checkpoint-9000", "kind": "checkpoint", "step": 9000}
    record = {"arguments": {"DataArguments": {"file_list": "laion.filelist.list", "resolution": 256},
                            "ModelArguments": {"model_name_or_path": "ldm-32layer"}},
              "created": "2026-11-27T10:00:00+0000", "git": {"commit": "abc123", "dirty": False}, "lineage": lineage}
    (run / "run.json").write_text(json.dumps(record))
    (checkpoint / "run_config.json").write_text(json.dumps(record))
    (checkpoint / "training_state.json").write_text(json.dumps({"samples": {"updates": 40, "samples": 2560}}))
    (run / "metrics.jsonl").write_text('{"step": 20, "eval/fid": 80.5}\n{"step": 40, "eval/fid": 61.25, '
                                       '"eval/clip_score": 21.5}\n{"step": 41, "train/lo')  # a line cut short
    unet, text_encoder, vae, _, scheduler_config, _ = load_for_inference(str(checkpoint))
    card = model_card(str(checkpoint), unet, text_encoder, vae, scheduler_config, used_ema=True)
    for expected in ("laion.filelist.list", "updates: 40; samples seen: 2560", "/runs/stage1/checkpoint-9000",
                     "fid 61.25 (held-out evaluation at update 40)", "clip_score 21.5", "git commit abc123",
                     "the EMA average", "LDMBert text encoder: 0.02 M parameters, 2 layers of width 32"):
        assert expected in card, expected


def test_a_compvis_ema_replaces_the_unet_weights_unless_refused():
    """LitEma keeps its copies under model_ema., named after the wrapper's parameters without their dots."""
    state, _ = read_pickled_weights(str(FIXTURES / "compvis" / "model.ckpt"))
    unet = {k: v for k, v in state.items() if k.startswith("model.diffusion_model.")}
    ema = {"model_ema." + k[len("model."):].replace(".", ""): v + 1 for k, v in unet.items()}
    ema.update({"model_ema.decay": np.float32(0.9999), "model_ema.num_updates": np.int32(7)})
    averaged, used = split_checkpoint({**state, **ema}, layers=1, levels=2, use_ema=True)
    raw, unused = split_checkpoint({**state, **ema}, layers=1, levels=2, use_ema=False)
    assert used and not unused
    name = "model.diffusion_model.input_blocks.0.0.weight"
    np.testing.assert_array_equal(averaged["unet"]["conv_in.weight"], state[name] + 1)
    np.testing.assert_array_equal(raw["unet"]["conv_in.weight"], state[name])
    del ema["model_ema.diffusion_modelinput_blocks00weight"]
    with pytest.raises(CompVisError, match="EMA has no copy of model.diffusion_model.input_blocks.0.0.weight"):
        split_checkpoint({**state, **ema}, layers=1, levels=2, use_ema=True)


def test_generate_samples_from_a_diffusers_folder(tmp_path):
    from ldm.generate import main

    main(["--model", str(FIXTURES / "diffusers-bin"), "--prompt", PROMPT, "--num_inference_steps", "2",
          "--output_dir", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["000-00-a-red-circle-on-a-blue-background.png", "grid.png"]


def test_generate_warns_of_a_prompt_it_cuts_and_wraps_its_label_in_the_grid(tmp_path, capsys):
    """A 560-word prompt (the fixture's model reads 16 tokens): one warning naming what is left out, and a grid whose
    label column stays `LABEL_WIDTH` wide (it was as wide as the prompt written out: 22,268 px)."""
    from PIL import Image

    from ldm.generate import main
    from ldm.inference.sampling import LABEL_WIDTH

    long = " ".join(["a red circle on a blue background"] * 80)
    main(["--model", str(FIXTURES / "diffusers-bin"), "--prompt", long, "--prompt", PROMPT,
          "--num_inference_steps", "1", "--output_dir", str(tmp_path)])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "longer than the 16 tokens" in warnings[0], warnings
    assert f"its last {80 * 7 - 14} tokens are left out" in warnings[0]  # 560 words, 14 kept between [CLS] and [SEP]
    grid = Image.open(tmp_path / "grid.png")
    assert grid.width <= LABEL_WIDTH + 24 + 128 and grid.height == 2 * 128


def test_an_export_never_replaces_a_folder_that_is_not_a_pipeline_nor_what_it_reads(tmp_path, monkeypatch):
    """`--output` is replaced whole: a run folder given by mistake, or the folder being exported, stays as it is;
    an earlier export is replaced."""
    from ldm.export import main

    source = tmp_path / "run" / "pipeline"
    shutil.copytree(FIXTURES / "diffusers-safetensors", source)
    (tmp_path / "run" / "notes.txt").write_text("weeks of work")
    for output in (tmp_path / "run", source):
        assert main(["--checkpoint", str(source), "--output", str(output)]) == 2
    assert (tmp_path / "run" / "notes.txt").read_text() == "weeks of work"
    assert (source / "model_index.json").is_file()
    assert main(["--checkpoint", str(source), "--output", str(tmp_path / "again")]) == 0
    monkeypatch.setattr("ldm.inference.export.DIFFUSERS_PROMPT_TOKENS", MAX_LENGTH)  # the fixture's 16 tokens
    assert main(["--checkpoint", str(source), "--output", str(tmp_path / "again"), "--format", "diffusers"]) == 0
    assert (tmp_path / "again" / "README.md").is_file()


def test_a_pipeline_with_a_part_missing_its_weights_is_one_line(tmp_path):
    folder = tmp_path / "half"
    shutil.copytree(FIXTURES / "diffusers-safetensors", folder)
    (folder / "bert" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="bert holds no weights .only config.json."):
        load_for_inference(str(folder))


def split_in_shards(part_folder, stem: str, variant: str = "") -> None:
    """`stem.safetensors` of a part split in two shards with an index, as diffusers' `save_pretrained(...,
    max_shard_size=...)` writes them (with `variant`, its `variant=` naming: `stem.safetensors.index.fp16.json`)."""
    from safetensors.numpy import load_file, save_file

    infix = f".{variant}" if variant else ""
    whole = part_folder / f"{stem}{infix}.safetensors"
    state = load_file(str(whole))
    whole.unlink()
    names = sorted(state)
    weight_map = {}
    for number, half in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        file = f"{stem}-{number:05d}-of-00002{infix}.safetensors"
        save_file({n: state[n] for n in half}, str(part_folder / file), metadata={"format": TORCH_FORMAT})
        weight_map.update({n: file for n in half})
    total = sum(v.nbytes for v in state.values())
    (part_folder / f"{stem}.safetensors.index{infix}.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def test_diffusers_folders_in_shards_and_in_variants_load_as_the_whole_one(tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    from ldm.models.torch_layout import VARIANT_VARIABLE
    from ldm.runtime.errors import UserError

    source = FIXTURES / "diffusers-safetensors"
    expected = load_for_inference(str(source))
    sharded = tmp_path / "sharded"
    shutil.copytree(source, sharded)
    split_in_shards(sharded / "unet", "diffusion_pytorch_model")
    split_in_shards(sharded / "bert", "model")
    got = load_for_inference(str(sharded))
    for ours, theirs in zip(got[:3], expected[:3], strict=True):
        for name, value in theirs.state_dict().items():
            np.testing.assert_array_equal(ours.state_dict()[name].numpy(), value.numpy(), err_msg=name)

    variant = tmp_path / "variant"  # fp16 weights only, as `save_pretrained(variant="fp16")` writes them
    shutil.copytree(source, variant)
    for part, stem in (("unet", "diffusion_pytorch_model"), ("vqvae", "diffusion_pytorch_model"), ("bert", "model")):
        whole = variant / part / f"{stem}.safetensors"
        save_file({n: v.astype(np.float16) for n, v in load_file(str(whole)).items()},
                  str(variant / part / f"{stem}.fp16.safetensors"), metadata={"format": TORCH_FORMAT})
        whole.unlink()
    split_in_shards(variant / "unet", "diffusion_pytorch_model", "fp16")  # and in shards too
    unet = load_for_inference(str(variant))[0]
    reference = expected[0].conv_in.weight.numpy()
    np.testing.assert_allclose(unet.conv_in.weight.numpy(), reference, rtol=1e-3, atol=1e-4)

    # two variants and no plain weights: one line saying how to choose; the choice is read
    shutil.copy(variant / "vqvae" / "diffusion_pytorch_model.fp16.safetensors",
                variant / "vqvae" / "diffusion_pytorch_model.ema.safetensors")
    with pytest.raises(UserError, match=f"holds the weight variants ema, fp16 .*{VARIANT_VARIABLE}=ema"):
        load_for_inference(str(variant))
    monkeypatch.setenv(VARIANT_VARIABLE, "fp16")
    assert load_for_inference(str(variant))[2].config.block_out_channels == [8, 16]
    monkeypatch.setenv(VARIANT_VARIABLE, "bf16")
    with pytest.raises(UserError, match="holds no such variant"):
        load_for_inference(str(variant))


def test_a_part_folder_that_is_a_symlink_loop_is_one_line(tmp_path):
    from ldm.runtime.errors import UserError

    folder = tmp_path / "pipeline"
    shutil.copytree(FIXTURES / "diffusers-safetensors", folder)
    shutil.rmtree(folder / "unet")
    (folder / "unet").symlink_to(folder / "unet")
    with pytest.raises(UserError, match=r"unet: cannot be read as a model folder \(Too many levels"):
        load_for_inference(str(folder))
