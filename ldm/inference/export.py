"""The export of a checkpoint or a pipeline to an `LDMTextToImagePipeline` folder: ppdiffusers' layout (`python -m
ldm.export`, and every training run at its end) or diffusers' (`--format diffusers`, for PyTorch users)."""

from __future__ import annotations

import copy
import glob
import json
import os

import paddle
from ppdiffusers import ModelMixin

from ldm.checkpoint.run_folder import CheckpointError, atomic_folder
from ldm.checkpoint.serialization import LiveTensor, write_safetensors, writes_failing_as_os_errors
from ldm.inference.load import is_pipeline, load_for_inference
from ldm.inference.model_card import model_card
from ldm.inference.sampling import sampling_scheduler
from ldm.models.families import PipelineError, family_of, text_to_image_pipeline
from ldm.models.noise import is_flow
from ldm.models.text import prompt_length, t5_tokenizer_json, text_parts
from ldm.models.torch_layout import save_torch_layout


def check_output(output: str, source: str | None = None) -> None:
    """An export replaces `output` whole: only an earlier export (or an empty folder) may be there, and never the
    folder it reads from or one holding it (a run folder given as --output would otherwise be deleted)."""
    if source is not None:
        inside = os.path.commonpath([os.path.abspath(output), os.path.abspath(source)]) == os.path.abspath(output)
        if inside:
            raise CheckpointError(f"--output {output} is (or holds) {source}, which the export reads: choose another "
                                  "--output")
    if os.path.isfile(output) or (os.path.isdir(output) and os.listdir(output) and not is_pipeline(output)):
        raise CheckpointError(f"--output {output} exists and is not a pipeline folder: it is not replaced; choose "
                              "another --output or remove it")


# diffusers' LDMTextToImagePipeline tokenizes every prompt (and the empty one) to 77 tokens, whatever the tokenizer
# or the text encoder say: a text encoder of fewer positions fails there ("index out of range in self")
DIFFUSERS_PROMPT_TOKENS = 77


def check_diffusers_context(text_encoder) -> None:
    """A model whose text encoder holds fewer than 77 positions is refused for diffusers' layout. Widening its
    position table would let the pipeline run, but on 77 tokens it never saw (LDMBert attends to its padding):
    other images than the model makes here."""
    positions = text_encoder.config.max_position_embeddings
    if positions < DIFFUSERS_PROMPT_TOKENS:
        raise CheckpointError(
            f"--format diffusers: this model's text encoder reads {positions} tokens, and diffusers' "
            f"LDMTextToImagePipeline always gives it {DIFFUSERS_PROMPT_TOKENS}: it would fail there. Train with "
            f"--model_max_length {DIFFUSERS_PROMPT_TOKENS} (the default) to export for diffusers; this model exports "
            "with --format ppdiffusers and samples with python -m ldm.generate")


def check_diffusers_sampler(unet, text_encoder, scheduler_config: dict) -> None:
    """A flow-matching model whose diffusers pipeline cannot step its sampler (`ModelFamily.diffusers_samples_flow`)
    is refused for diffusers' layout."""
    family = family_of(unet, text_encoder)
    if is_flow(scheduler_config) and not family.diffusers_samples_flow:
        raise CheckpointError(
            f"--format diffusers: diffusers' {family.pipeline_class} cannot sample this flow-matching model (it reads "
            "scheduler.init_noise_sigma, which FlowMatchEulerDiscreteScheduler has not, and fails at its first call): "
            "export it with --format ppdiffusers and sample it with python -m ldm.generate")


class NoPipeline(CheckpointError):
    """A model that no pipeline class samples as it was trained."""


def pipeline_of(unet, text_encoder, vae, tokenizer, scheduler):
    """The pipeline the model's family exports as (`ldm.models.families.text_to_image_pipeline`); a model that has
    none is refused in one line."""
    try:
        return text_to_image_pipeline(unet, text_encoder, vae, tokenizer, scheduler)
    except PipelineError as e:
        raise NoPipeline(str(e)) from None


# What `_diffusers_version` of a diffusers export says: the diffusers release its layout was checked against
# (docs/interop.md: tests/reference/make_*_fixtures.py loaded and ran it; the fixtures' reference.json records the
# version). ppdiffusers writes its own version there (0.29.0), which names no diffusers release of this layout, and
# diffusers reads the field to decide which shims an older layout needs.
DIFFUSERS_VERSION = "0.42.1"
# tokenizer_config.json keys that name files of the folder the tokenizer was read from (a checkpoint, which a run's
# rotation deletes): an exported pipeline must stand alone
SOURCE_PATH_KEYS = ("special_tokens_map_file", "name_or_path")


def export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config: dict, output: str,
                    to_diffusers: bool = False, card: str | None = None) -> str:
    """The pipeline folder of the model's families (`pipeline_of`): `LDMTextToImagePipeline`,
    `StableDiffusionPipeline` or `PixArtAlphaPipeline`."""
    check_output(output)
    pipeline = pipeline_of(unet, text_encoder, vae, tokenizer, sampling_scheduler(scheduler_config))
    if to_diffusers and family_of(unet, text_encoder).fixed_diffusers_prompt:
        check_diffusers_context(text_encoder)
    if to_diffusers:
        check_diffusers_sampler(unet, text_encoder, scheduler_config)
    with atomic_folder(output) as folder, writes_failing_as_os_errors(folder):
        if to_diffusers:
            # ppdiffusers converts the UNet and the autoencoder, and names diffusers' classes in model_index.json
            pipeline.save_pretrained(folder, to_diffusers=True)
            # but leaves the text encoder in Paddle's layout: rewritten in PyTorch's for transformers
            for part, _, encoder in text_parts(text_encoder):
                _write_torch_text_encoder(encoder, os.path.join(folder, part))
            _write_diffusers_version(folder)
        else:
            write_pipeline(pipeline, folder)
        for _, part, _ in text_parts(text_encoder):
            _write_standalone_tokenizer(os.path.join(folder, part), prompt_length(text_encoder, tokenizer))
            if to_diffusers:
                _write_fast_tokenizer(os.path.join(folder, part))
        if card is not None:
            with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
                f.write(card)
    return output


def write_pipeline(pipeline, folder: str) -> None:
    """What ppdiffusers' `save_pretrained` writes for the ppdiffusers layout, the same bytes, with each model's weights
    written from the live tensors one at a time (`write_weights`): its own copies every weight to numpy, then to one
    bytes object, holding two more copies of the largest model at its peak."""
    for name, entry in pipeline.config.items():
        component = getattr(pipeline, name, None) if not name.startswith("_") else None
        if component is None or not isinstance(entry, list | tuple):  # a left-out part (a safety checker)
            continue
        target = os.path.join(folder, name)
        if isinstance(component, paddle.nn.Layer):
            write_weights(component, target)
        else:  # the tokenizer, the scheduler: small files
            component.save_pretrained(target)
    pipeline.save_config(folder)  # model_index.json


def write_weights(model, folder: str) -> None:
    """A model's folder as its library's `save_pretrained(folder, safe_serialization=True)` writes it (one weights file:
    ppdiffusers and PaddleNLP split only past 10 GB, which loads as well unsplit), its weights streamed."""
    os.makedirs(folder, exist_ok=True)
    if isinstance(model, ModelMixin):
        model.save_config(folder)
        file, metadata = "diffusion_paddle_model.safetensors", {"format": "pd"}
    else:  # PaddleNLP's, whose save_pretrained records the dtype and the class in the configuration
        from paddlenlp.transformers.model_utils import get_parameter_dtype

        model.config.dtype = str(get_parameter_dtype(model)).split(".")[1]  # as its save_pretrained does
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(folder)
        if model.can_generate():
            model.generation_config.save_pretrained(folder)
        file, metadata = "model.safetensors", {"format": "np"}
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    state = {name: LiveTensor(tensor) for name, tensor in model.state_dict().items() if name not in ignored}
    write_safetensors(os.path.join(folder, file), state, metadata)


def _write_torch_text_encoder(text_encoder, folder: str) -> None:
    for name in os.listdir(folder):
        if name != "config.json":
            os.remove(os.path.join(folder, name))
    save_torch_layout(text_encoder, folder, "model.safetensors")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("paddlenlp_version", None)
    config["torch_dtype"] = "float32"
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _rewrite_json(path: str, change) -> None:
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    change(value)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)


def _write_diffusers_version(folder: str) -> None:
    """Every `_diffusers_version` ppdiffusers wrote (model_index.json, the parts' configs): `DIFFUSERS_VERSION`."""
    for path in glob.glob(os.path.join(folder, "*.json")) + glob.glob(os.path.join(folder, "*", "*config.json")):
        with open(path, encoding="utf-8") as f:
            written = "_diffusers_version" in json.load(f)
        if written:
            _rewrite_json(path, lambda config: config.update(_diffusers_version=DIFFUSERS_VERSION))


def _write_standalone_tokenizer(folder: str, length: int) -> None:
    """The exported tokenizer's config names no file outside the pipeline (`SOURCE_PATH_KEYS`), and says the caption
    length the model was trained with wherever a library reads one (`model_max_length`; PaddleNLP's CLIP tokenizer
    also keeps its default `max_len`, 77): the pipelines pad prompts to it."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return

    def change(config: dict) -> None:
        for key in SOURCE_PATH_KEYS:
            config.pop(key, None)
        config["model_max_length"] = length
        if "max_len" in config:
            config["max_len"] = length

    _rewrite_json(path, change)


def _write_fast_tokenizer(folder: str) -> None:
    """A SentencePiece tokenizer's `tokenizer.json` beside its spiece.model, as transformers and the Hub's folders
    hold both: transformers 5 without sentencepiece reads only the former (else it fails with "tiktoken is required
    to read a tiktoken file")."""
    if os.path.isfile(os.path.join(folder, "spiece.model")):
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(t5_tokenizer_json(folder), f, ensure_ascii=False, indent=2)


def export_checkpoint(checkpoint: str, output: str, use_ema: bool = True, to_diffusers: bool = False
                      ) -> tuple[str, bool]:
    """A checkpoint or a pipeline (either layout) exported to `output`; diffusers' layout with a model card."""
    check_output(output, checkpoint)
    unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(checkpoint, use_ema)
    pipeline_of(unet, text_encoder, vae, tokenizer, sampling_scheduler(scheduler_config))  # refused before the card
    if to_diffusers:
        check_diffusers_sampler(unet, text_encoder, scheduler_config)
    card = model_card(checkpoint, unet, text_encoder, vae, scheduler_config, used_ema,
                      tokens=prompt_length(text_encoder, tokenizer)) if to_diffusers else None
    return export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config, output, to_diffusers,
                           card), used_ema
