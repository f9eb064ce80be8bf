"""Loading a training checkpoint or an exported pipeline folder for sampling, export and evaluation
(with the EMA weights when the checkpoint has them)."""

from __future__ import annotations

import os

import paddle
from paddlenlp.transformers import BertTokenizer
from ppdiffusers import AutoencoderKL, UNet2DConditionModel
from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertModel

from ldm.checkpoint import EMA_FILE, MODEL_JSON, checkpoint_autoencoder, is_checkpoint
from ldm.compat import fast_conv_bias
from ldm.models.build import read_config


def is_pipeline(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model_index.json"))


def apply_ema(state: dict, unet, text_encoder) -> None:
    """Write EMA weights (named `unet.*` / `text_encoder.*` after the training wrapper) into the parts."""
    for prefix, model in (("unet", unet), ("text_encoder", text_encoder)):
        with paddle.no_grad():
            for name, parameter in model.named_parameters():
                key = f"shadow.{prefix}.{name}"
                if key in state:
                    parameter.set_value(paddle.to_tensor(state[key]).astype(parameter.dtype))


def load_for_inference(path: str, use_ema: bool = True):
    """(unet, text_encoder, vae, tokenizer, noise_scheduler_config, used_ema) from a checkpoint or pipeline folder."""
    if not (is_pipeline(path) or is_checkpoint(path)):
        raise FileNotFoundError(f"{path} is neither a training checkpoint ({MODEL_JSON}) nor a pipeline folder "
                                "(model_index.json)")
    fast_conv_bias()
    unet = UNet2DConditionModel.from_pretrained(os.path.join(path, "unet"))
    text_encoder = LDMBertModel.from_pretrained(os.path.join(path, "bert"))
    tokenizer = BertTokenizer.from_pretrained(os.path.join(path, "tokenizer"))
    scheduler_config = read_config(os.path.join(path, "scheduler"), "scheduler_config.json")
    if is_pipeline(path):
        vae = AutoencoderKL.from_pretrained(os.path.join(path, "vqvae"))
    else:
        vae = checkpoint_autoencoder(path)
    used_ema = False
    ema_path = os.path.join(path, EMA_FILE)
    if use_ema and os.path.isfile(ema_path):
        apply_ema(paddle.load(ema_path), unet, text_encoder)
        used_ema = True
    for model in (unet, text_encoder, vae):
        model.eval()
    return unet, text_encoder, vae, tokenizer, scheduler_config, used_ema
