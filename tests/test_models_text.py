"""Text encoders and their tokenizers as other libraries save them (`ldm.models.text`): a T5 tokenizer saved as
transformers' `tokenizer.json` alone."""

import base64
import json
import os

import numpy as np
import pytest
from conftest import ROOT

from ldm.models.text import T5, TextEncoderError, load_text_tokenizer

PROMPTS = ["a red circle on a blue background", "A  Photo of 22 green squares", "", "zebra ünïcode 1"]


def write_t5_tokenizers(folder) -> tuple[str, str]:
    """(a folder with a Unigram spiece.model trained here, one with the tokenizer.json transformers' `T5Converter`
    writes of it, with 3 extra ids, and nothing else)."""
    import sentencepiece
    from paddlenlp.transformers import sentencepiece_model_pb2 as pb

    slow, fast = os.path.join(folder, "slow"), os.path.join(folder, "fast")
    os.makedirs(slow)
    os.makedirs(fast)
    text = os.path.join(folder, "words.txt")
    with open(text, "w") as f:
        f.write("\n".join(f"a {c} {s} on a {b} background photo {n}" for c in ("red", "green", "blue")
                          for s in ("circle", "square") for b in ("blue", "white") for n in ("1", "22")))
    sentencepiece.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(slow, "spiece"), vocab_size=48,
                                             model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                             hard_vocab_limit=False, minloglevel=2)
    os.remove(os.path.join(slow, "spiece.vocab"))
    config = {"model_max_length": 64, "tokenizer_class": "T5Tokenizer"}
    with open(os.path.join(slow, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "extra_ids": 3}, f)
    with open(os.path.join(fast, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    proto = pb.ModelProto()
    with open(os.path.join(slow, "spiece.model"), "rb") as f:
        proto.ParseFromString(f.read())
    assert proto.normalizer_spec.precompiled_charsmap  # the default nmt_nfkc: the map is carried over
    vocab = [[p.piece, p.score] for p in proto.pieces] + [[f"<extra_id_{i}>", 0.0] for i in (2, 1, 0)]
    special = [(i, p.piece) for i, p in enumerate(proto.pieces) if p.type in (2, 3)] + [
        (len(proto.pieces) + 2 - i, f"<extra_id_{i}>") for i in range(3)]
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in sorted(special)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Precompiled",
             "precompiled_charsmap": base64.b64encode(proto.normalizer_spec.precompiled_charsmap).decode()},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                                                     {"SpecialToken": {"id": "</s>", "type_id": 0}}]},
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 2, "vocab": vocab, "byte_fallback": False},
    }
    with open(os.path.join(fast, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    return slow, fast


def test_a_t5_tokenizer_saved_as_tokenizer_json_alone_tokenizes_as_its_spiece_model(tmp_path):
    slow, fast = write_t5_tokenizers(str(tmp_path))
    assert set(os.listdir(fast)) == {"tokenizer.json", "tokenizer_config.json"}
    expected, read = load_text_tokenizer(T5, slow), load_text_tokenizer(T5, fast)
    assert len(read) == len(expected) and read.model_max_length == 64
    for prompt in PROMPTS + ["<extra_id_1> a red circle"]:
        ids = read(prompt, max_length=16, padding="max_length", truncation=True)["input_ids"]
        np.testing.assert_array_equal(ids, expected(prompt, max_length=16, padding="max_length",
                                                    truncation=True)["input_ids"])
    assert read.convert_tokens_to_ids("<extra_id_0>") == len(read) - 1


def test_the_tokenizer_json_written_of_a_spiece_model_is_transformers_and_reads_back_as_it(tmp_path):
    """What an export writes beside spiece.model for a library without sentencepiece (`t5_tokenizer_json`): the model,
    special tokens and character map transformers' converter writes (the rest as transformers 5 writes it, which
    tests/reference/check_t5_tokenizer_json.py found byte-equal and tokenizing as SentencePiece:
    tests/fixtures/t5_tokenizer_json.json), and read alone it tokenizes as the spiece.model."""
    from ldm.models.text import t5_tokenizer_json

    slow, fast = write_t5_tokenizers(str(tmp_path))
    written = t5_tokenizer_json(slow)
    with open(os.path.join(fast, "tokenizer.json"), encoding="utf-8") as f:
        converted = json.load(f)
    assert written["model"] == converted["model"] and written["added_tokens"] == converted["added_tokens"]
    assert written["normalizer"] == converted["normalizer"]["normalizers"][0]
    assert written["post_processor"]["single"] == converted["post_processor"]["single"]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "tokenizer.json").write_text(json.dumps(written, ensure_ascii=False), encoding="utf-8")
    expected, read = load_text_tokenizer(T5, slow), load_text_tokenizer(T5, str(alone))
    for prompt in PROMPTS:
        assert read(prompt)["input_ids"] == expected(prompt)["input_ids"]
    with open(os.path.join(ROOT, "tests", "fixtures", "t5_tokenizer_json.json")) as f:
        checked = json.load(f)
    assert checked["equals_the_file_transformers_writes"] and checked["tokenizers_ids_equal_sentencepiece"]
    assert checked["transformers_reading_tokenizer_json_alone_equal_sentencepiece"]


def test_a_t5_tokenizer_json_that_is_not_sentencepiece_is_refused_in_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []}}))
    with pytest.raises(TextEncoderError) as e:
        load_text_tokenizer(T5, str(tmp_path))
    assert "\n" not in str(e.value) and "a BPE model" in str(e.value) and "spiece.model" in str(e.value)


@pytest.mark.parametrize("named", [True, False], ids=["architectures", "weights-only"])
def test_a_clip_text_model_with_projection_gives_its_states_and_its_projected_pooled_vector(tmp_path, named):
    """SDXL's and SD3's CLIP encoders (`CLIPTextModelWithProjection`), known by their config's architectures or by
    `text_projection.weight` in their weights: the states are the last hidden ones, as CLIPTextModel's on the same
    weights; the pooled vector is the EOS token's state projected."""
    import paddle
    from interop_models import fill_seeded
    from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from ldm.models.build import PRESETS_DIR, load_frozen_text_encoder, read_config
    from ldm.models.text import CLIP, encode_prompt
    from ldm.models.torch_layout import save_torch_layout

    config = {**read_config(PRESETS_DIR / "sd-tiny" / "text_encoder"), "projection_dim": 24}
    config.pop("architectures")
    model = CLIPTextModelWithProjection(CLIPTextConfig(**config))
    fill_seeded(model, 5)
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    save_torch_layout(model, str(folder), "model.safetensors")
    named_config = {**config, "architectures": ["CLIPTextModelWithProjection"]} if named else config
    (folder / "config.json").write_text(json.dumps(named_config))
    loaded, pretrained = load_frozen_text_encoder(CLIP, str(folder))
    assert type(loaded).__name__ == "CLIPTextModelWithProjection" and pretrained
    plain = CLIPTextModel(CLIPTextConfig(**config))
    plain.set_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("text_model.")})
    ids = paddle.to_tensor([[599, 5, 6, 7, 600, 600]])
    encoded = encode_prompt(loaded, ids)
    states, mask = encoded.states, encoded.mask
    assert mask is None and states.shape == [1, 6, 32]
    np.testing.assert_allclose(states.numpy(), plain(ids)[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(encoded.pooled.numpy(), (plain(ids)[1] @ model.text_projection.weight).numpy(),
                               rtol=1e-5)
    assert encode_prompt(plain, ids).pooled is None
