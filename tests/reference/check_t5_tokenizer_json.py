"""Checks the `tokenizer.json` the export writes beside a T5 tokenizer's spiece.model
(`ldm.models.text.t5_tokenizer_json`) against transformers 5 and SentencePiece, on a Unigram model with a
normalizer (NFKC's precompiled character map) and T5's 100 extra ids, as real T5 tokenizers are (the tiny presets'
are BPE without one; tests/reference/run_model_cards.py covers those). Runs in the reference virtualenv, which has
sentencepiece:

    /work/refvenv/bin/python tests/reference/check_t5_tokenizer_json.py

Writes tests/fixtures/t5_tokenizer_json.json: whether the file equals the one transformers 5 writes for the same
spiece.model, and whether `tokenizers` reading it and transformers' T5Tokenizer reading it alone (no spiece.model)
give SentencePiece's ids for a set of prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "t5_tokenizer_json.json")
PROMPTS = ["a red circle on a blue background", "  two  spaces and a trailing one ", "ｆｕｌｌ ｗｉｄｔｈ and café",
           "a photo of 22 squares, green; blue!", "", "unknown ✓ glyph", "a line\nbreak"]
CORPUS = [f"{a} {b} {c}" for a in ("a", "the", "an", "photo", "café", "ｆｕｌｌ")
          for b in ("red", "green", "blue", "circle", "square", "22")
          for c in ("on a background", "of squares", "circle, green; blue!")]


def main() -> None:
    import sentencepiece
    import tokenizers
    import transformers

    project_python = os.path.join(ROOT, ".venv", "bin", "python")
    with tempfile.TemporaryDirectory() as work:
        text = os.path.join(work, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write("\n".join(CORPUS))
        source = os.path.join(work, "t5")
        os.makedirs(source)
        sentencepiece.SentencePieceTrainer.train(
            input=text, model_prefix=os.path.join(source, "spiece"), vocab_size=36, model_type="unigram", pad_id=0,
            eos_id=1, unk_id=2, bos_id=-1, normalization_rule_name="nmt_nfkc", num_threads=1, minloglevel=2)
        os.remove(os.path.join(source, "spiece.vocab"))
        with open(os.path.join(source, "tokenizer_config.json"), "w") as f:
            json.dump({"extra_ids": 100, "model_max_length": 77, "tokenizer_class": "T5Tokenizer"}, f)
        ours = os.path.join(work, "ours.json")
        subprocess.run([project_python, "-c", "import json, sys; from ldm.models.text import t5_tokenizer_json; "
                        "json.dump(t5_tokenizer_json(sys.argv[1]), open(sys.argv[2], 'w'), ensure_ascii=False)",
                        source, ours], check=True, cwd=ROOT, capture_output=True)
        theirs_folder = os.path.join(work, "theirs")
        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(theirs_folder)
        with open(ours, encoding="utf-8") as f:
            written = json.load(f)
        with open(os.path.join(theirs_folder, "tokenizer.json"), encoding="utf-8") as f:
            transformers_file = json.load(f)
        alone = os.path.join(work, "alone")  # the tokenizer.json without spiece.model, as a plain install reads it
        os.makedirs(alone)
        shutil.copy(ours, os.path.join(alone, "tokenizer.json"))
        shutil.copy(os.path.join(source, "tokenizer_config.json"), alone)
        processor = sentencepiece.SentencePieceProcessor(model_file=os.path.join(source, "spiece.model"))
        fast = tokenizers.Tokenizer.from_file(ours)
        read_alone = transformers.T5Tokenizer.from_pretrained(alone)
        expected = {p: processor.encode(p) + [1] for p in PROMPTS}
        by_tokenizers = {p: fast.encode(p).ids for p in PROMPTS}
        by_transformers = {p: read_alone(p).input_ids for p in PROMPTS}
        result = {
            "model": "SentencePiece Unigram, 36 pieces, nmt_nfkc (precompiled character map), extra_ids 100",
            "versions": {m.__name__: m.__version__ for m in (transformers, tokenizers, sentencepiece)},
            "equals_the_file_transformers_writes": written == transformers_file,
            "differing_keys": sorted(k for k in transformers_file if written.get(k) != transformers_file[k]),
            "tokenizers_ids_equal_sentencepiece": by_tokenizers == expected,
            "transformers_reading_tokenizer_json_alone_equal_sentencepiece": by_transformers == expected,
            "ids": {p: {"sentencepiece": expected[p], "tokenizers": by_tokenizers[p],
                        "transformers_alone": by_transformers[p]} for p in PROMPTS},
        }
    with open(FIXTURE, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "ids"}, indent=1))


if __name__ == "__main__":
    main()
