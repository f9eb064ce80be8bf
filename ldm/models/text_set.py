"""Several frozen text encoders read as one, which the rest of the framework sees as one text encoder and one
tokenizer (`TextEncoderSet`, `TokenizerSet`):

- Stable Diffusion 3's CLIP-L and CLIP-G (each with its projection) and T5 (`SD3TextEncoders`): each CLIP's
  penultimate hidden states side by side, zero-padded to T5's width, then T5's states (unmasked), along the sequence
  ([B, 2 L, D_t5]); the pooled vector is the two CLIPs' projected EOS states side by side, as
  `StableDiffusion3Pipeline.encode_prompt` makes them;
- Stable Diffusion XL's CLIP-L and OpenCLIP-bigG (the second with its projection: `SDXLTextEncoders`): both
  penultimate hidden states side by side on the feature axis ([B, L, D_l + D_g]); the pooled vector is the second's
  projected EOS state, as `StableDiffusionXLPipeline.encode_prompt` makes them.

A caption's ids are each tokenizer's, padded to the caption length, end to end ([B, parts x L]). On disk a set is a
pipeline's `text_encoder*/` (and `tokenizer*/`) folders, read beside each other, or, where a run keeps its one frozen
text encoder (`<output_dir>/text_encoder/`, a checkpoint's `tokenizer/`), the folders inside one, with a
`config.json` saying so.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import paddle
from paddle import nn

from ldm.runtime.files import read_json_object


def part_folders(folder: str, parts: tuple[str, ...]) -> list[str]:
    """The folders of a set's parts: inside `folder` (a run's own copy), or beside it (a pipeline's `text_encoder/`
    with its `text_encoder_2/`, ...)."""
    if os.path.isdir(os.path.join(folder, parts[-1])):
        return [os.path.join(folder, part) for part in parts]
    parent = os.path.dirname(os.path.normpath(folder))
    return [os.path.join(parent, part) for part in parts]


def _width(encoder) -> int:
    return int(getattr(encoder.config, "hidden_size", None) or encoder.config.d_model)


class TextEncoderSet(nn.Layer):
    """Frozen text encoders (`ppdiffusers.transformers` classes) read as one: a subclass says which parts, in which
    folders, and how their outputs combine (`forward`: (states, pooled))."""

    composite = True  # `ldm.models.torch_layout.load_pretrained` reads it with `from_pretrained`, not by its files
    model_type: str  # its config's, which names the set
    encoder_parts: tuple[str, ...]  # each encoder's folder in a pipeline
    tokenizer_parts: tuple[str, ...]
    part_kinds: tuple[str, ...]  # each encoder's text family (`ldm.models.text`), by name
    hidden_layer: str  # which of each encoder's hidden states it reads (its identity says it)
    settings: dict = {}  # pipeline settings it carries, with their defaults (`model_index.json`'s)

    def __init__(self, *encoders, **settings):
        super().__init__()
        self.encoders = nn.LayerList(list(encoders))
        self.config = SetConfig(model_type=self.model_type, vocab_size=None, pad_token_id=None,
                                max_position_embeddings=min(int(e.config.max_position_embeddings)
                                                            for e in encoders if hasattr(e.config,
                                                                                        "max_position_embeddings")),
                                **self.shape(), **{k: settings.get(k, v) for k, v in self.settings.items()})

    @property
    def id_groups(self) -> int:
        """A caption's ids: each tokenizer's, end to end."""
        return len(self.encoder_parts)

    def shape(self) -> dict:
        """Its config's `hidden_size` (the states' width) and `projection_dim` (the pooled vector's)."""
        raise NotImplementedError

    @staticmethod
    def states_length(caption_length: int) -> int:
        """The rows of a caption's states."""
        return caption_length

    @classmethod
    def is_source(cls, source: str) -> bool:
        """A model folder holding this set's encoders (`text_encoder/`, `text_encoder_2/`, ...)."""
        return all(os.path.isfile(os.path.join(source, part, "config.json")) for part in cls.encoder_parts)

    @classmethod
    def read_settings(cls, folder: str) -> dict:
        """Its settings as a run's own copy (`folder`'s config.json) or a pipeline (the model_index.json beside the
        parts) says them; the pipeline's defaults where neither does."""
        saved = read_json_object(os.path.join(folder, "config.json"))
        if saved.get("model_type") != cls.model_type:
            saved = read_json_object(os.path.join(os.path.dirname(os.path.normpath(folder)), "model_index.json"))
        return {k: saved.get(k, v) for k, v in cls.settings.items()}

    def describe(self, parameters: str, tokens: int | None) -> str:
        """A model card's line."""
        raise NotImplementedError

    def save_pretrained(self, folder: str, **kwargs) -> None:
        os.makedirs(folder, exist_ok=True)
        for part, encoder in zip(self.encoder_parts, self.encoders, strict=True):
            encoder.save_pretrained(os.path.join(folder, part), **kwargs)
        # what a caption length and a backbone are checked against, and its settings
        keys = ("hidden_size", "max_position_embeddings", "projection_dim", *self.settings)
        summary = {k: getattr(self.config, k) for k in keys}
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"model_type": self.model_type, "parts": list(self.encoder_parts), **summary}, f, indent=2)

    @classmethod
    def from_pretrained(cls, folder: str):
        from ldm.models.torch_layout import load_pretrained

        return cls(*(load_pretrained(cls.part_class(f), f) for f in part_folders(folder, cls.encoder_parts)),
                   **cls.read_settings(folder))

    @classmethod
    def part_class(cls, folder: str):
        """The class of a set's part in `folder`, by its place in the set."""
        from ppdiffusers.transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

        kind = cls.part_kinds[cls.encoder_parts.index(os.path.basename(os.path.normpath(folder)))]
        return {"t5": T5EncoderModel, "clip": CLIPTextModel, "clip_projection": CLIPTextModelWithProjection}[kind]


class SD3TextEncoders(TextEncoderSet):
    """Stable Diffusion 3's CLIP-L and CLIP-G with projections and its T5 encoder."""

    model_type = "sd3_text_encoders"
    encoder_parts = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_parts = ("tokenizer", "tokenizer_2", "tokenizer_3")
    part_kinds = ("clip_projection", "clip_projection", "t5")
    hidden_layer = "penultimate CLIP, last T5"

    def shape(self):
        clip_l, clip_g, t5 = self.encoders
        clip_width = _width(clip_l) + _width(clip_g)
        if clip_width > _width(t5):
            raise ValueError(f"the two CLIP encoders' states are {clip_width} wide together, wider than T5's "
                             f"{_width(t5)}: SD3 pads them to T5's width")
        return {"hidden_size": _width(t5),
                "projection_dim": int(clip_l.config.projection_dim) + int(clip_g.config.projection_dim)}

    def forward(self, input_ids: paddle.Tensor):
        """(states [B, 2 L, D_t5], pooled [B, P_l + P_g]) of the three tokenizers' ids end to end ([B, 3 L])."""
        clip_l, clip_g, t5 = self.encoders
        ids_l, ids_g, ids_t5 = paddle.split(input_ids, 3, axis=1)
        states, pooled = [], []
        for encoder, ids in ((clip_l, ids_l), (clip_g, ids_g)):
            out = encoder(ids, output_hidden_states=True, return_dict=True)
            states.append(out.hidden_states[-2])  # the penultimate layer's, as SD3's pipeline reads them
            pooled.append(out.text_embeds)
        clip = paddle.concat(states, axis=-1)
        t5_states = t5(ids_t5)[0]
        clip = nn.functional.pad(clip, [0, t5_states.shape[-1] - clip.shape[-1]], data_format="NCL")
        return paddle.concat([clip, t5_states.astype(clip.dtype)], axis=1), paddle.concat(pooled, axis=-1)

    @staticmethod
    def states_length(caption_length: int) -> int:
        """The rows of a caption's states: the CLIPs' tokens, then T5's."""
        return 2 * caption_length

    def describe(self, parameters, tokens):
        clip_l, clip_g, t5 = (e.config for e in self.encoders)
        return (f"- Stable Diffusion 3's text encoders (frozen): {parameters}; CLIP-L {clip_l.num_hidden_layers} "
                f"layers of width {clip_l.hidden_size} and CLIP-G {clip_g.num_hidden_layers} layers of width "
                f"{clip_g.hidden_size}, both with projections (pooled {self.config.projection_dim}), T5 "
                f"{t5.num_layers} layers of width {t5.d_model}; prompts of {tokens} tokens for each")


class SDXLTextEncoders(TextEncoderSet):
    """Stable Diffusion XL's CLIP-L (`CLIPTextModel`) and OpenCLIP-bigG (`CLIPTextModelWithProjection`).

    `force_zeros_for_empty_prompt` (its pipeline's setting, True unless the pipeline says otherwise): the empty
    caption's conditioning is zeros, states and pooled vector, as Stability's base model learned its unconditional
    (`ldm.models.text.empty_caption`)."""

    model_type = "sdxl_text_encoders"
    encoder_parts = ("text_encoder", "text_encoder_2")
    tokenizer_parts = ("tokenizer", "tokenizer_2")
    part_kinds = ("clip", "clip_projection")
    hidden_layer = "penultimate of each CLIP"
    settings = {"force_zeros_for_empty_prompt": True}

    def shape(self):
        clip_l, clip_g = self.encoders
        return {"hidden_size": _width(clip_l) + _width(clip_g), "projection_dim": int(clip_g.config.projection_dim)}

    def forward(self, input_ids: paddle.Tensor):
        """(states [B, L, D_l + D_g], pooled [B, P_g]) of the two tokenizers' ids end to end ([B, 2 L])."""
        states = []
        for encoder, ids in zip(self.encoders, paddle.split(input_ids, 2, axis=1), strict=True):
            out = encoder(ids, output_hidden_states=True, return_dict=True)
            states.append(out.hidden_states[-2])  # the penultimate layer's, as SDXL's pipeline reads both
        return paddle.concat(states, axis=-1), out.text_embeds

    def describe(self, parameters, tokens):
        clip_l, clip_g = (e.config for e in self.encoders)
        return (f"- Stable Diffusion XL's text encoders (frozen): {parameters}; CLIP-L {clip_l.num_hidden_layers} "
                f"layers of width {clip_l.hidden_size} and OpenCLIP-bigG {clip_g.num_hidden_layers} layers of width "
                f"{clip_g.hidden_size} (pooled {self.config.projection_dim}, its projection), penultimate states side "
                f"by side ({self.config.hidden_size} wide); prompts of {tokens} tokens for each")


SETS = {cls.model_type: cls for cls in (SD3TextEncoders, SDXLTextEncoders)}


class SetConfig(SimpleNamespace):
    def to_dict(self) -> dict:
        return dict(vars(self))


class TokenizerSet:
    """The three tokenizers of a set, as one: a caption's ids are each one's, padded to the same caption length,
    end to end."""

    def __init__(self, tokenizers, parts: tuple[str, ...]):
        self.tokenizers, self.parts = list(tokenizers), parts  # `parts`: each one's folder

    @property
    def model_max_length(self) -> int:
        return int(self.tokenizers[0].model_max_length)

    @model_max_length.setter
    def model_max_length(self, length: int) -> None:
        for tokenizer in self.tokenizers:
            tokenizer.model_max_length = length

    @property
    def pad_token_id(self):
        return self.tokenizers[0].pad_token_id

    @property
    def vocab_size(self):
        return self.tokenizers[0].vocab_size

    def __call__(self, text, max_length=None, **kwargs) -> dict:
        encoded = [t(text, max_length=max_length or self.model_max_length, **kwargs) for t in self.tokenizers]
        ids = [np.asarray(e["input_ids"]) for e in encoded]
        result = {"input_ids": np.concatenate(ids, axis=-1).tolist()}
        if all("num_truncated_tokens" in e for e in encoded):  # asked for: the most any of the three cut
            result["num_truncated_tokens"] = max(int(e["num_truncated_tokens"]) for e in encoded)
        return result

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        for part, tokenizer in zip(self.parts, self.tokenizers, strict=True):
            tokenizer.save_pretrained(os.path.join(folder, part))
