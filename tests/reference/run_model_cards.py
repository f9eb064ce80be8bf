"""Runs the diffusers snippet of the model card (README.md) of every family and objective the project exports to
diffusers' layout, in the virtualenv it is started with; records what happened in
tests/fixtures/model_cards.json, which tests/test_inference_export.py checks against what the export does now:

    /work/refvenv/bin/python tests/reference/run_model_cards.py         # torch, diffusers, transformers, sentencepiece
    /work/refvenv-plain/bin/python tests/reference/run_model_cards.py   # torch, diffusers, transformers alone
    /work/refvenv/bin/python tests/reference/run_model_cards.py sdxl-tiny   # these presets' entries alone, renewed

Each model is the seeded tiny preset with the noise schedule of `--prediction_type P` (flow matching:
`--flow_shift 3`), built in the project's venv (tests/interop_models.py --objective) and exported by the real
`python -m ldm.export --format diffusers`; an export that refuses is recorded with its one line. The snippet runs as
the card prints it, with only THIS_FOLDER replaced, in a process of its own. The fixture keeps one entry per kind of
virtualenv (with or without sentencepiece), the sha256 of each exported `tokenizer.json`, and the versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "model_cards.json")
PRESETS = ("ldm-tiny", "sd-tiny", "pixart-tiny", "sd3-tiny", "sdxl-tiny")
OBJECTIVES = ("epsilon", "v_prediction", "flow_matching")
# what the snippet prints after it ran: the image's size, so a run that made no image is not taken for one that did
REPORT = '\nprint("IMAGE", image.size)\n'


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def diffusers_snippet(card: str) -> str:
    """The card's first python block: its diffusers snippet (`ldm.inference.model_card.loading_lines`)."""
    return re.search(r"```python\n(.*?)```", card, re.S).group(1)


def run_card(folder: str) -> dict:
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        snippet = diffusers_snippet(f.read()).replace("THIS_FOLDER", folder)
    done = subprocess.run([sys.executable, "-c", snippet + REPORT], capture_output=True, text=True, cwd=folder)
    found = re.search(r"^IMAGE \((\d+), (\d+)\)$", done.stdout, re.M)
    if done.returncode == 0 and found:
        return {"snippet": "ran", "image": [int(found.group(1)), int(found.group(2))]}
    return {"snippet": "failed", "error": last_line(done.stderr)}


def tokenizer_digests(folder: str) -> dict:
    return {os.path.relpath(path, folder): hashlib.sha256(Path(path).read_bytes()).hexdigest()
            for path in sorted(os.path.join(root, "tokenizer.json") for root, _, files in os.walk(folder)
                               if "tokenizer.json" in files)}


def check(preset: str, objective: str, work: str, project_python: str) -> dict:
    subprocess.run([project_python, os.path.join(ROOT, "tests", "interop_models.py"), work, "--objective", preset,
                    objective], check=True, cwd=ROOT, capture_output=True)
    output = os.path.join(work, "diffusers")
    export = subprocess.run([project_python, "-m", "ldm.export", "--checkpoint", os.path.join(work, "ppdiffusers"),
                             "--output", output, "--format", "diffusers"], cwd=ROOT, capture_output=True, text=True)
    if export.returncode != 0:
        return {"export": "refused", "reason": last_line(export.stderr)}
    return {"export": "written", "tokenizer_json_sha256": tokenizer_digests(output), **run_card(output)}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "diffusers", "transformers", "tokenizers", "sentencepiece", "protobuf"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    project_python = os.path.join(ROOT, ".venv", "bin", "python")
    found = versions()
    kind = "with sentencepiece" if found["sentencepiece"] else "without sentencepiece"
    presets = sys.argv[1:] or PRESETS
    fixture = {}
    if os.path.isfile(FIXTURE):
        with open(FIXTURE) as f:
            fixture = json.load(f)
    # the other presets' entries kept, when only some are run again
    results = fixture.get(kind, {}).get("results", {}) if sys.argv[1:] else {}
    for preset in presets:
        for objective in OBJECTIVES:
            with tempfile.TemporaryDirectory() as work:
                results[f"{preset} {objective}"] = check(preset, objective, work, project_python)
            print(preset, objective, json.dumps(results[f"{preset} {objective}"]), flush=True)
    fixture[kind] = {"versions": found, "results": results}
    with open(FIXTURE, "w") as f:
        json.dump(fixture, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
