"""How far the update's forms end apart, as fractions of the bound the arithmetic gives (docs/numerics.md).

    .venv/bin/python scripts/compare_forms.py [--updates 4] [--second_rounding MKL_CBWR=AVX2]

Trains ldm-tiny (batch 2, accumulation 2, learning rate 1e-3, clip 0.05, EMA) for `--updates` updates with
`--flat_update` fused, on and off, resumes each form's half-way checkpoint in the other form, and, with
`--second_rounding`, runs the per-tensor form again with that environment (another rounding of every matrix product:
a stand-in for another kind of CPU). Prints, for each pair, the largest difference of any weight, EMA average or
AdamW state as a fraction of tests/tolerance.py's bound (1 = the bound), and the tensor where it is.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from corpus import write_corpus  # noqa: E402
from entry import checkpoint_state  # noqa: E402
from tolerance import training_differences  # noqa: E402

from ldm.data.tokenize import write_vocab  # noqa: E402

LEARNING_RATE = 1e-3


def train(folder: str, data: list[str], updates: int, form: str, env: dict, *extra: str) -> str:
    args = [*data, "--max_train_steps", str(updates), "--flat_update", form, "--output_dir", folder, *extra]
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train_txt2img_laion400m_no_trainer.py"), *args],
                          capture_output=True, text=True, env={**os.environ, **env})
    if done.returncode != 0:
        sys.exit(f"{folder}: the run failed:\n{done.stderr[-3000:]}")
    return os.path.join(folder, f"checkpoint-{updates}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--second_rounding", default="", help="VAR=VALUE for one more per-tensor run")
    parser.add_argument("--keep", default="", help="a folder to keep the runs in (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.updates < 2 or args.updates % 2:
        parser.error("--updates must be an even number of at least 2 (a resume starts half-way)")
    work = args.keep or tempfile.mkdtemp(prefix="compare-forms-")
    os.makedirs(work, exist_ok=True)
    write_vocab(["a", "the", "photo", "of", "red", "green", "blue", "circle", "square", "on"], f"{work}/vocab")
    listing = write_corpus(f"{work}/corpus", num_records=24, records_per_shard=8, kinds=("jpeg",))
    data = ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", f"{work}/vocab", "--model_max_length", "16", "--resolution", "32",
            "--train_batch_size", "2", "--gradient_accumulation_steps", "2", "--save_steps", str(args.updates // 2),
            "--num_workers", "0", "--learning_rate", str(LEARNING_RATE), "--max_grad_norm", "0.05", "--use_ema",
            "--report_to", "none", "--progress", "none", "--seed", "3"]
    runs = {form: train(f"{work}/{form}", data, args.updates, form, {}) for form in ("fused", "on", "off")}
    for source, form in (("fused", "off"), ("off", "fused")):
        folder = f"{work}/{source}-then-{form}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(f"{work}/{source}", folder, ignore=shutil.ignore_patterns(
            f"checkpoint-{args.updates}", "pipeline"))
        runs[f"{source} then {form}"] = train(folder, data, args.updates, form, {}, "--resume_from_checkpoint",
                                              "latest")
    if args.second_rounding:
        name, _, value = args.second_rounding.partition("=")
        runs[f"off, {args.second_rounding}"] = train(f"{work}/second", data, args.updates, "off", {name: value})
    states = {name: checkpoint_state(checkpoint) for name, checkpoint in runs.items()}
    print(f"{args.updates} updates of ldm-tiny at learning rate {LEARNING_RATE:g}: the largest difference as a "
          "fraction of the bound")
    for a, b in itertools.combinations(states, 2):
        fractions = training_differences(states[a], states[b], LEARNING_RATE, args.updates)
        worst = max(fractions, key=fractions.get)
        print(f"  {a:>24} vs {b:<24} {fractions[worst]:8.4f}  ({worst})")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
