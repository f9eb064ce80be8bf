"""Loading a training checkpoint or a pipeline folder (ppdiffusers' or diffusers') for sampling, export and
evaluation (with the EMA weights when the checkpoint has them)."""

from __future__ import annotations

import os

import paddle
from ppdiffusers import AutoencoderKL

from ldm.checkpoint.format import (
    EMA,
    MODEL_JSON,
    checkpoint_autoencoder,
    is_checkpoint,
    read_model_record,
    recorded_text_encoder_folder,
    refuse_pickles,
    text_identity_difference,
)
from ldm.checkpoint.run_folder import CheckpointError
from ldm.checkpoint.serialization import has_state, state_arrays
from ldm.models.build import check_model_index, read_config, unsupported_folder, vae_folder
from ldm.models.families import folder_family
from ldm.models.text import (
    TextEncoderError,
    TextFamily,
    check_vocabulary,
    load_text_tokenizer,
    named,
    text_encoder_identity,
    text_family,
)
from ldm.models.torch_layout import TorchLayoutError, load_pretrained


def is_pipeline(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model_index.json"))


def text_encoder_of(path: str) -> tuple[TextFamily, str]:
    """(family, folder) of the text encoder of a pipeline or a checkpoint: its own `bert/` or `text_encoder/`, or the
    frozen one its run wrote (recorded in the checkpoint's ldm_model.json)."""
    if is_checkpoint(path):
        identity = read_model_record(path).get("text_encoder_identity")
        if identity is not None:
            folder = recorded_text_encoder_folder(path)
            if folder is None:
                raise CheckpointError(f"{path} was trained with the frozen text encoder its run wrote beside it "
                                      "(text_encoder/), which is gone: copy the whole run folder")
            return named(identity["family"]), folder
    try:
        family = text_family(path)
    except TextEncoderError as e:
        raise CheckpointError(str(e)) from None
    return family, os.path.join(path, family.folder)


def load_tokenizer_of(family: TextFamily, folder: str):
    """The tokenizer a pipeline or a checkpoint saved for its text encoder of `family`."""
    try:
        return load_text_tokenizer(family, folder)
    except TextEncoderError as e:
        raise CheckpointError(str(e)) from None


def averaged_parameters(unet, text_encoder) -> dict:
    """The parts' parameters by the keys an EMA's state names them (`shadow.unet.*`, `shadow.text_encoder.*`: the
    training wrapper's names)."""
    return {f"shadow.{prefix}.{name}": parameter for prefix, model in (("unet", unet), ("text_encoder", text_encoder))
            for name, parameter in model.named_parameters()}


def apply_ema(path: str, unet, text_encoder) -> bool:
    """Write the EMA weights of checkpoint `path` (named `unet.*` / `text_encoder.*` after the training wrapper) into
    the parts, read one at a time (the whole EMA as numpy beside the model would double an export's memory); whether
    it had any."""
    if not has_state(path, EMA):
        return False
    parameters = averaged_parameters(unet, text_encoder)
    with paddle.no_grad():
        for key, array in state_arrays(path, EMA, parameters.__contains__):
            parameter = parameters[key]
            parameter.set_value(paddle.to_tensor(array).astype(parameter.dtype))
    return True


def load_for_inference(path: str, use_ema: bool = True):
    """(unet, text_encoder, vae, tokenizer, noise_scheduler_config, used_ema) from a checkpoint or pipeline folder.
    A checkpoint that disappears while being read (a live run's rotation) is said to have, in one line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint or pipeline folder")
    try:
        return _load_for_inference(path, use_ema)
    except TorchLayoutError as e:
        raise CheckpointError(str(e)) from None
    except OSError:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} disappeared while being read (a live run's rotation removes old "
                                    "checkpoints: read one it keeps, or copy it first)") from None
        raise


def check_scheduler(path: str) -> None:
    """A folder without its noise schedule cannot be sampled as it was trained: said before the weights load."""
    if not os.path.isfile(os.path.join(path, "scheduler", "scheduler_config.json")):
        raise CheckpointError(f"{path} has no scheduler/scheduler_config.json, the noise schedule its UNet was trained "
                              "with: copy the scheduler/ folder of the pipeline or checkpoint it was made from into it")


def check_recorded_text_encoder(path: str, family: TextFamily, text_encoder, folder: str) -> None:
    """The frozen text encoder read for checkpoint `path` is the one its model record names (digests of its config
    and weights): a copy modified with a new manifest, or one without a manifest, is not used silently."""
    recorded = read_model_record(path).get("text_encoder_identity") if is_checkpoint(path) else None
    if not recorded:
        return
    found = text_encoder_identity(text_encoder, family, recorded.get("max_length", 0))
    if found != recorded:
        raise CheckpointError(f"{folder} is not the frozen text encoder {path} was trained with "
                              f"({text_identity_difference(recorded, found)}): restore the run's text_encoder/ from "
                              "a copy")


def trained_length(path: str, tokenizer) -> None:
    """The caption length a checkpoint's frozen text encoder was trained with (its model record) set on its
    tokenizer, which carries it to sampling, evaluation and the export (`ldm.models.text.prompt_length`)."""
    recorded = read_model_record(path).get("text_encoder_identity") if is_checkpoint(path) else None
    if recorded and recorded.get("max_length"):
        tokenizer.model_max_length = int(recorded["max_length"])


def _load_for_inference(path: str, use_ema: bool):
    if not (is_pipeline(path) or is_checkpoint(path)):
        raise FileNotFoundError(f"{path} is neither a training checkpoint ({MODEL_JSON}) nor a pipeline folder "
                                "(model_index.json)")
    refuse_pickles(path, "pipeline" if is_pipeline(path) else "checkpoint")
    if is_pipeline(path):
        check_model_index(path)
    check_scheduler(path)
    backbone = folder_family(path)
    if backbone is None:
        raise CheckpointError(f"{path} has no unet/ nor transformer/: not a text-to-image model")
    if why := unsupported_folder(os.path.join(path, backbone.backbone_folder)):
        raise CheckpointError(f"{path}: {why}")
    unet = load_pretrained(backbone.model_class(), os.path.join(path, backbone.backbone_folder))
    family, text_folder = text_encoder_of(path)
    text_encoder = load_pretrained(family.model_class(text_folder), text_folder)
    check_recorded_text_encoder(path, family, text_encoder, text_folder)
    tokenizer_folder = os.path.join(path, "tokenizer")
    tokenizer = load_tokenizer_of(family, tokenizer_folder)
    trained_length(path, tokenizer)
    try:
        check_vocabulary(tokenizer, tokenizer_folder, text_encoder, text_folder)
    except TextEncoderError as e:
        raise CheckpointError(str(e)) from None
    scheduler_config = read_config(os.path.join(path, "scheduler"), "scheduler_config.json")
    vae = load_pretrained(AutoencoderKL, vae_folder(path)) if is_pipeline(path) else checkpoint_autoencoder(path)
    used_ema = use_ema and apply_ema(path, unet, text_encoder)
    for model in (unet, text_encoder, vae):
        model.eval()
    return unet, text_encoder, vae, tokenizer, scheduler_config, used_ema
