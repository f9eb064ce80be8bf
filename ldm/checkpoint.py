"""What a training checkpoint holds: writing and reading its parts (inference loading: `ldm.inference`).

A checkpoint folder (`<output_dir>/checkpoint-<step>/`, see `ldm.run_folder`) holds:
  unet/, bert/          the trained weights (ppdiffusers / PaddleNLP `save_pretrained` layout), once
  tokenizer/            the tokenizer, so the folder is self-describing
  scheduler/            the DDPM noise scheduler config (with prediction_type)
  ldm_model.json        where the frozen autoencoder is (relative to this folder) and its identity
  ema.pdparams          EMA weights and update counter (with --use_ema)
  training_state.pkl    step, data position, per-rank weight checksums (the loop's also RNG, LR, scaler)
  optimizer.pdopt       the optimizer (the Trainer path adds PaddleNLP's scheduler, RNG and state files)
  manifest.json         every file's size and sha256, written last
An autoencoder run's checkpoints (`ldm.train.autoencoder`) hold `vqvae/` and the training files.
The frozen autoencoder is written once per run to `<output_dir>/vqvae/` rather than into every
checkpoint (330 MB for KL-f8, times `save_total_limit`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle

import paddle
from ppdiffusers import AutoencoderKL, UNet2DConditionModel
from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertModel

from ldm.distributed import weights_checksum
from ldm.models.autoencoder import autoencoder_identity
from ldm.run_folder import CheckpointError

MODEL_JSON = "ldm_model.json"
EMA_FILE = "ema.pdparams"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MODEL_JSON))


def save_model(folder: str, *, unet, text_encoder, tokenizer, noise_scheduler, vae_folder: str, vae_identity: dict,
               ema_state: dict | None = None, final_folder: str | None = None) -> None:
    """Write the model parts of a checkpoint into `folder` (created; existing files replaced).

    `final_folder` is where the checkpoint will live when `folder` is a temporary one: the path to
    the autoencoder is written relative to it.
    """
    os.makedirs(folder, exist_ok=True)
    unet.save_pretrained(os.path.join(folder, "unet"))
    text_encoder.save_pretrained(os.path.join(folder, "bert"))
    tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
    noise_scheduler.save_pretrained(os.path.join(folder, "scheduler"))
    vae = os.path.relpath(os.path.abspath(vae_folder), os.path.abspath(final_folder or folder))
    with open(os.path.join(folder, MODEL_JSON), "w") as f:
        json.dump({"vae": vae, "vae_identity": vae_identity}, f, indent=2)
    if ema_state is not None:
        paddle.save(ema_state, os.path.join(folder, EMA_FILE))


# -- training checkpoints ------------------------------------------------------------------------
STATE_FILE = "training_state.pkl"
OPTIMIZER_FILE = "optimizer.pdopt"


def checkpoint_autoencoder(path: str):
    """The frozen autoencoder a checkpoint was trained with, refused if it is not the recorded one."""
    with open(os.path.join(path, MODEL_JSON)) as f:
        recorded = json.load(f)
    vae_path = os.path.normpath(os.path.join(path, recorded["vae"]))
    if not os.path.isfile(os.path.join(vae_path, "config.json")):
        raise CheckpointError(f"{path} was trained with the autoencoder in {vae_path}, which is gone")
    vae = AutoencoderKL.from_pretrained(vae_path)
    check_autoencoder(path, recorded.get("vae_identity"), autoencoder_identity(vae), vae_path)
    return vae


def check_autoencoder(checkpoint: str, recorded: dict | None, identity: dict, source: str) -> None:
    if recorded is None:  # written before checkpoints recorded it
        logging.getLogger("ldm.train").warning(
            "%s does not record which autoencoder it was trained with: make sure %s is that one", checkpoint, source)
        return
    if recorded != identity:
        changed = " and ".join(k.split("_")[0] for k in ("config_sha256", "weights_sha256")
                               if recorded.get(k) != identity.get(k))
        raise CheckpointError(f"{checkpoint} was trained with another autoencoder than {source} (its {changed} "
                              "differ): the UNet learned that autoencoder's latents")


def recorded_autoencoder(path: str) -> dict | None:
    with open(os.path.join(path, MODEL_JSON)) as f:
        return json.load(f).get("vae_identity")


def training_state(step: int, dist, batches, trained, **extra) -> dict:
    """The training-state dict of a checkpoint (both entry points): step, world size, every rank's data
    position and a fingerprint of every rank's trained weights (ranks that drifted apart show here)."""
    return {
        "step": step,
        "world_size": dist.world_size,
        "stream": dist.gather(batches.tracker.state_dict()),
        "weights_checksum": dist.gather(weights_checksum(trained)),
        **extra,
    }


def write_training_state(folder: str, state: dict) -> None:
    with open(os.path.join(folder, STATE_FILE), "wb") as f:
        pickle.dump(state, f)


def read_training_state(folder: str) -> dict:
    with open(os.path.join(folder, STATE_FILE), "rb") as f:
        return pickle.load(f)


def save_optimizer(folder: str, optimizer) -> None:
    paddle.save(optimizer.state_dict(), os.path.join(folder, OPTIMIZER_FILE))


def load_optimizer(folder: str, optimizer) -> None:
    optimizer.set_state_dict(paddle.load(os.path.join(folder, OPTIMIZER_FILE)))


def load_ema(path: str, ema) -> None:
    ema_path = os.path.join(path, EMA_FILE)
    if not os.path.isfile(ema_path):
        raise CheckpointError(f"{path} has no EMA state but --use_ema is on")
    ema.load_state_dict(paddle.load(ema_path))


def load_ldm_weights(path: str, model) -> None:
    """UNet and LDMBert weights of a checkpoint into the training wrapper's parts."""
    model.unet.set_state_dict(UNet2DConditionModel.from_pretrained(os.path.join(path, "unet")).state_dict())
    model.text_encoder.set_state_dict(LDMBertModel.from_pretrained(os.path.join(path, "bert")).state_dict())
