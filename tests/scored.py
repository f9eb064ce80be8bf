"""`python -m ldm.evaluate run` on a tiny model, as the family tests call it: FID against statistics of their corpus
(`stats`) with the seeded Inception of `eval_weights`, and the CLIP score of the tiny CLIP fixture. It runs in the
test's process (`ldm.evaluate.main`), so it costs no interpreter start."""

from __future__ import annotations

import json
from pathlib import Path

import eval_weights as ew
import numpy as np
from safetensors.numpy import save_file

CLIP = Path(__file__).resolve().parent / "fixtures" / "eval" / "tiny-clip"


def fid_and_clip_score(model, listing: str, out: Path) -> dict:
    """The scores of 2 samples of `model` (a checkpoint or an exported pipeline) at guidance 3, 2 steps, against
    the 32 px statistics of the corpus `listing`; each is checked to be a number."""
    from ldm.evaluate import main as evaluate

    out.mkdir()
    weights, reference, prompts = out / "inception.safetensors", out / "reference.npz", out / "prompts.txt"
    save_file(ew.random_inception(), str(weights))
    prompts.write_text("a red circle\n")
    assert evaluate(["stats", "--file_list", listing, "--resolution", "32", "--inception", str(weights),
                     "--output", str(reference)]) == 0
    assert evaluate(["run", "--model", str(model), "--prompts", str(prompts), "--num_samples", "2", "--batch_size",
                     "2", "--guidance_scale", "3", "--num_inference_steps", "2", "--inception", str(weights),
                     "--reference", str(reference), "--clip", str(CLIP), "--output_dir", str(out / "run")]) == 0
    scores = json.loads((out / "run" / "results.json").read_text())["results"][0]
    assert scores["samples"] == 2 and np.isfinite(scores["fid"]) and 0 <= scores["clip_score"] <= 100, scores
    return scores
