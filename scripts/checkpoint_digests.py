"""Print the sha256 of every file of a run folder's checkpoints, to compare two runs byte for byte.

    python scripts/checkpoint_digests.py OUTPUT_DIR > digests.txt
    diff digests-before.txt digests-after.txt

Run both runs with the same `--output_dir` (move the first away before the second): the folder is recorded.
What differs between two runs of the same code is compared without it (`--exact` compares everything):
`run.json` (the folder's record of starts and hosts); in each checkpoint's `run_config.json` the `created` time,
the `git` commit and PaddleNLP's default `logging_dir` (a time and a host); the times, speeds and save sizes in
PaddleNLP's `trainer_state.json`; and the generators of Python's `random` and numpy in the training state, which
no run seeds (Paddle's generators, which draw the noise, are compared). Those files get a digest of their content
without these entries, marked "(normalised)"; the manifest, which lists their digests, is left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

UNSEEDED = ("numpy", "python")  # generators in each rank's `random` part that no run seeds
TIMED = ("second", "runtime", "tflops", "fraction", "checkpoint/")  # logged times, speeds, save sizes


def canonical(tree) -> bytes:
    def plain(value):
        if hasattr(value, "tobytes"):
            return {"dtype": str(value.dtype), "shape": list(value.shape), "sha256": hashlib.sha256(
                value.tobytes()).hexdigest()}
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value
    return json.dumps(plain(tree), sort_keys=True).encode()


def normalised(checkpoint: str, name: str) -> str | None:
    """The digest of a file's content without what differs between runs of the same code; None: compared whole."""
    if name == "run_config.json":
        with open(os.path.join(checkpoint, name)) as f:
            record = json.load(f)
        record.pop("created", None)
        record.pop("git", None)  # the commit: what a before/after comparison changes
        for group in record.get("arguments", {}).values():
            if isinstance(group, dict):
                group.pop("logging_dir", None)  # PaddleNLP's default names the time and host
        return hashlib.sha256(canonical(record)).hexdigest()
    if name == "trainer_state.json":  # PaddleNLP's: its log history holds the speeds measured
        with open(os.path.join(checkpoint, name)) as f:
            state = json.load(f)
        for entry in state.get("log_history", []):
            for key in [k for k in entry if any(word in k for word in TIMED)]:
                del entry[key]
        return hashlib.sha256(canonical(state)).hexdigest()
    if name == "training_state.json":
        from ldm.checkpoint.format import read_training_state

        state = read_training_state(checkpoint)
        for rank in state.get("random", []):
            for generator in UNSEEDED:
                rank.pop(generator, None)
        return hashlib.sha256(canonical(state)).hexdigest()
    return None


def digests(folder: str, exact: bool) -> list[str]:
    lines = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            relative = os.path.relpath(os.path.join(root, name), folder)
            if not relative.startswith("checkpoint-"):
                continue
            if not exact and name in ("training_state.safetensors", "manifest.json"):
                continue  # in the normalised training state / lists the digests of normalised files
            digest = None if exact else normalised(root, name)
            if digest is not None:
                lines.append(f"{digest}  {relative} (normalised)")
                continue
            with open(os.path.join(root, name), "rb") as f:
                lines.append(f"{hashlib.file_digest(f, 'sha256').hexdigest()}  {relative}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--exact", action="store_true", help="compare every file whole")
    args = parser.parse_args()
    print("\n".join(digests(args.folder, args.exact)))


if __name__ == "__main__":
    main()
