"""How a training run is set up, the same on both paths: logging, precision, tokenizer, model."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace

import paddle

from ldm.checkpoint.format import text_encoder_folder_of
from ldm.config.args import DataArguments, ModelArguments
from ldm.config.record import ConfigError
from ldm.data.tokenize import load_tokenizer
from ldm.models.attention import set_attention
from ldm.models.backbone import autoencoder_factor
from ldm.models.build import (
    ModelSourceError,
    build_components,
    check_autoencoder_source,
    check_autoencoder_trained,
    check_source_family,
    has_weights,
    read_config,
    resolve_source,
)
from ldm.models.diffusion import LatentDiffusion
from ldm.models.noise import FlowSettings, is_flow, scheduler_config
from ldm.models.text import (
    DEFAULT_CAPTION_LENGTH,
    TextEncoderError,
    TextFamily,
    caption_length,
    check_vocabulary,
    load_text_tokenizer,
    text_family,
    train_text_encoder,
)
from ldm.runtime.device import resolve_vae_dtype
from ldm.runtime.distributed import Distributed
from ldm.runtime.tracking import quiet_libraries

logger = logging.getLogger("ldm.train")


def setup_logging(dist: Distributed) -> None:
    logging.basicConfig(
        level=logging.INFO if dist.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {dist.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    quiet_libraries()


def sharding_layout(options, degree: int, dist: Distributed) -> tuple[int, int]:
    """(ranks one shard group spans, ZeRO stage) of `--sharding` (the loop's "stage1", or PaddleNLP's parsed
    ShardingOption list) and `--sharding_parallel_degree` (-1: every rank); (1, 0) when nothing is sharded. The one
    reader of both flags, on both paths: a degree without a stage, or one the ranks cannot be split into, is refused
    in one line before anything is written."""
    values = [str(getattr(o, "value", o)) for o in ([options] if isinstance(options, str) else options or [])]
    stages = [int(value[-1]) for value in values if value.startswith("stage")]
    if not stages:
        if degree > 1:  # (1 shards nothing either: PaddleNLP empties --sharding itself for it)
            raise ConfigError(f"--sharding_parallel_degree {degree} without --sharding: nothing would be sharded; "
                              "pass --sharding stage1 too, or leave the degree out")
        return 1, 0
    if dist.world_size == 1:
        if degree not in (-1, 1):
            raise ConfigError(f"--sharding_parallel_degree {degree} on one process: a shard group spans at most the "
                              "1 rank there is")
        logger.info("--sharding %s on one process: nothing to shard", " ".join(values))
        return 1, 0
    degree = dist.world_size if degree == -1 else degree
    if degree > dist.world_size or dist.world_size % degree:
        raise ConfigError(f"--sharding_parallel_degree {degree} does not divide the {dist.world_size} ranks")
    return degree, max(stages)


@dataclass(frozen=True)
class TextSource:
    """Where a run's text encoder and its tokenizer come from: LDMBert's tokenizer is `--tokenizer_name`; a pretrained
    (CLIP) encoder's is its model's `tokenizer/`, and its weights may come from elsewhere than the model source
    (`encoder`): a resumed run's own copy, or a new stage's pipeline when the source (an architecture preset) has
    none."""

    family: TextFamily
    trained: bool
    encoder: str | None = None
    tokenizer: str | None = None


def text_source(model_args: ModelArguments, resume=None) -> TextSource:
    try:
        source = resolve_source(model_args.model_name_or_path)
        check_source_family(source)  # a model its family refuses by its parts (SDXL's refiner), said first
        family = text_family(source)
    except TextEncoderError as e:
        raise ModelSourceError(f"{model_args.model_name_or_path}: {e}") from None
    trained = train_text_encoder(family, model_args.train_text_encoder)
    if trained and family.frozen_only:
        raise ModelSourceError(f"--train_text_encoder true: {family.frozen_only}; leave --train_text_encoder unset")
    tokenizer = family.tokenizer_folder  # None: --tokenizer_name (LDMBert's)
    own = resume.text_encoder_folder if resume is not None else None  # checked against its manifest: read once
    if resume is not None and (own or legacy_frozen(resume, family)):
        # the frozen copy the run wrote (a checkpoint from before frozen copies: the one it holds)
        return TextSource(family, trained, own or os.path.join(resume.path, family.folder),
                          tokenizer and os.path.join(resume.path, tokenizer))
    init = model_args.init_from_checkpoint
    if init and not trained and not has_weights(os.path.join(source, family.folder)):
        found = text_encoder_folder_of(init, family.folder)  # a pipeline's, or a checkpoint's (trained or frozen)
        if found is not None:
            logger.info("the frozen %s text encoder of %s (%s has no weights for it)", family.name, found,
                        model_args.model_name_or_path)
            return TextSource(family, trained, found, tokenizer and os.path.join(init, tokenizer))
    return TextSource(family, trained, None, tokenizer and os.path.join(source, tokenizer))


def legacy_frozen(resume, family: TextFamily) -> bool:
    """A checkpoint of a run that kept its text encoder frozen before frozen encoders were written apart: the encoder
    is in the checkpoint (`bert/`), and no identity is recorded."""
    groups = (resume.record or {}).get("arguments", {}) if isinstance(resume.record, dict) else {}
    frozen = any(isinstance(g, dict) and g.get("freeze_text_encoder") is True for g in groups.values())
    return (resume.text_encoder is None and frozen
            and os.path.isfile(os.path.join(resume.path, family.folder, "config.json")))


def build_tokenizer(data: DataArguments, text: TextSource | None = None):
    """The captions' tokenizer: `--tokenizer_name` for LDMBert, the model's own for a pretrained encoder."""
    if text is None or text.family.tokenizer_folder is None:
        return load_tokenizer(data.tokenizer_name, data.model_max_length or DEFAULT_CAPTION_LENGTH)
    try:
        return load_text_tokenizer(text.family, text.tokenizer, data.model_max_length, own_copy=True)
    except TextEncoderError as e:
        raise ModelSourceError(f"{e}: pass a Stable Diffusion folder as --model_name_or_path (or as "
                               "--init_from_checkpoint with an architecture preset)") from None


def with_caption_length(data: DataArguments, text: TextSource, tokenizer, model_name_or_path: str) -> DataArguments:
    """The data arguments with the caption length resolved (`ldm.models.text.caption_length`, as `encode
    --text_embeddings` resolves it): --model_max_length, else the model's (LDMBert's 77), set on the tokenizer too,
    which carries it to the saved tokenizer and the export."""
    if text.family.tokenizer_folder is None:  # an encoder that follows its tokenizer
        length = data.model_max_length or DEFAULT_CAPTION_LENGTH
    else:
        folder = text.encoder or os.path.join(resolve_source(model_name_or_path), text.family.folder)
        try:
            positions = read_config(folder).get("max_position_embeddings")
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"{folder}: cannot read its config.json ({e})") from None
        try:
            length = caption_length(data.model_max_length, tokenizer, positions)
        except TextEncoderError as e:
            raise ModelSourceError(f"{model_name_or_path}: {e}") from None
    tokenizer.model_max_length = length
    return replace(data, model_max_length=length)


def build_model(model_args: ModelArguments, data: DataArguments, tokenizer, *, recompute: bool, seed: int,
                vae_name_or_path: str | None = None, text: TextSource | None = None):
    """The LatentDiffusion wrapper and its components, identical on every rank for a seed.

    Built under a fresh unique-name scope, so parameter names (and with them optimizer state keys)
    do not depend on what the process built before.
    """
    check_autoencoder_source(model_args.model_name_or_path, vae_name_or_path or model_args.vae_name_or_path,
                             model_args.allow_untrained_vae)
    with paddle.utils.unique_name.guard():
        components = build_components(
            model_args.model_name_or_path,
            vae_name_or_path=vae_name_or_path or model_args.vae_name_or_path,
            vocab_size=tokenizer.vocab_size,
            model_max_length=data.model_max_length,
            pad_token_id=tokenizer.pad_token_id,
            prediction_type=model_args.prediction_type,
            flow_shift=model_args.flow_shift,
            seed=seed,
            text_encoder_from=text.encoder if text else None,
            resolution=data.resolution,
        )
        trained = text.trained if text else train_text_encoder(components.family, model_args.train_text_encoder)
        set_attention(components.unet, model_args.attention)
        flow = is_flow(scheduler_config(components.noise_scheduler))
        if flow and model_args.snr_gamma:
            raise ModelSourceError(f"{model_args.model_name_or_path} trains with flow matching (a flow scheduler): "
                                   "--snr_gamma weights epsilon and v-prediction losses; use --flow_weighting")
        if not flow and (flow_settings(model_args) != FlowSettings() or model_args.flow_shift is not None):
            raise ModelSourceError(f"the --flow_* flags are for flow matching, and {model_args.model_name_or_path} "
                                   f"trains {components.noise_scheduler.config.prediction_type}: pass "
                                   "--prediction_type flow_matching, or leave them out")
        model = LatentDiffusion(
            components.unet, components.text_encoder, components.vae, components.noise_scheduler,
            noise_offset=model_args.noise_offset, snr_gamma=model_args.snr_gamma,
            freeze_text_encoder=not trained, recompute=recompute,
            vae_dtype=resolve_vae_dtype(model_args.vae_dtype), flow=flow_settings(model_args),
        )
    # a UNet samples by default at the size it is trained at (an exported pipeline, evaluation)
    components.model_family.follow_resolution(components.unet,
                                              data.resolution // autoencoder_factor(components.vae.config))
    logger.info("model from %s; %s", components.source, components.describe())
    check_autoencoder_trained(components.pretrained["vae"], components.vae_source, model_args.allow_untrained_vae)
    check_text_encoder_trained(components, trained, model_args.allow_untrained_text_encoder)
    try:
        check_vocabulary(tokenizer, text.tokenizer if text and text.tokenizer else data.tokenizer_name,
                         components.text_encoder, components.text_source)
    except TextEncoderError as e:
        raise ModelSourceError(str(e)) from None
    positions = getattr(components.text_encoder.config, "max_position_embeddings", None)
    if positions is not None and data.model_max_length and data.model_max_length > positions:
        raise ModelSourceError(f"--model_max_length {data.model_max_length}: the {components.family.name} text encoder "
                               f"of {components.text_source} reads at most {positions} tokens")
    return model, components


def flow_settings(model_args: ModelArguments) -> FlowSettings:
    return FlowSettings(model_args.flow_sigma_sampling, model_args.flow_logit_mean, model_args.flow_logit_std,
                        model_args.flow_mode_scale, model_args.flow_weighting)


def check_text_encoder_trained(components, trained: bool, allowed: bool) -> None:
    """Refuse a frozen text encoder with no trained weights: the UNet would learn from random states."""
    if trained or components.pretrained["text_encoder"]:
        return
    if not allowed:
        where = ("a Stable Diffusion folder as --model_name_or_path or --init_from_checkpoint" if
                 components.family.tokenizer_folder else "a pretrained LDM as --model_name_or_path, or a checkpoint "
                 "or pipeline as --init_from_checkpoint")
        raise ModelSourceError(
            f"the {components.family.name} text encoder from {components.text_source} has no trained weights and would "
            f"stay frozen: the UNet would learn from random states. Pass a model whose text encoder is pretrained "
            f"({where}), or --train_text_encoder true; --allow_untrained_text_encoder trains on it anyway (tests)")
    logger.warning("--allow_untrained_text_encoder: the frozen text encoder from %s has NO TRAINED WEIGHTS; what this "
                   "run learns is useful for tests only", components.text_source)
