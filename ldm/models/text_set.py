"""Several frozen text encoders read as one: Stable Diffusion 3's CLIP-L and CLIP-G (each with its projection) and
its T5, which the rest of the framework sees as one text encoder and one tokenizer.

- `TokenizerSet`: a caption -> the three tokenizers' ids, each padded to the caption length, end to end ([3 L]);
- `TextEncoderSet`: those ids -> (states, pooled) as `StableDiffusion3Pipeline.encode_prompt` makes them: each
  CLIP's penultimate hidden states side by side, zero-padded to T5's width, then T5's states (unmasked), along the
  sequence ([B, 2 L, D_t5]); the pooled vector is the two CLIPs' projected EOS states side by side.

On disk a set is a pipeline's three `text_encoder*/` (and `tokenizer*/`) folders, read beside each other, or, where
a run keeps its one frozen text encoder (`<output_dir>/text_encoder/`, a checkpoint's `tokenizer/`), the three
folders inside one, with a `config.json` saying so.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import paddle
from paddle import nn

ENCODER_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZER_PARTS = ("tokenizer", "tokenizer_2", "tokenizer_3")
MODEL_TYPE = "sd3_text_encoders"


def is_set_source(source: str) -> bool:
    """A model folder whose text encoders are SD3's three (`text_encoder/`, `text_encoder_2/`, `text_encoder_3/`)."""
    return all(os.path.isfile(os.path.join(source, part, "config.json")) for part in ENCODER_PARTS)


def part_folders(folder: str, parts: tuple[str, ...]) -> list[str]:
    """The folders of a set's parts: inside `folder` (a run's own copy), or beside it (a pipeline's `text_encoder/`
    with its `text_encoder_2/` and `text_encoder_3/`)."""
    if os.path.isdir(os.path.join(folder, parts[-1])):
        return [os.path.join(folder, part) for part in parts]
    parent = os.path.dirname(os.path.normpath(folder))
    return [os.path.join(parent, part) for part in parts]


def _width(encoder) -> int:
    return int(getattr(encoder.config, "hidden_size", None) or encoder.config.d_model)


class TextEncoderSet(nn.Layer):
    """CLIP-L and CLIP-G with projections and a T5 encoder (`ppdiffusers.transformers` classes), frozen together."""

    composite = True  # `ldm.models.torch_layout.load_pretrained` reads it with `from_pretrained`, not by its files
    id_groups = len(ENCODER_PARTS)  # a caption's ids: each tokenizer's, end to end

    def __init__(self, clip_l, clip_g, t5):
        super().__init__()
        self.encoders = nn.LayerList([clip_l, clip_g, t5])
        clip_width = _width(clip_l) + _width(clip_g)
        if clip_width > _width(t5):
            raise ValueError(f"the two CLIP encoders' states are {clip_width} wide together, wider than T5's "
                             f"{_width(t5)}: SD3 pads them to T5's width")
        positions = [int(c.config.max_position_embeddings) for c in (clip_l, clip_g)]
        self.config = SetConfig(
            model_type=MODEL_TYPE, hidden_size=_width(t5), max_position_embeddings=min(positions),
            projection_dim=int(clip_l.config.projection_dim) + int(clip_g.config.projection_dim),
            vocab_size=None, pad_token_id=None)

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

    def save_pretrained(self, folder: str, **kwargs) -> None:
        os.makedirs(folder, exist_ok=True)
        for part, encoder in zip(ENCODER_PARTS, self.encoders, strict=True):
            encoder.save_pretrained(os.path.join(folder, part), **kwargs)
        # what a caption length and a backbone are checked against
        summary = {k: getattr(self.config, k) for k in ("hidden_size", "max_position_embeddings", "projection_dim")}
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"model_type": MODEL_TYPE, "parts": list(ENCODER_PARTS), **summary}, f, indent=2)

    @classmethod
    def from_pretrained(cls, folder: str):
        from ldm.models.torch_layout import load_pretrained

        return cls(*(load_pretrained(model_class(f), f) for f in part_folders(folder, ENCODER_PARTS)))

def model_class(folder: str):
    """The class of a set's part in `folder`: SD3's CLIPs have projections; its third is a T5 encoder."""
    from ppdiffusers.transformers import CLIPTextModelWithProjection, T5EncoderModel

    return T5EncoderModel if os.path.basename(os.path.normpath(folder)) == ENCODER_PARTS[-1] \
        else CLIPTextModelWithProjection


class SetConfig(SimpleNamespace):
    def to_dict(self) -> dict:
        return dict(vars(self))


class TokenizerSet:
    """The three tokenizers of a set, as one: a caption's ids are each one's, padded to the same caption length,
    end to end."""

    def __init__(self, tokenizers):
        self.tokenizers = list(tokenizers)

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
        for part, tokenizer in zip(TOKENIZER_PARTS, self.tokenizers, strict=True):
            tokenizer.save_pretrained(os.path.join(folder, part))
