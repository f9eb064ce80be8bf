import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory):
    """A local WordPiece vocabulary, so tokenization works offline."""
    from ldm.data.tokenize import write_vocab

    folder = tmp_path_factory.mktemp("tokenizer")
    words = ["a", "an", "the", "photo", "of", "image", "red", "green", "blue", "circle", "square", "on", "background"]
    write_vocab(words, str(folder))
    return str(folder)
