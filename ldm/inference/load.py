"""Loading a training checkpoint or a pipeline folder (ppdiffusers' or diffusers') for sampling, export and
evaluation (with the EMA weights when the checkpoint has them)."""

from __future__ import annotations

import json
import os
import tempfile

import paddle
from paddlenlp.transformers import BertTokenizer
from ppdiffusers import AutoencoderKL, UNet2DConditionModel

from ldm.checkpoint.format import (
    EMA,
    MODEL_JSON,
    checkpoint_autoencoder,
    is_checkpoint,
    read_model_record,
    recorded_text_encoder_folder,
    refuse_pickles,
)
from ldm.checkpoint.run_folder import CheckpointError
from ldm.checkpoint.serialization import has_state, state_arrays
from ldm.models.build import read_config, vae_folder
from ldm.models.text import FAMILIES, LDMBERT, TextEncoderError, TextFamily, load_text_tokenizer, text_family
from ldm.models.torch_layout import TorchLayoutError, load_pretrained


def is_pipeline(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model_index.json"))


def load_pipeline_tokenizer(folder: str):
    """PaddleNLP's BertTokenizer of a pipeline's `tokenizer/`: from its vocab.txt, or, when transformers 5 wrote the
    folder (tokenizer.json alone, which PaddleNLP does not read), from that file's WordPiece vocabulary."""
    source = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(os.path.join(folder, "vocab.txt")) or not os.path.isfile(source):
        return BertTokenizer.from_pretrained(folder)
    with open(source, encoding="utf-8") as f:
        model = json.load(f).get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "WordPiece" or not isinstance(vocab, dict) or sorted(vocab.values()) != list(
            range(len(vocab))):
        raise CheckpointError(f"{source}: not a WordPiece (BERT) vocabulary, which LDMBert's pipeline uses")
    has_config = os.path.isfile(os.path.join(folder, "tokenizer_config.json"))
    config = read_config(folder, "tokenizer_config.json") if has_config else {}
    temp = tempfile.TemporaryDirectory(prefix="ldm-vocab-")
    vocab_file = os.path.join(temp.name, "vocab.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        f.writelines(f"{token}\n" for token in sorted(vocab, key=vocab.get))
    tokenizer = BertTokenizer(vocab_file, do_lower_case=config.get("do_lower_case", True),
                              model_max_length=config.get("model_max_length", 77))
    tokenizer.vocab_folder = temp  # its save_pretrained copies the file: the folder lives as long as it does
    return tokenizer


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
            return next(f for f in FAMILIES if f.name == identity["family"]), folder
    try:
        family = text_family(path)
    except TextEncoderError as e:
        raise CheckpointError(str(e)) from None
    return family, os.path.join(path, family.folder)


def load_tokenizer_of(family: TextFamily, folder: str):
    if family is LDMBERT:
        return load_pipeline_tokenizer(folder)
    try:
        return load_text_tokenizer(family, folder)
    except TextEncoderError as e:
        raise CheckpointError(str(e)) from None


def apply_ema(path: str, unet, text_encoder) -> bool:
    """Write the EMA weights of checkpoint `path` (named `unet.*` / `text_encoder.*` after the training wrapper) into
    the parts, read one at a time (the whole EMA as numpy beside the model would double an export's memory); whether
    it had any."""
    if not has_state(path, EMA):
        return False
    parameters = {f"shadow.{prefix}.{name}": parameter
                  for prefix, model in (("unet", unet), ("text_encoder", text_encoder))
                  for name, parameter in model.named_parameters()}
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


def _load_for_inference(path: str, use_ema: bool):
    if not (is_pipeline(path) or is_checkpoint(path)):
        raise FileNotFoundError(f"{path} is neither a training checkpoint ({MODEL_JSON}) nor a pipeline folder "
                                "(model_index.json)")
    refuse_pickles(path, "pipeline" if is_pipeline(path) else "checkpoint")
    unet = load_pretrained(UNet2DConditionModel, os.path.join(path, "unet"))
    family, text_folder = text_encoder_of(path)
    text_encoder = load_pretrained(family.model_class(), text_folder)
    tokenizer = load_tokenizer_of(family, os.path.join(path, "tokenizer"))
    scheduler_config = read_config(os.path.join(path, "scheduler"), "scheduler_config.json")
    vae = load_pretrained(AutoencoderKL, vae_folder(path)) if is_pipeline(path) else checkpoint_autoencoder(path)
    used_ema = use_ema and apply_ema(path, unet, text_encoder)
    for model in (unet, text_encoder, vae):
        model.eval()
    return unet, text_encoder, vae, tokenizer, scheduler_config, used_ema
