"""Checkpoint folders, and loading any checkpoint or pipeline folder for inference.

A checkpoint folder (`<output_dir>/checkpoint-<step>/`) holds:
  unet/, bert/          the trained weights (ppdiffusers / PaddleNLP `save_pretrained` layout)
  tokenizer/            the tokenizer, so the folder is self-describing
  scheduler/            the DDPM noise scheduler config (with prediction_type)
  ldm_model.json        where the frozen autoencoder is (relative paths are relative to this folder)
  ema.pdparams          EMA weights and update counter (with --use_ema)
  training_state.pkl, optimizer.pdopt   what a resume needs beyond the weights (training loops)
An autoencoder run's checkpoints (`ldm.train.autoencoder`) hold `vqvae/` and the same two files.
The frozen autoencoder is written once per run to `<output_dir>/vqvae/` rather than into every
checkpoint (330 MB for KL-f8, times `save_total_limit`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from contextlib import contextmanager

MODEL_JSON = "ldm_model.json"
EMA_FILE = "ema.pdparams"


def is_pipeline(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model_index.json"))


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MODEL_JSON))


def save_model(folder: str, *, unet, text_encoder, tokenizer, noise_scheduler, vae_folder: str,
               ema_state: dict | None = None, final_folder: str | None = None) -> None:
    """Write the model parts of a checkpoint into `folder` (created; existing files replaced).

    `final_folder` is where the checkpoint will live when `folder` is a temporary one: the path to
    the autoencoder is written relative to it.
    """
    import paddle

    os.makedirs(folder, exist_ok=True)
    unet.save_pretrained(os.path.join(folder, "unet"))
    text_encoder.save_pretrained(os.path.join(folder, "bert"))
    tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
    noise_scheduler.save_pretrained(os.path.join(folder, "scheduler"))
    vae = os.path.relpath(os.path.abspath(vae_folder), os.path.abspath(final_folder or folder))
    with open(os.path.join(folder, MODEL_JSON), "w") as f:
        json.dump({"vae": vae}, f, indent=2)
    if ema_state is not None:
        paddle.save(ema_state, os.path.join(folder, EMA_FILE))


@contextmanager
def atomic_folder(final: str):
    """Yields a temporary sibling folder to fill; on success it replaces `final`, on error it is removed."""
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final) + "-", dir=parent)
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(path, final)


def apply_ema(state: dict, unet, text_encoder) -> None:
    """Write EMA weights (named `unet.*` / `text_encoder.*` after the training wrapper) into the parts."""
    import paddle

    for prefix, model in (("unet", unet), ("text_encoder", text_encoder)):
        with paddle.no_grad():
            for name, parameter in model.named_parameters():
                key = f"shadow.{prefix}.{name}"
                if key in state:
                    parameter.set_value(paddle.to_tensor(state[key]).astype(parameter.dtype))


def load_for_inference(path: str, use_ema: bool = True):
    """(unet, text_encoder, vae, tokenizer, noise_scheduler_config, used_ema) from a checkpoint or pipeline folder."""
    import paddle
    from paddlenlp.transformers import BertTokenizer
    from ppdiffusers import AutoencoderKL, UNet2DConditionModel
    from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertModel

    from ldm.models.build import read_config

    if not (is_pipeline(path) or is_checkpoint(path)):
        raise FileNotFoundError(f"{path} is neither a training checkpoint ({MODEL_JSON}) nor a pipeline folder "
                                "(model_index.json)")
    unet = UNet2DConditionModel.from_pretrained(os.path.join(path, "unet"))
    text_encoder = LDMBertModel.from_pretrained(os.path.join(path, "bert"))
    tokenizer = BertTokenizer.from_pretrained(os.path.join(path, "tokenizer"))
    scheduler_config = read_config(os.path.join(path, "scheduler"), "scheduler_config.json")
    if is_pipeline(path):
        vae_path = os.path.join(path, "vqvae")
    else:
        with open(os.path.join(path, MODEL_JSON)) as f:
            vae_path = os.path.normpath(os.path.join(path, json.load(f)["vae"]))
    vae = AutoencoderKL.from_pretrained(vae_path)
    used_ema = False
    ema_path = os.path.join(path, EMA_FILE)
    if use_ema and os.path.isfile(ema_path):
        apply_ema(paddle.load(ema_path), unet, text_encoder)
        used_ema = True
    for model in (unet, text_encoder, vae):
        model.eval()
    return unet, text_encoder, vae, tokenizer, scheduler_config, used_ema


# -- training checkpoints ------------------------------------------------------------------------
CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "training_state.pkl"
OPTIMIZER_FILE = "optimizer.pdopt"


class CheckpointError(RuntimeError):
    pass


def is_training_checkpoint(path: str) -> bool:
    """A folder a run can resume from: the loop's (any model) or the Trainer path's (an LDM)."""
    return os.path.isfile(os.path.join(path, STATE_FILE)) or is_checkpoint(path)


def checkpoint_dirs(output_dir: str) -> list[str]:
    """checkpoint-<step> folders of `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step, path = name[len(CHECKPOINT_PREFIX):], os.path.join(output_dir, name)
        if name.startswith(CHECKPOINT_PREFIX) and step.isdigit() and is_training_checkpoint(path):
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def resolve_resume(output_dir: str, resume: str | None) -> str | None:
    if not resume:
        return None
    if resume == "latest":
        found = checkpoint_dirs(output_dir)
        if not found:
            raise CheckpointError(f"--resume_from_checkpoint latest: no checkpoint in {output_dir}")
        return found[-1]
    if not is_training_checkpoint(resume):
        raise CheckpointError(f"--resume_from_checkpoint {resume}: not a checkpoint folder")
    return resume


def prepare_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """Refuse to mix runs in one folder; returns the checkpoint to resume from, if any."""
    checkpoint = resolve_resume(output_dir, resume)
    if checkpoint is None and os.path.isdir(output_dir) and os.listdir(output_dir):
        if not overwrite:
            raise CheckpointError(
                f"output_dir {output_dir} is not empty (an earlier run?): pass --resume_from_checkpoint latest "
                "(or a checkpoint folder) to continue it, or --overwrite_output_dir to start afresh")
        for path in checkpoint_dirs(output_dir):
            shutil.rmtree(path, ignore_errors=True)  # every rank may get here
    os.makedirs(output_dir, exist_ok=True)
    return checkpoint


def rotate_checkpoints(output_dir: str, limit: int | None) -> None:
    if limit:
        for path in checkpoint_dirs(output_dir)[:-limit]:
            shutil.rmtree(path, ignore_errors=True)


def write_training_state(folder: str, state: dict) -> None:
    with open(os.path.join(folder, STATE_FILE), "wb") as f:
        pickle.dump(state, f)


def read_training_state(folder: str) -> dict:
    with open(os.path.join(folder, STATE_FILE), "rb") as f:
        return pickle.load(f)


def save_training_checkpoint(output_dir: str, step: int, *, save_model, optimizer, training_state: dict,
                             limit: int | None = None) -> str:
    """Write checkpoint-<step> atomically (temp folder, then rename) and rotate old ones. Rank 0 only.

    `save_model(folder, final_folder)` writes what is trained (its weights, EMA, configs) into `folder`.
    """
    import paddle

    final = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
    with atomic_folder(final) as folder:
        save_model(folder, final)
        paddle.save(optimizer.state_dict(), os.path.join(folder, OPTIMIZER_FILE))
        write_training_state(folder, training_state)
    rotate_checkpoints(output_dir, limit)
    return final


def load_training_checkpoint(path: str, *, load_model, optimizer=None) -> dict:
    """Restore the trained weights (`load_model(path)`) and the optimizer; returns the training state."""
    import paddle

    load_model(path)
    if optimizer is not None:
        optimizer.set_state_dict(paddle.load(os.path.join(path, OPTIMIZER_FILE)))
    return read_training_state(path)


def load_ema(path: str, ema) -> None:
    ema_path = os.path.join(path, EMA_FILE)
    if not os.path.isfile(ema_path):
        raise CheckpointError(f"{path} has no EMA state but --use_ema is on")
    import paddle

    ema.load_state_dict(paddle.load(ema_path))


def load_ldm_weights(path: str, model) -> None:
    """UNet and LDMBert weights of a checkpoint into the training wrapper's parts."""
    from ppdiffusers import UNet2DConditionModel
    from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertModel

    model.unet.set_state_dict(UNet2DConditionModel.from_pretrained(os.path.join(path, "unet")).state_dict())
    model.text_encoder.set_state_dict(LDMBertModel.from_pretrained(os.path.join(path, "bert")).state_dict())
