"""Text encoders, by family: the one a model's folder holds decides how captions are tokenized and encoded, whether
the encoder trains, and where its weights live.

- `ldmbert`: the CompVis LDM's LDMBert (`bert/`), trained with the UNet by default, on a BERT WordPiece tokenizer
  (`--tokenizer_name`);
- `clip`: a CLIP text tower (`text_encoder/` + `tokenizer/`, Stable Diffusion 1.x and 2.x), frozen by default. Its
  last hidden state (after the final layer norm) conditions the UNet, as diffusers' pipelines use it; Stable
  Diffusion 2's "penultimate layer" is its config's `num_hidden_layers` (23 of OpenCLIP's 24), as diffusers ships it;
- `t5`: a T5 encoder (`text_encoder/` + a SentencePiece `tokenizer/`, as PixArt-alpha and DeepFloyd IF use one),
  frozen by default. Its padding is masked: in the encoder's self-attention and in the UNet's cross-attention
  (`encode_prompt`), so only the caption's real tokens condition the image.

A frozen encoder is part of the run's model, not of its checkpoints: written once to `<output_dir>/text_encoder/`
with its identity (`text_encoder_identity`), which every checkpoint records and a resume compares.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ldm.runtime.errors import UserError

if TYPE_CHECKING:
    from ldm.models.conditioning import Conditioning


class TextEncoderError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class TextFamily:
    name: str
    folder: str  # the part's folder in a pipeline
    trained_by_default: bool
    model_types: tuple[str, ...]  # a config's `model_type` values of this family
    masked: bool = False  # its padding is masked (the UNet's cross-attention gets the mask)
    # the folder of its tokenizer in a model; None: chosen apart (LDMBert's, `--tokenizer_name`), and the encoder
    # built from scratch follows it (its vocabulary, its caption length)
    tokenizer_folder: str | None = "tokenizer"
    frozen_only: str | None = None  # why it cannot be trained here; None: it can
    parts: tuple[TextFamily, ...] = ()  # several encoders read as one (`ldm.models.text_set`): each one's family

    @property
    def set_class(self):
        """The class of a set of encoders (`ldm.models.text_set.TextEncoderSet`), or None: one encoder."""
        if not self.parts:
            return None
        from ldm.models.text_set import SETS

        return SETS[self.model_types[0]]

    def model_class(self, folder: str | None = None):
        """The class of the family's encoder in `folder`: CLIP's with its projection (SDXL's and SD3's
        `CLIPTextModelWithProjection`) when its config's `architectures` or its weights (`text_projection.weight`)
        say so."""
        if self.name == "ldmbert":
            from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertModel

            return LDMBertModel
        if self.parts:
            return self.set_class
        # ppdiffusers' own copies: transformers' weight names, as its pipelines use them
        from ppdiffusers.transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

        if self.name == "t5":
            return T5EncoderModel
        return CLIPTextModelWithProjection if folder and has_projection(folder) else CLIPTextModel

    def tokenizer_class(self):
        from paddlenlp.transformers import BertTokenizer
        from ppdiffusers.transformers import CLIPTokenizer, T5Tokenizer

        return {"ldmbert": BertTokenizer, "clip": CLIPTokenizer, "t5": T5Tokenizer}[self.name]


LDMBERT = TextFamily("ldmbert", "bert", True, ("ldmbert",), tokenizer_folder=None)
CLIP = TextFamily("clip", "text_encoder", False, ("clip_text_model", "clip"))
T5 = TextFamily("t5", "text_encoder", False, ("t5",), masked=True)
# Stable Diffusion 3's three (`ldm.models.text_set`): CLIP-L, CLIP-G and T5, read as one
SD3_TEXT = TextFamily("sd3", "text_encoder", False, ("sd3_text_encoders",),
                      frozen_only="Stable Diffusion 3's three text encoders train frozen here (they are saved and "
                                  "checked as one frozen part)", parts=(CLIP, CLIP, T5))
# Stable Diffusion XL's two: CLIP-L and OpenCLIP-bigG, read as one
SDXL_TEXT = TextFamily("sdxl", "text_encoder", False, ("sdxl_text_encoders",),
                       frozen_only="Stable Diffusion XL's two text encoders train frozen here (they are saved and "
                                   "checked as one frozen part)", parts=(CLIP, CLIP))
# a set with more parts first: SD3's folders hold SDXL's two as well
FAMILIES = (LDMBERT, CLIP, T5, SD3_TEXT, SDXL_TEXT)


def named(name: str) -> TextFamily:
    """The family a record names (`text_encoder_identity`'s "family")."""
    return next(f for f in FAMILIES if f.name == name)


def text_family(source: str) -> TextFamily:
    """The family of the text encoder a model folder (preset, configs or pipeline) holds: its `bert/` or its
    `text_encoder/`, told by the config's `model_type`; SD3's set: its `text_encoder/`, `_2/` and `_3/`."""
    for family in FAMILIES:
        if family.parts and family.set_class.is_source(source):
            return family
    for folder in ("bert", "text_encoder"):
        config = os.path.join(source, folder, "config.json")
        if not os.path.isfile(config):
            continue
        try:
            with open(config, encoding="utf-8") as f:
                model_type = json.load(f).get("model_type", "ldmbert" if folder == "bert" else "clip_text_model")
        except (OSError, ValueError, AttributeError) as e:
            raise TextEncoderError(f"{config}: not a readable config ({e})") from None
        found = [f for f in FAMILIES if f.folder == folder and model_type in f.model_types]
        if not found:
            known = ", ".join(t for f in FAMILIES for t in f.model_types)
            raise TextEncoderError(f"{config}: a {model_type!r} text encoder; this framework trains with {known}")
        return found[0]
    raise TextEncoderError(f"{source}: no bert/config.json (LDMBert) nor text_encoder/config.json (CLIP): expected a "
                           "preset, a folder of configs or a pipeline folder")


PROJECTION = "CLIPTextModelWithProjection"


def has_projection(folder: str) -> bool:
    """A CLIP text encoder folder holds a projection of its pooled output: its config names the class, or its
    (safetensors) weights hold `text_projection.weight`."""
    import glob

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            if PROJECTION in (json.load(f).get("architectures") or ()):
                return True
    except (OSError, ValueError, AttributeError):
        return False  # its loader says what is wrong with it
    from safetensors import safe_open

    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        try:
            with safe_open(path, "np") as f:
                if any(key.endswith("text_projection.weight") for key in f.keys()):  # noqa: SIM118 - no __iter__
                    return True
        except Exception:  # noqa: BLE001 - safetensors raises its own types; the loader says why
            continue
    return False


def family_of(text_encoder) -> TextFamily:
    """The family of a text encoder model (by its class)."""
    name = type(text_encoder).__name__
    if getattr(text_encoder, "composite", False):
        return named_type(text_encoder.model_type)
    return LDMBERT if name.startswith("LDMBert") else T5 if name.startswith("T5") else CLIP


def named_type(model_type: str) -> TextFamily:
    """The family of a set of encoders, by its config's `model_type`."""
    return next(f for f in FAMILIES if model_type in f.model_types)


def text_parts(text_encoder) -> list[tuple[str, str, object]]:
    """(encoder folder, tokenizer folder, model) of each text encoder a pipeline holds: one, or a set's."""
    if family_of(text_encoder).parts:
        return list(zip(text_encoder.encoder_parts, text_encoder.tokenizer_parts, text_encoder.encoders, strict=True))
    return [(family_of(text_encoder).folder, "tokenizer", text_encoder)]


def is_masked(text_encoder) -> bool:
    return family_of(text_encoder).masked


def encode_prompt(text_encoder, input_ids) -> Conditioning:
    """The text conditioning of token ids: the states (the last hidden ones; SD3's set: its own), their mask (1 for a
    real token, EOS included) where the family masks its padding (T5's), the pooled vector of an encoder that makes
    one (a CLIP with a projection, which puts it first; SD3's set)."""
    from ldm.models.conditioning import Conditioning

    if family_of(text_encoder).parts:
        states, pooled = text_encoder(input_ids)
        return Conditioning(states, pooled=pooled)
    if hasattr(text_encoder, "text_projection"):
        out = text_encoder(input_ids, return_dict=True)
        return Conditioning(out.last_hidden_state, pooled=out.text_embeds)
    if not is_masked(text_encoder):
        return Conditioning(text_encoder(input_ids)[0])
    mask = (input_ids != text_encoder.config.pad_token_id).astype("int64")
    return Conditioning(text_encoder(input_ids, attention_mask=mask)[0], mask)


def empty_caption(text_encoder, input_ids) -> Conditioning:
    """The text conditioning of the empty caption's token ids: what a dropped caption trains on and what guidance
    samples against when no negative prompt is given. Zeros (states and pooled vector) for encoders whose pipeline says
    `force_zeros_for_empty_prompt` (Stable Diffusion XL's, `ldm.models.text_set.SDXLTextEncoders`), as its pipeline
    makes the negative and Stability's base model learned its unconditional; else their encoding."""
    import paddle

    encoded = encode_prompt(text_encoder, input_ids)
    if not getattr(text_encoder.config, "force_zeros_for_empty_prompt", False):
        return encoded
    return replace(encoded, states=paddle.zeros_like(encoded.states), pooled=paddle.zeros_like(encoded.pooled))


def cache_entry(text_encoder, length: int) -> dict:
    """What a caption's cached states of this encoder are (`ldm.data.latents`' meta): their `shape` [rows, width]
    at the caption `length` (SD3's set: 2 L rows), its `length` where the encoder masks its padding (the states
    keep its real tokens only), the `pooled` vector's shape where it makes one."""
    config = text_encoder.config
    width = getattr(config, "hidden_size", None) or config.d_model
    rows = text_encoder.states_length(length) if hasattr(text_encoder, "states_length") else length
    entry = {"shape": [rows, width]}
    if is_masked(text_encoder):
        entry["length"] = length
    if hasattr(text_encoder, "text_projection") or family_of(text_encoder).parts:
        entry["pooled"] = [int(config.projection_dim)]
    return entry


def describe_text_encoder(text_encoder, tokens: int | None) -> str:
    """One line of a model card: the text encoder's class, size and shape, and the caption length `tokens` it was
    trained with."""
    b, family = text_encoder.config, family_of(text_encoder)
    parameters = f"{sum(int(p.numel()) for p in text_encoder.parameters()) / 1e6:.2f} M parameters"
    if family is LDMBERT:
        return (f"- LDMBert text encoder: {parameters}, {b.encoder_layers} layers of width {b.d_model}, "
                f"{b.encoder_attention_heads} heads, vocabulary {b.vocab_size}, {b.max_position_embeddings} tokens")
    if family is CLIP:
        return (f"- CLIP text encoder: {parameters}, {b.num_hidden_layers} layers of width {b.hidden_size}, "
                f"{b.num_attention_heads} heads, vocabulary {b.vocab_size}, {b.max_position_embeddings} positions, "
                f"prompts of {tokens or b.max_position_embeddings} tokens")
    if family.parts:
        return text_encoder.describe(parameters, tokens)
    return (f"- T5 text encoder (frozen): {parameters}, {b.num_layers} layers of width {b.d_model}, {b.num_heads} "
            f"heads, vocabulary {b.vocab_size}, prompts of {tokens} tokens, padding masked")


def prompt_length(text_encoder, tokenizer) -> int:
    """The caption length a model was trained with, which it must sample with: the length its tokenizer was saved
    with (a run saves it with its --model_max_length; loading a checkpoint sets the one its model record holds), at
    most its text encoder's positions. A pretrained CLIP keeps its 77 positions when trained on fewer tokens: on 77
    its UNet would attend to padding states it never saw. A tokenizer saved without a length (a library's huge
    default) leaves the encoder's positions; T5's relative positions leave the tokenizer's."""
    positions = getattr(text_encoder.config, "max_position_embeddings", None)
    saved = int(tokenizer.model_max_length)
    return min(positions, saved) if positions else saved


# LDMBert's positions, and the length of a tokenizer saved without one (a library's huge default: `NO_LENGTH`)
DEFAULT_CAPTION_LENGTH = 77
NO_LENGTH = 10**6


def caption_length(asked: int | None, tokenizer, positions: int | None) -> int:
    """The caption length a frozen encoder's states are made at, the same in training and in `encode
    --text_embeddings`: `asked` (--model_max_length), else the model's own: its tokenizer's saved `model_max_length`
    (Stable Diffusion's 77, PixArt-alpha's 120), at most the encoder's `positions` (CLIP's; T5's are relative)."""
    if asked is not None:
        if positions is not None and asked > positions:
            raise TextEncoderError(f"--model_max_length {asked}: this text encoder reads at most {positions} tokens")
        return asked
    saved = int(tokenizer.model_max_length)
    lengths = [n for n in (saved if saved < NO_LENGTH else None, positions) if n]
    return min(lengths) if lengths else DEFAULT_CAPTION_LENGTH


def check_vocabulary(tokenizer, tokenizer_source: str, text_encoder, encoder_source: str) -> None:
    """Every token id the tokenizer makes has a row in the encoder's embedding: a larger tokenizer fails deep in
    Paddle ("expected >= 0 and < N") at the first caption that uses a token past the end, or at the empty caption's
    end-of-text token."""
    if family_of(text_encoder).parts:
        from ldm.models.text_set import part_folders

        for one, folder, encoder, encoder_folder in zip(
                tokenizer.tokenizers, part_folders(tokenizer_source, text_encoder.tokenizer_parts),
                text_encoder.encoders, part_folders(encoder_source, text_encoder.encoder_parts), strict=True):
            check_vocabulary(one, folder, encoder, encoder_folder)
        return
    rows = int(text_encoder.config.vocab_size)
    size = len(tokenizer)
    if size > rows:
        raise TextEncoderError(f"the tokenizer of {tokenizer_source} has {size} tokens and the text encoder of "
                               f"{encoder_source} embeds {rows}: not a pair. Use the tokenizer the encoder "
                               "was trained with (a model's own tokenizer/, or --tokenizer_name for LDMBert)")


def train_text_encoder(family: TextFamily, asked: bool | None) -> bool:
    """`--train_text_encoder` as given, else the family's default (LDMBert: trained; CLIP: frozen)."""
    return family.trained_by_default if asked is None else asked


def config_dict(layer) -> dict:
    """A part's config as a plain dict: ppdiffusers' FrozenDict or PaddleNLP's PretrainedConfig; SD3's set: its own
    with each of its encoders'."""
    if family_of(layer).parts:
        parts = {part: config_dict(encoder) for part, _, encoder in text_parts(layer)}
        return {**layer.config.to_dict(), "parts": parts}
    config = layer.config.to_dict() if hasattr(layer.config, "to_dict") else dict(layer.config)
    volatile = ("paddlenlp_version", "transformers_version", "architectures", "torch_dtype", "dtype")
    return {k: v for k, v in config.items() if not k.startswith("_") and k not in volatile}


def weights_sha256(layer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(layer.state_dict().items()):
        array = np.ascontiguousarray(tensor.numpy())
        digest.update(f"{name}:{array.dtype}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def text_encoder_identity(layer, family: TextFamily, max_length: int) -> dict:
    """What makes two frozen text encoders the same for a UNet trained on their states: the family, the config, the
    weights, the layer read and the caption length."""
    config = json.dumps(config_dict(layer), sort_keys=True, default=str)
    return {"family": family.name, "class": type(layer).__name__,
            "config_sha256": hashlib.sha256(config.encode()).hexdigest(), "weights_sha256": weights_sha256(layer),
            "hidden_layer": family.set_class.hidden_layer if family.parts else "last",
            "max_length": int(max_length)}


def load_text_tokenizer(family: TextFamily, folder: str, model_max_length: int | None = None, own_copy: bool = False):
    """The tokenizer of a pretrained encoder: its `tokenizer/` folder. T5's: spiece.model, or, when transformers 5
    (or a recent pipeline) wrote it, tokenizer.json alone: its Unigram model is written out as the spiece.model it
    was converted from first. CLIP's: vocab.json and merges.txt, or tokenizer.json alone (which PaddleNLP does not
    read): its BPE vocabulary and merges are written out as the two files first. `own_copy`: read from a copy of the
    folder that lives as long as the process (a tokenizer saves itself by copying the files it was read from, and a
    training run's checkpoint it resumed from may be rotated away meanwhile)."""
    if family.parts:  # each of its tokenizers, at the first's caption length
        from ldm.models.text_set import TokenizerSet, part_folders

        parts = family.set_class.tokenizer_parts
        tokenizers = TokenizerSet((load_text_tokenizer(part, f, model_max_length, own_copy) for part, f in
                                   zip(family.parts, part_folders(folder, parts), strict=True)), parts)
        tokenizers.model_max_length = tokenizers.model_max_length
        return tokenizers
    if family.tokenizer_folder is None:  # LDMBert's, as its pipeline saved it
        return wordpiece_tokenizer(folder)
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    if own_copy and os.path.isdir(folder):
        folder = process_copy(folder)
    if family.name == "t5":
        if not os.path.isfile(os.path.join(folder, "spiece.model")):
            if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
                raise TextEncoderError(f"{folder}: no spiece.model (nor tokenizer.json), the SentencePiece tokenizer "
                                       "of this T5 encoder")
            folder = spiece_files(folder)
        return family.tokenizer_class().from_pretrained(folder, **kwargs)
    files = [os.path.join(folder, name) for name in ("vocab.json", "merges.txt")]
    if not all(os.path.isfile(f) for f in files):
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise TextEncoderError(f"{folder}: no vocab.json and merges.txt (nor tokenizer.json), the {family.name} "
                                   "tokenizer of this model")
        folder = bpe_files(folder)
    return family.tokenizer_class().from_pretrained(folder, **kwargs)


def wordpiece_tokenizer(folder: str):
    """PaddleNLP's BertTokenizer of a pipeline's `tokenizer/`: from its vocab.txt, or, when transformers 5 wrote the
    folder (tokenizer.json alone, which PaddleNLP does not read), from that file's WordPiece vocabulary."""
    import tempfile

    from paddlenlp.transformers import BertTokenizer

    source = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(os.path.join(folder, "vocab.txt")) or not os.path.isfile(source):
        return BertTokenizer.from_pretrained(folder)
    with open(source, encoding="utf-8") as f:
        model = json.load(f).get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "WordPiece" or not isinstance(vocab, dict) or sorted(vocab.values()) != list(
            range(len(vocab))):
        raise TextEncoderError(f"{source}: not a WordPiece (BERT) vocabulary, which LDMBert's pipeline uses")
    config = {}
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    temp = tempfile.TemporaryDirectory(prefix="ldm-vocab-")
    vocab_file = os.path.join(temp.name, "vocab.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        f.writelines(f"{token}\n" for token in sorted(vocab, key=vocab.get))
    tokenizer = BertTokenizer(vocab_file, do_lower_case=config.get("do_lower_case", True),
                              model_max_length=config.get("model_max_length", 77))
    tokenizer.vocab_folder = temp  # its save_pretrained copies the file: the folder lives as long as it does
    return tokenizer


def process_copy(folder: str) -> str:
    """A copy of a folder's files, removed when the process ends."""
    import atexit
    import shutil
    import tempfile

    copy = tempfile.mkdtemp(prefix="ldm-tokenizer-")
    atexit.register(shutil.rmtree, copy, True)
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    return copy


def bpe_files(folder: str) -> str:
    """A folder holding transformers' `tokenizer.json` (a BPE model) as the vocab.json and merges.txt it describes,
    with the folder's configs: a temporary copy, removed when the process ends."""
    import atexit
    import shutil
    import tempfile

    source = os.path.join(folder, "tokenizer.json")
    try:
        with open(source, encoding="utf-8") as f:
            model = json.load(f)["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"a {model.get('type')} model, not BPE")
        vocab, merges = dict(model["vocab"]), [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TextEncoderError(f"{source}: not a CLIP BPE tokenizer ({e})") from None
    copy = tempfile.mkdtemp(prefix="ldm-bpe-")
    atexit.register(shutil.rmtree, copy, True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copy(os.path.join(folder, name), copy)
    with open(os.path.join(copy, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(copy, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    return copy


EXTRA_ID = re.compile(r"<extra_id_\d+>")
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def spiece_files(folder: str) -> str:
    """A folder holding transformers' `tokenizer.json` of a T5 tokenizer (a SentencePiece Unigram model) as the
    spiece.model it describes, with the folder's configs: a temporary copy, removed when the process ends. The
    reverse of transformers' `T5Converter`: the pieces and scores of its `model.vocab` (less the `<extra_id_N>` it
    appends, which the tokenizer adds back from `extra_ids`), the special tokens as control pieces, the normalizer's
    precompiled character map, the pre-tokenizer's dummy prefix."""
    import atexit
    import shutil
    import tempfile

    from paddlenlp.transformers import sentencepiece_model_pb2 as pb  # the generated module protobuf 3 reads

    source = os.path.join(folder, "tokenizer.json")
    try:
        with open(source, encoding="utf-8") as f:
            spec = json.load(f)
        model = spec["model"]
        if model.get("type") != "Unigram":
            raise ValueError(f"a {model.get('type')} model, not T5's Unigram")
        vocab = [(str(piece), float(score)) for piece, score in model["vocab"]]
        special = {t["content"] for t in spec.get("added_tokens") or () if t.get("special")}
        unk_id = int(model.get("unk_id", 2))
        charsmap = "".join(n.get("precompiled_charsmap") or "" for n in _parts(spec.get("normalizer")))
        prefix = [p for p in _parts(spec.get("pre_tokenizer")) if p.get("type") == "Metaspace"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise TextEncoderError(f"{source}: not a T5 SentencePiece tokenizer ({e}); provide its spiece.model") from None
    extra = 0
    while extra < len(vocab) and EXTRA_ID.fullmatch(vocab[len(vocab) - 1 - extra][0]):
        extra += 1
    proto = pb.ModelProto()
    byte_fallback = bool(model.get("byte_fallback"))
    piece_type = pb.ModelProto.SentencePiece
    for i, (piece, score) in enumerate(vocab[:len(vocab) - extra]):
        if i == unk_id:
            kind = piece_type.UNKNOWN
        elif piece in special:
            kind = piece_type.CONTROL
        elif byte_fallback and BYTE_PIECE.fullmatch(piece):
            kind = piece_type.BYTE
        else:
            kind = piece_type.NORMAL
        proto.pieces.add(piece=piece, score=score, type=kind)
    ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    trainer = proto.trainer_spec
    trainer.model_type, trainer.vocab_size, trainer.byte_fallback = pb.TrainerSpec.UNIGRAM, len(proto.pieces), \
        byte_fallback
    trainer.unk_id, trainer.bos_id = unk_id, -1
    trainer.eos_id, trainer.pad_id = ids.get("</s>", -1), ids.get("<pad>", -1)
    normalizer = proto.normalizer_spec
    normalizer.name = "nmt_nfkc" if charsmap else "identity"
    normalizer.precompiled_charsmap = base64.b64decode(charsmap)
    metaspace = prefix[0] if prefix else {}  # transformers' older `add_prefix_space`, its newer `prepend_scheme`
    normalizer.add_dummy_prefix = (metaspace.get("add_prefix_space", True) is not False
                                   and metaspace.get("prepend_scheme", "always") != "never")
    copy = tempfile.mkdtemp(prefix="ldm-spiece-")
    atexit.register(shutil.rmtree, copy, True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copy(os.path.join(folder, name), copy)
    with open(os.path.join(copy, "spiece.model"), "wb") as f:
        f.write(proto.SerializeToString())
    config_file = os.path.join(copy, "tokenizer_config.json")
    config = _json_or_empty(config_file)
    # the extra ids the vocabulary ends with, which transformers 5's config no longer names
    config.update(extra_ids=extra, additional_special_tokens=[f"<extra_id_{i}>" for i in range(extra)])
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return copy


def _json_or_empty(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


METASPACE = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}


def t5_tokenizer_json(folder: str) -> dict:
    """The `tokenizer.json` of the T5 tokenizer in `folder` (spiece.model, tokenizer_config.json's `extra_ids`), as
    transformers 5's `T5Tokenizer` writes it (the reverse of `spiece_files`): a Unigram model of the SentencePiece
    pieces and scores, then the `<extra_id_N>` in reverse, the precompiled character map as its normalizer. What a
    library reads when it has no sentencepiece (transformers 5 without it cannot read spiece.model)."""
    from paddlenlp.transformers import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    with open(os.path.join(folder, "spiece.model"), "rb") as f:
        proto.ParseFromString(f.read())
    extra = int(_json_or_empty(os.path.join(folder, "tokenizer_config.json")).get("extra_ids", 0) or 0)
    vocab = [[piece.piece, piece.score] for piece in proto.pieces]
    vocab += [[f"<extra_id_{i}>", 0.0] for i in reversed(range(extra))]
    special = [i for i, piece in enumerate(proto.pieces) if piece.type in (piece.CONTROL, piece.UNKNOWN)]
    special += range(len(proto.pieces), len(vocab))
    eos = next(i for i, (piece, _) in enumerate(vocab) if piece == "</s>")
    charsmap = proto.normalizer_spec.precompiled_charsmap

    def sequence(name: str) -> dict:
        return {"Sequence": {"id": name, "type_id": 0}}

    end = {"SpecialToken": {"id": "</s>", "type_id": 0}}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": vocab[i][0], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in special],
        "normalizer": ({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()}
                       if charsmap else None),
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, METASPACE]},
        "post_processor": {"type": "TemplateProcessing", "single": [sequence("A"), end],
                           "pair": [sequence("A"), end, sequence("B"), end],
                           "special_tokens": {"</s>": {"id": "</s>", "ids": [eos], "tokens": ["</s>"]}}},
        "decoder": METASPACE,
        "model": {"type": "Unigram", "unk_id": proto.trainer_spec.unk_id, "vocab": vocab,
                  "byte_fallback": proto.trainer_spec.byte_fallback},
    }


def _parts(component) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer and, for a `Sequence`, its members."""
    if not isinstance(component, dict):
        return []
    members = component.get("normalizers") or component.get("pretokenizers")
    return [component] + [m for m in members or () if isinstance(m, dict)]


# -- a small CLIP tokenizer, for tests and offline presets -----------------------------------------------------------
def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order (CLIP's BPE works on them)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes, strict=True))]


def write_clip_vocab(words: list[str], folder: str, model_max_length: int = 77) -> str:
    """A CLIP BPE tokenizer over single bytes plus merges that make each of `words` one token, in transformers' files
    (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json): what `sd-tiny` and the tests use."""
    os.makedirs(folder, exist_ok=True)
    symbols = byte_symbols()
    vocab = symbols + [s + "</w>" for s in symbols]
    merges: list[str] = []
    for word in dict.fromkeys(w.lower() for w in words if len(w) > 1):
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            if f"{pieces[0]} {pieces[1]}" not in merges:
                merges.append(f"{pieces[0]} {pieces[1]}")
                vocab.append(merged)
            pieces = [merged] + pieces[2:]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(dict.fromkeys(vocab))}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>"}
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({**special, "model_max_length": model_max_length, "do_lower_case": True,
                   "tokenizer_class": "CLIPTokenizer"}, f, indent=2)
    return folder
