"""Caption tokenization, padded/truncated to a fixed length: a PaddleNLP BERT WordPiece tokenizer for LDMBert, or a
pretrained encoder's own (CLIP's BPE, T5's SentencePiece: `ldm.models.text`)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from ldm.runtime.errors import UserError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class TokenizerError(UserError, RuntimeError):
    pass


def load_tokenizer(name_or_path: str, model_max_length: int = 77):
    """A BERT-family tokenizer from a local folder holding `vocab.txt`, or a name (needs the network)."""
    from paddlenlp.transformers import AutoTokenizer, BertTokenizer

    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "vocab.txt")):
            raise TokenizerError(f"tokenizer folder {name_or_path} has no vocab.txt")
        return BertTokenizer.from_pretrained(name_or_path, model_max_length=model_max_length)
    try:
        return AutoTokenizer.from_pretrained(name_or_path, model_max_length=model_max_length)
    except Exception as e:  # noqa: BLE001 - PaddleNLP raises several types for "cannot download"
        cause = " ".join(str(e).split())
        end = cause.find(". ")
        cause = cause[:end + 1] if 0 <= end < 300 else cause  # its first sentence, else whole: never cut mid-word
        raise TokenizerError(
            f"cannot load tokenizer {name_or_path!r} ({type(e).__name__}: {cause}) Offline, pass --tokenizer_name a "
            "local folder that holds vocab.txt."
        ) from None


class CaptionTokenizer:
    """caption -> int64 [max_length] token ids, without attention mask (LDMBert takes none). `cut`: how many tokens
    the last caption lost to the length (its end is dropped, as diffusers' pipelines do, which warn of it)."""

    def __init__(self, tokenizer, max_length: int = 77):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.cut = 0

    def __call__(self, caption: str) -> np.ndarray:
        encoded = self.tokenizer(
            caption,
            max_length=self.max_length,
            padding="max_length",
            truncation=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            return_overflowing_tokens=True,
        )
        self.cut = max(0, int(encoded.get("num_truncated_tokens", 0)))  # negative: the room left
        return np.asarray(encoded["input_ids"], dtype=np.int64)


def write_vocab(words: Iterable[str], folder: str) -> str:
    """Write a small WordPiece vocabulary (special tokens, the words, single characters) for offline use."""
    os.makedirs(folder, exist_ok=True)
    tokens = list(SPECIAL_TOKENS)
    seen = set(tokens)
    chars = sorted({c for w in words for c in w.lower()} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    for token in [w.lower() for w in words] + chars + ["##" + c for c in chars]:
        if token and token not in seen:
            seen.add(token)
            tokens.append(token)
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens) + "\n")
    return path
