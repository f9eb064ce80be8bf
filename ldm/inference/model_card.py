"""The model card (`README.md`) of an exported pipeline: what the model is, what it was trained on and for how
long, where it came from, how it scored and how to load it, from what the run recorded (the checkpoint's
`run_config.json` and `training_state.json`, the run folder's `run.json` and `metrics.jsonl`). What a source does
not record is said to be unknown rather than left out, so a reader can tell "not measured" from "forgotten"."""

from __future__ import annotations

import json
import os

from ldm.checkpoint.run_folder import RUN_CONFIG
from ldm.inference.sampling import sampling_scheduler
from ldm.models.families import family_of
from ldm.models.noise import is_flow, prediction_type_of
from ldm.models.text import describe_text_encoder
from ldm.runtime.files import read_json_object
from ldm.runtime.tracking import METRICS_FILE, metrics_records

UNKNOWN = "not recorded where this was exported from"


def last_scores(run_folder: str) -> dict[str, tuple[int, float]]:
    """The last FID and CLIP score of a run's metrics.jsonl: {name: (step, value)}."""
    found = {}
    try:
        for record in metrics_records(os.path.join(run_folder, METRICS_FILE)):
            for name in ("eval/fid", "eval/clip_score"):
                if isinstance(record.get(name), int | float):  # null: not finite at that evaluation
                    found[name] = (int(record["step"]), float(record[name]))
    except OSError:
        pass
    return found


def training_record(source: str) -> dict:
    """What a checkpoint or a run's exported pipeline records of its training."""
    run_folder = os.path.dirname(os.path.abspath(source))
    run = read_json_object(os.path.join(run_folder, "run.json"))
    config = read_json_object(os.path.join(source, RUN_CONFIG)) or run
    samples = read_json_object(os.path.join(source, "training_state.json")).get("samples") or {}
    return {"config": config, "samples": samples, "scores": last_scores(run_folder) if run else {},
            "run_folder": run_folder if run else None}


def _parameters(model) -> str:
    return f"{sum(int(p.numel()) for p in model.parameters()) / 1e6:.2f} M parameters"


def _training_lines(record: dict) -> list[str]:
    config, samples = record["config"], record["samples"]
    arguments = config.get("arguments", {})
    data, model_args = arguments.get("DataArguments", {}), arguments.get("ModelArguments", {})
    lineage, git = config.get("lineage"), config.get("git") or {}
    return [
        f"- data (file lists): {data.get('file_list', '?')}",
        f"- resolution: {data.get('resolution', '?')}; caption dropout {data.get('caption_dropout_prob', '?')}",
        f"- updates: {samples.get('updates', config.get('step', '?'))}; samples seen: {samples.get('samples', '?')}",
        f"- started from: {model_args.get('model_name_or_path', '?')}"
        + (f" (autoencoder {model_args['vae_name_or_path']})" if model_args.get("vae_name_or_path") else ""),
        f"- lineage: {json.dumps(lineage) if lineage else 'a first stage (no --init_from_checkpoint)'}",
        f"- run: {record['run_folder'] or '?'}, created {config.get('created', '?')}, git commit "
        f"{git.get('commit', '?')}{' (uncommitted changes)' if git.get('dirty') else ''}",
    ]


def schedule_line(scheduler_config: dict) -> str:
    if is_flow(scheduler_config):
        return (f"- noise schedule: rectified flow (x_t = (1 - sigma) x_0 + sigma noise), shift "
                f"{scheduler_config.get('shift')}, timestep 1000 sigma; sampled with FlowMatchEulerDiscreteScheduler")
    return (f"- noise schedule: {scheduler_config.get('beta_schedule')} betas {scheduler_config.get('beta_start')} to "
            f"{scheduler_config.get('beta_end')} over {scheduler_config.get('num_train_timesteps')} steps; sampled "
            f"with {type(sampling_scheduler(scheduler_config)).__name__}")


def model_card(source: str, unet, text_encoder, vae, scheduler_config: dict, used_ema: bool,
               origin: str | None = None, tokens: int | None = None) -> str:
    """`origin`: what the weights were converted from, when they were not trained here; `tokens`: the caption length
    it was trained with (default: the text encoder's positions)."""
    record = training_record(source)
    made = f"converted from {origin}" if origin else "trained with ldm-laion (PaddlePaddle)"
    config, scores = record["config"], record["scores"]
    v, family = vae.config, family_of(unet, text_encoder)
    pipeline_class = family.pipeline_class
    text_line = describe_text_encoder(text_encoder, tokens)
    backbone_line = f"- {family.describe_backbone(unet)}, predicts {prediction_type_of(scheduler_config)}"
    score_lines = [f"- {name.split('/')[1]} {value:.4g} (held-out evaluation at update {step})"
                   for name, (step, value) in sorted(scores.items())] or ["- FID, CLIP score: not measured during "
                                                                          "training (`python -m ldm.evaluate run`)"]
    lines = [
        "---", "library_name: diffusers", "pipeline_tag: text-to-image", "tags: [latent-diffusion, text-to-image]",
        "---", "", "# Text-to-image latent diffusion model", "",
        f"A `{pipeline_class}` {made} and exported in diffusers' layout: PyTorch safetensors for the "
        f"{family.backbone_folder}, the text encoder and the KL autoencoder.", "",
        "## Architecture", "",
        backbone_line,
        text_line,
        f"- AutoencoderKL (frozen): {_parameters(vae)}, channels {list(v.block_out_channels)}, "
        f"{v.latent_channels} latent channels, scaling factor {v.scaling_factor}",
        schedule_line(scheduler_config),
        f"- weights: {'the EMA average' if used_ema else 'the trained weights (no EMA)'}", "",
        "## Training", "", *(_training_lines(record) if config else [f"- {UNKNOWN}"]), "",
        "## Evaluation", "", *score_lines, "",
        "## Loading", "", *family.loading_lines(tokens),
    ]
    return "\n".join(lines)
