"""Reference outputs for the interop tests, computed by diffusers, transformers and the original latent-diffusion
code themselves (tests/test_inference_interop.py compares the project's with them, without torch).

Runs in its own virtualenv, outside the project (the project needs no torch), with a checkout of CompVis'
latent-diffusion for its model code (its `ldm` package is not on PyPI; commit a506df5 was used):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 diffusers transformers safetensors numpy omegaconf einops pyyaml
    git clone https://github.com/CompVis/latent-diffusion /tmp/latent-diffusion
    /work/refvenv/bin/python tests/reference/make_interop_fixtures.py --latent_diffusion /tmp/latent-diffusion

Writes tests/fixtures/interop/:
  exported.npz          diffusers' outputs (LDMBert hidden states, the UNet's prediction, the decoded image) for the
                        project's seeded tiny pipeline (tests/interop_models.py, run in the project's venv) after
                        `python -m ldm.export --format diffusers`; reference.json has its weight files' sha256,
                        so the suite knows it exported the same weights
  diffusers-safetensors/, diffusers-bin/
                        a random tiny pipeline saved by diffusers' own `save_pretrained`, as safetensors and as
                        `.bin` pickles, and diffusers.npz: its outputs
  compvis/              a tiny `txt2img-1p4B`-layout checkpoint (model.ckpt, Lightning's layout, float16 weights to
                        keep it small) made by latent-diffusion's own UNetModel, Encoder/Decoder and the BERT
                        embedder's x-transformer, its YAML and vocabulary, and compvis.npz: the original modules'
                        outputs. The script also converts it with diffusers' public conversion functions
                        (`convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`, `convert_ldm_bert_checkpoint`),
                        and with the project's `--from_compvis ... --format diffusers`, and checks what diffusers
                        computes with each against the original's (reference.json: the differences)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "tests", "fixtures", "interop")
sys.path.insert(0, os.path.dirname(HERE))
from interop_models import MAX_LENGTH, PROMPT  # noqa: E402 - the shared constants only (it imports no ldm here)

PROMPTS = [PROMPT, ""]


def clean_configs(folder: str) -> None:
    """The folder it was saved from names nothing a reader needs."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            config.pop("_name_or_path", None)
            with open(path, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)


def fill_seeded(module: torch.nn.Module, seed: int, float16_values: bool = False) -> None:
    """interop_models.fill_seeded for torch modules: no zero-initialised layer, numpy's generator; with
    `float16_values`, each rounded to float16 (stored so, the outputs are those of the stored weights)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in sorted(module.named_parameters()):
            value = rng.normal(0, 0.1, tuple(parameter.shape))
            if parameter.ndim == 1 and name.endswith("weight"):
                value += 1
            parameter.copy_(torch.from_numpy(value.astype(np.float16 if float16_values else np.float32)).float())


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def pipeline_outputs(pipeline, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The parts' outputs on fixed inputs, as the pipeline would call them: hidden states of the prompt and of the
    empty prompt (padded to the tokenizer's length), the UNet's prediction on them at two timesteps, a decode."""
    tokens = pipeline.tokenizer(PROMPTS, padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                                return_tensors="pt")
    size = pipeline.unet.config.sample_size
    latents = rng.standard_normal((2, pipeline.unet.config.in_channels, size, size)).astype(np.float32)
    timesteps = np.array([10, 500], dtype=np.int64)
    decode_in = rng.standard_normal((1, pipeline.vqvae.config.latent_channels, size, size)).astype(np.float32)
    with torch.no_grad():
        hidden = pipeline.bert(tokens.input_ids)[0]
        prediction = pipeline.unet(torch.from_numpy(latents), torch.from_numpy(timesteps),
                                   encoder_hidden_states=hidden).sample
        image = pipeline.vqvae.decode(torch.from_numpy(decode_in)).sample
    return {"input_ids": tokens.input_ids.numpy(), "latents": latents, "timesteps": timesteps,
            "decode_latents": decode_in, "hidden_states": hidden.numpy(), "prediction": prediction.numpy(),
            "image": image.numpy()}


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- (a) the project's pipeline exported to diffusers ----------------------------------------------------------
EXPORTED_WEIGHTS = ("unet/diffusion_pytorch_model.safetensors", "vqvae/diffusion_pytorch_model.safetensors",
                    "bert/model.safetensors")


def exported(project_python: str, work: str) -> tuple[dict, str]:
    from diffusers import LDMTextToImagePipeline

    subprocess.run([project_python, os.path.join(ROOT, "tests", "interop_models.py"), work], check=True, cwd=ROOT)
    folder = os.path.join(work, "diffusers")
    subprocess.run([project_python, "-m", "ldm.export", "--checkpoint", os.path.join(work, "ppdiffusers"),
                    "--output", folder, "--format", "diffusers"], check=True, cwd=ROOT)
    pipeline = LDMTextToImagePipeline.from_pretrained(folder)  # offline: a local folder
    outputs = pipeline_outputs(pipeline, np.random.default_rng(1))
    np.savez_compressed(os.path.join(OUT, "exported.npz"), **outputs)
    return {"weights_sha256": {name: sha256(os.path.join(folder, name)) for name in EXPORTED_WEIGHTS},
            "bert_class": type(pipeline.bert).__module__ + "." + type(pipeline.bert).__name__,
            "tokenizer_class": type(pipeline.tokenizer).__name__}, os.path.join(work, "vocab", "vocab.txt")


# -- (b) a random pipeline saved by diffusers ------------------------------------------------------------------
def diffusers_pipeline(vocab: str):
    """A random tiny LDMTextToImagePipeline (8 and 16 channels: small fixtures), built and saved by diffusers."""
    from diffusers import AutoencoderKL, DDIMScheduler, LDMTextToImagePipeline, UNet2DConditionModel
    from diffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel
    from transformers import BertTokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                layers_per_block=1, norm_num_groups=4, attention_head_dim=2, cross_attention_dim=16,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        layers_per_block=1, norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, sample_size=16)
    tokenizer = BertTokenizer(vocab, model_max_length=MAX_LENGTH)
    bert = LDMBertModel(LDMBertConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH, d_model=16,
                                      encoder_layers=1, encoder_ffn_dim=32, encoder_attention_heads=2, head_dim=8))
    for seed, part in enumerate((unet, bert, vae)):
        fill_seeded(part, 10 + seed, float16_values=True)
        part.eval()  # LDMBertConfig's dropout is 0.1
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return LDMTextToImagePipeline(vqvae=vae, bert=bert, tokenizer=tokenizer, unet=unet, scheduler=scheduler)


def saved_by_diffusers(vocab: str) -> dict:
    from diffusers import LDMTextToImagePipeline

    pipeline = diffusers_pipeline(vocab)
    outputs = pipeline_outputs(pipeline, np.random.default_rng(2))
    folders = {}
    for name, safe in (("diffusers-safetensors", True), ("diffusers-bin", False)):
        folder = os.path.join(OUT, name)
        shutil.rmtree(folder, ignore_errors=True)
        pipeline.to(torch.float16)  # half the bytes; the weights are float16 values already
        pipeline.save_pretrained(folder, safe_serialization=safe)
        if not safe:  # transformers 5 writes safetensors whatever it is asked: bert/ as transformers 4 wrote it
            os.remove(os.path.join(folder, "bert", "model.safetensors"))
            torch.save(pipeline.bert.state_dict(), os.path.join(folder, "bert", "pytorch_model.bin"))
        pipeline.to(torch.float32)
        folders[name] = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    reloaded = pipeline_outputs(LDMTextToImagePipeline.from_pretrained(os.path.join(OUT, "diffusers-bin"),
                                                                       torch_dtype=torch.float32),
                                np.random.default_rng(2))
    differences = {k: relative(reloaded[k], outputs[k]) for k in ("hidden_states", "prediction", "image")}
    assert max(differences.values()) < 1e-6, differences  # the files hold what was computed
    np.savez_compressed(os.path.join(OUT, "diffusers.npz"), **outputs)
    return {"files": folders}


# -- (c) a CompVis txt2img checkpoint --------------------------------------------------------------------------
COMPVIS_CONFIG = {"model": {"base_learning_rate": 5.0e-05, "target": "ldm.models.diffusion.ddpm.LatentDiffusion",
                            "params": {
    "linear_start": 0.00085, "linear_end": 0.012, "num_timesteps_cond": 1, "log_every_t": 200, "timesteps": 1000,
    "first_stage_key": "image", "cond_stage_key": "caption", "image_size": 8, "channels": 4,
    "cond_stage_trainable": True, "conditioning_key": "crossattn", "monitor": "val/loss_simple_ema",
    "scale_factor": 0.18215, "use_ema": False,
    "unet_config": {"target": "ldm.modules.diffusionmodules.openaimodel.UNetModel", "params": {
        "image_size": 8, "in_channels": 4, "out_channels": 4, "model_channels": 32, "attention_resolutions": [1],
        "num_res_blocks": 1, "channel_mult": [1, 1], "num_heads": 2, "use_spatial_transformer": True,
        "transformer_depth": 1, "context_dim": 32, "use_checkpoint": False, "legacy": False}},
    "first_stage_config": {"target": "ldm.models.autoencoder.AutoencoderKL", "params": {
        "embed_dim": 4, "monitor": "val/rec_loss",
        "ddconfig": {"double_z": True, "z_channels": 4, "resolution": 16, "in_channels": 3, "out_ch": 3, "ch": 32,
                     "ch_mult": [1, 1], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0},
        "lossconfig": {"target": "torch.nn.Identity"}}},
    "cond_stage_config": {"target": "ldm.modules.encoders.modules.BERTEmbedder", "params": {
        "n_embed": 32, "n_layer": 1, "max_seq_len": MAX_LENGTH}}}}}


def compvis(latent_diffusion: str, vocab: str, project_python: str, work: str) -> dict:
    """The checkpoint made and run by latent-diffusion's own modules: txt2img-1p4B's classes at widths that keep
    the fixture small (the UNet has shortcut convolutions where its halves join; the autoencoder, of one width,
    has none: its rule for them is diffusers' nin_shortcut -> conv_shortcut, untested here)."""
    import yaml
    from transformers import BertTokenizer

    sys.path.insert(0, latent_diffusion)
    from ldm.modules.diffusionmodules.model import Decoder, Encoder
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    from ldm.modules.diffusionmodules.util import make_beta_schedule
    from ldm.modules.x_transformer import Encoder as XEncoder
    from ldm.modules.x_transformer import TransformerWrapper

    params = COMPVIS_CONFIG["model"]["params"]
    tokenizer = BertTokenizer(vocab, model_max_length=MAX_LENGTH)
    params["cond_stage_config"]["params"]["vocab_size"] = len(tokenizer)
    cond = params["cond_stage_config"]["params"]
    unet = UNetModel(**params["unet_config"]["params"]).eval()
    dd = params["first_stage_config"]["params"]["ddconfig"]
    embed = params["first_stage_config"]["params"]["embed_dim"]
    first_stage = torch.nn.Module()
    first_stage.encoder, first_stage.decoder = Encoder(**dd), Decoder(**dd)
    first_stage.quant_conv = torch.nn.Conv2d(2 * dd["z_channels"], 2 * embed, 1)
    first_stage.post_quant_conv = torch.nn.Conv2d(embed, dd["z_channels"], 1)
    first_stage.eval()
    bert = TransformerWrapper(num_tokens=cond["vocab_size"], max_seq_len=cond["max_seq_len"],
                              attn_layers=XEncoder(dim=cond["n_embed"], depth=cond["n_layer"])).eval()  # BERTEmbedder's
    for seed, part in enumerate((unet, first_stage, bert)):
        fill_seeded(part, 20 + seed, float16_values=True)
    state = {}
    for prefix, part in (("model.diffusion_model.", unet), ("first_stage_model.", first_stage),
                         ("cond_stage_model.transformer.", bert)):
        state.update({prefix + k: v.half() for k, v in part.state_dict().items()})
    betas = make_beta_schedule("linear", params["timesteps"], params["linear_start"], params["linear_end"])
    alphas_cumprod = np.cumprod(1.0 - betas)
    for name, value in (("betas", betas), ("alphas_cumprod", alphas_cumprod),
                        ("alphas_cumprod_prev", np.append(1.0, alphas_cumprod[:-1])),
                        ("sqrt_alphas_cumprod", np.sqrt(alphas_cumprod))):  # a few of LatentDiffusion's buffers
        state[name] = torch.tensor(value, dtype=torch.float32)
    folder = os.path.join(OUT, "compvis")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "vocab"))
    torch.save({"state_dict": state, "global_step": 0, "epoch": 0}, os.path.join(folder, "model.ckpt"))
    with open(os.path.join(folder, "txt2img-tiny.yaml"), "w") as f:
        yaml.safe_dump(COMPVIS_CONFIG, f, sort_keys=False)
    shutil.copy(vocab, os.path.join(folder, "vocab", "vocab.txt"))

    rng = np.random.default_rng(3)
    ids = tokenizer(PROMPTS, padding="max_length", max_length=MAX_LENGTH, return_tensors="pt").input_ids
    size = params["unet_config"]["params"]["image_size"]
    latents = rng.standard_normal((2, 4, size, size)).astype(np.float32)
    timesteps = np.array([10, 500], dtype=np.int64)
    decode_in = rng.standard_normal((1, embed, size, size)).astype(np.float32)
    with torch.no_grad():
        hidden = bert(ids, return_embeddings=True)
        prediction = unet(torch.from_numpy(latents), torch.from_numpy(timesteps), context=hidden)
        image = first_stage.decoder(first_stage.post_quant_conv(torch.from_numpy(decode_in)))
    outputs = {"input_ids": ids.numpy(), "latents": latents, "timesteps": timesteps, "decode_latents": decode_in,
               "hidden_states": hidden.numpy(), "prediction": prediction.numpy(), "image": image.numpy()}
    np.savez_compressed(os.path.join(OUT, "compvis.npz"), **outputs)
    return {"diffusers_conversion_vs_original": diffusers_conversion(state, bert, outputs),
            "project_conversion_run_by_diffusers_vs_original": project_conversion(project_python, work, outputs)}


def project_conversion(project_python: str, work: str, original: dict) -> dict[str, float]:
    """The project's converter (`--from_compvis ... --format diffusers`), its folder run by diffusers: its largest
    relative difference to the original modules' outputs (the suite compares the Paddle side)."""
    from diffusers import LDMTextToImagePipeline

    folder, output = os.path.join(OUT, "compvis"), os.path.join(work, "compvis-diffusers")
    subprocess.run([project_python, "-m", "ldm.export", "--from_compvis", os.path.join(folder, "model.ckpt"),
                    "--config", os.path.join(folder, "txt2img-tiny.yaml"), "--tokenizer",
                    os.path.join(folder, "vocab"), "--output", output, "--format", "diffusers"], check=True, cwd=ROOT)
    pipeline = LDMTextToImagePipeline.from_pretrained(output)
    with torch.no_grad():
        hidden = pipeline.bert(torch.from_numpy(original["input_ids"]))[0]
        prediction = pipeline.unet(torch.from_numpy(original["latents"]), torch.from_numpy(original["timesteps"]),
                                   encoder_hidden_states=torch.from_numpy(original["hidden_states"])).sample
        image = pipeline.vqvae.decode(torch.from_numpy(original["decode_latents"])).sample
    differences = {"hidden_states": relative(hidden, original["hidden_states"]),
                   "prediction": relative(prediction, original["prediction"]),
                   "image": relative(image, original["image"])}
    assert max(differences.values()) < 1e-5, differences
    return differences


def diffusers_conversion(state: dict, bert, original: dict) -> dict[str, float]:
    """diffusers' public conversion of the same checkpoint, run by diffusers: its largest relative difference to the
    original modules' outputs (a check of the reference, not of the project)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion import convert_from_ckpt as c
    from omegaconf import OmegaConf

    config = OmegaConf.create(COMPVIS_CONFIG)
    checkpoint = {k: v.float() for k, v in state.items()}
    unet_config = c.create_unet_diffusers_config(config, image_size=64)  # its sample size: image size / 8
    unet = UNet2DConditionModel(**unet_config).eval()
    unet.load_state_dict(c.convert_ldm_unet_checkpoint(checkpoint, unet_config))
    vae_config = c.create_vae_diffusers_config(config, image_size=16)
    vae = AutoencoderKL(**vae_config).eval()
    vae.load_state_dict(c.convert_ldm_vae_checkpoint(checkpoint, vae_config))
    bert_config = c.create_ldm_bert_config(config)
    bert_config.vocab_size = config.model.params.cond_stage_config.params.vocab_size
    bert_config.max_position_embeddings = MAX_LENGTH
    converted_bert = c.convert_ldm_bert_checkpoint(types.SimpleNamespace(transformer=bert), bert_config).eval()
    with torch.no_grad():
        hidden = converted_bert(torch.from_numpy(original["input_ids"]))[0]
        prediction = unet(torch.from_numpy(original["latents"]), torch.from_numpy(original["timesteps"]),
                          encoder_hidden_states=torch.from_numpy(original["hidden_states"])).sample
        image = vae.decode(torch.from_numpy(original["decode_latents"])).sample
    differences = {"hidden_states": relative(hidden, original["hidden_states"]),
                   "prediction": relative(prediction, original["prediction"]),
                   "image": relative(image, original["image"])}
    assert max(differences.values()) < 1e-5, differences
    return differences


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "diffusers", "transformers", "safetensors", "numpy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent_diffusion", required=True, help="a checkout of CompVis/latent-diffusion")
    parser.add_argument("--project_python", default=os.path.join(ROOT, ".venv", "bin", "python"),
                        help="the project's Python, which makes and exports its tiny pipeline")
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        reference = {"versions": versions()}
        reference["exported"], vocab = exported(args.project_python, work)
        reference["diffusers"] = saved_by_diffusers(vocab)
        reference["compvis"] = compvis(args.latent_diffusion, vocab, args.project_python, work)
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(json.dumps(reference["compvis"], indent=1))


if __name__ == "__main__":
    main()
