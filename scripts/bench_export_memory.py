"""Peak host memory an export adds, against the pipeline's weights, for a full-size preset (no training run: the
state of one would not fit beside other jobs on a 24 GiB machine).

    .venv/bin/python scripts/bench_export_memory.py [--preset ldm-12layer] [--format ppdiffusers] [--work_dir DIR]

Writes the preset's pipeline (fresh weights, ppdiffusers' layout) in a process of its own, then exports it with
`ldm.inference.export.export_checkpoint` (what `python -m ldm.export` and a run's end call: load, EMA, write) in
another, whose peak resident memory (VmHWM, reset before the call: tests/host_memory.py) less what it held before
is "added".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
GIB = 2**30


def make(preset: str, folder: str) -> None:
    from interop_models import WORDS

    from ldm.data.tokenize import load_tokenizer, write_vocab
    from ldm.inference.export import export_pipeline
    from ldm.models.build import build_components

    write_vocab(WORDS, os.path.join(folder, "vocab"))
    tokenizer = load_tokenizer(os.path.join(folder, "vocab"), 77)
    c = build_components(preset, vocab_size=tokenizer.vocab_size, model_max_length=77)
    export_pipeline(c.unet, c.text_encoder, c.vae, tokenizer, dict(c.noise_scheduler.config),
                    os.path.join(folder, "pipeline"))


def export(folder: str, layout: str) -> None:
    from host_memory import peak_added

    from ldm.inference.export import export_checkpoint

    source, start = os.path.join(folder, "pipeline"), time.perf_counter()
    _, added = peak_added(export_checkpoint, source, os.path.join(folder, f"exported-{layout}"), True,
                          layout == "diffusers")
    weights = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(source) for name in names
                  if name.endswith(".safetensors"))
    print(f"{layout}: {added / GIB:.2f} GiB added at the peak for {weights / GIB:.2f} GiB of weights "
          f"({added / weights:.2f}x), {time.perf_counter() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ldm-12layer")
    parser.add_argument("--format", choices=("ppdiffusers", "diffusers"), default="ppdiffusers")
    parser.add_argument("--work_dir", default=None)
    parser.add_argument("--stage", choices=("make", "export"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-export-memory-")
    if args.stage == "make":
        return make(args.preset, work)
    if args.stage == "export":
        return export(work, args.format)
    if not os.path.isdir(os.path.join(work, "pipeline")):
        subprocess.run([sys.executable, __file__, "--stage", "make", "--preset", args.preset, "--work_dir", work],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([sys.executable, __file__, "--stage", "export", "--format", args.format, "--work_dir", work],
                   check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
