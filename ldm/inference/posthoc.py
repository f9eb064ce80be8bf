"""Post-hoc EMA reconstruction (`python -m ldm.ema reconstruct`): the weights of the power-function EMA of any width
σ_rel at an update, as the weighted sum of a run's EMA snapshots (`ldm.models.posthoc_ema` has the method), written
as a pipeline folder like the run's `pipeline/`.

The snapshots used are those taken at or before the update asked for (later ones hold weights from after it). The
sum runs tensor by tensor over the snapshots, in float64, each snapshot's tensor read alone (`StoredArrays`): beside
the model written out, only one tensor of one snapshot and its running sum are held. The model's other parts (its
configurations, the frozen autoencoder and text encoder, the tokenizer, the noise schedule) are those of the run's
newest complete checkpoint, else of its `pipeline/`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np
import paddle

from ldm.checkpoint.format import SNAPSHOT_RECORD
from ldm.checkpoint.run_folder import CheckpointError, checkpoint_dirs, checkpoint_problem, snapshot_dirs
from ldm.checkpoint.serialization import StoredArrays
from ldm.inference.export import check_output, export_pipeline
from ldm.inference.load import averaged_parameters, is_pipeline, load_for_inference
from ldm.models.posthoc_ema import PosthocEMAError, coefficients, exponent

logger = logging.getLogger("ldm.inference")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One profile of one EMA snapshot: taken at update `step` (its profile's time), of width `sigma_rel`, stored as
    the state `name` in `folder`."""

    step: int
    sigma_rel: float
    folder: str
    name: str


def read_snapshots(run: str) -> list[Snapshot]:
    """Every profile of the complete EMA snapshots of run folder `run`, by step then width; an incomplete snapshot
    (a run killed while writing it, or damaged) is named in a warning and left out."""
    found = []
    for step, folder in snapshot_dirs(run):
        problem = checkpoint_problem(folder, checksums=False)
        if problem is not None:
            logger.warning("skipping the EMA snapshot %s: %s", folder, problem)
            continue
        with open(os.path.join(folder, SNAPSHOT_RECORD)) as f:
            record = json.load(f)
        found += [Snapshot(step, float(p["sigma_rel"]), folder, p["name"]) for p in record["profiles"]]
    return sorted(found, key=lambda s: (s.step, s.sigma_rel))


@dataclasses.dataclass
class Reconstruction:
    """What a reconstruction uses: the snapshots and their coefficients, for profile `sigma_rel` at update `step`."""

    step: int
    sigma_rel: float
    snapshots: list[Snapshot]
    coefficients: np.ndarray

    def as_dict(self) -> dict:
        return {"snapshots": [{"step": s.step, "sigma_rel": s.sigma_rel} for s in self.snapshots],
                "step": self.step, "sigma_rel": self.sigma_rel, "coefficients": [float(c) for c in self.coefficients]}


def plan(run: str, sigma_rel: float, step: int | None = None) -> Reconstruction:
    """The snapshots of `run` at or before update `step` (default: the newest snapshot's) and their coefficients for
    the profile of width `sigma_rel` there. A width no power function has, a run without snapshots or an update with
    none at or before it, or past the newest, is a `PosthocEMAError`."""
    exponent(sigma_rel)  # a width no power function has: refused before anything is read
    snapshots = read_snapshots(run)
    if not snapshots:
        raise PosthocEMAError(f"{run} has no complete EMA snapshot (train with --ema_sigma_rels and "
                              "--ema_snapshot_steps)")
    newest = snapshots[-1].step
    step = newest if step is None else step
    if step > newest:
        raise PosthocEMAError(f"update {step} is past {run}'s newest EMA snapshot (update {newest}): the weights after "
                              "it were never recorded")
    used = [s for s in snapshots if s.step <= step]
    if not used:
        raise PosthocEMAError(f"{run} has no EMA snapshot at or before update {step} (the first is at update "
                              f"{snapshots[0].step})")
    solved = coefficients([s.step for s in used], [s.sigma_rel for s in used], step, sigma_rel)
    return Reconstruction(step, float(sigma_rel), used, solved)


def model_source(run: str) -> str:
    """What the reconstruction takes the model's other parts from: the newest complete checkpoint of `run`, else its
    exported `pipeline/`."""
    for folder in reversed(checkpoint_dirs(run)):
        if checkpoint_problem(folder, checksums=False) is None:
            return folder
    pipeline = os.path.join(run, "pipeline")
    if is_pipeline(pipeline):
        return pipeline
    raise CheckpointError(f"{run} has neither a complete checkpoint nor a pipeline/ to take the model's "
                          "configuration and frozen parts from")


@paddle.no_grad()
def reconstruct(run: str, sigma_rel: float, output: str, step: int | None = None) -> tuple[Reconstruction, str]:
    """The profile of width `sigma_rel` at update `step` (default: the newest snapshot's) of `run`, written to the
    pipeline folder `output`; (what it used, the folder its other parts came from)."""
    check_output(output, run)
    rebuilt = plan(run, sigma_rel, step)
    source = model_source(run)
    unet, text_encoder, vae, tokenizer, scheduler_config, _ = load_for_inference(source, use_ema=False)
    parameters = averaged_parameters(unet, text_encoder)
    stored = [StoredArrays(s.folder, s.name, parameters.__contains__) for s in rebuilt.snapshots]
    keys = stored[0].keys()
    for snapshot, arrays in zip(rebuilt.snapshots, stored, strict=True):
        if arrays.keys() != keys:
            raise CheckpointError(f"the EMA snapshots {rebuilt.snapshots[0].folder} and {snapshot.folder} average "
                                  "different weights: they are not of one run")
    if not keys:
        raise CheckpointError(f"the EMA snapshots of {run} hold no weight of the model of {source}")
    for key in keys:
        total = None
        for weight, arrays in zip(rebuilt.coefficients, stored, strict=True):
            term = weight * arrays.read(key).astype(np.float64)
            total = term if total is None else total + term
        parameter = parameters[key]
        parameter.set_value(paddle.to_tensor(total.astype(np.float32)).astype(parameter.dtype))
    export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config, output)
    return rebuilt, source
