"""The pinned stack imports together, and the shipped list of file lists names what is shipped."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stack_imports_in_a_fresh_interpreter():
    code = "import paddle, paddlenlp, ppdiffusers, visualdl, fastcore, PIL, ldm; print(paddle.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("3.")


def test_shipped_list_of_filelists_names_a_shipped_filelist(monkeypatch):
    """The README's commands use data/filelist/train.filelist.list from the repository root. The filelist it
    names is the one `python write_filelist.py` rewrites, so its lines are not pinned here."""
    from ldm.data.filelist import read_file_list

    monkeypatch.chdir(ROOT)
    assert read_file_list("data/filelist/train.filelist.list")  # raises FileListError when it names nothing
