"""The pinned stack imports together, and the shipped file lists are the original ones."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stack_imports_in_a_fresh_interpreter():
    code = "import paddle, paddlenlp, ppdiffusers, visualdl, fastcore, PIL, ldm; print(paddle.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("3.")


def test_shipped_filelists():
    lines = (ROOT / "data/filelist/laion400m_en.filelist").read_text().split()
    assert lines == [f"/data/laion400m/part-{i:05d}.gz" for i in range(10)]
    assert (ROOT / "data/filelist/train.filelist.list").read_text().split() == ["./data/filelist/laion400m_en.filelist"]
