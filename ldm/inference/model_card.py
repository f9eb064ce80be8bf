"""The model card (`README.md`) of an exported pipeline: what the model is, what it was trained on and for how
long, where it came from, how it scored and how to load it, from what the run recorded (the checkpoint's
`run_config.json` and `training_state.json`, the run folder's `run.json` and `metrics.jsonl`). What a source does
not record is said to be unknown rather than left out, so a reader can tell "not measured" from "forgotten"."""

from __future__ import annotations

import json
import os

from ldm.checkpoint.run_folder import RUN_CONFIG
from ldm.inference.sampling import sampling_scheduler
from ldm.models.backbone import describe_backbone, pipeline_class_name
from ldm.models.backbone import family_of as family_of_backbone
from ldm.models.noise import is_flow, prediction_type_of
from ldm.models.text import LDMBERT, family_of
from ldm.runtime.tracking import METRICS_FILE, metrics_records

UNKNOWN = "not recorded where this was exported from"


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


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
    run = _json(os.path.join(run_folder, "run.json"))
    config = _json(os.path.join(source, RUN_CONFIG)) or run
    samples = _json(os.path.join(source, "training_state.json")).get("samples") or {}
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
    b, v = text_encoder.config, vae.config
    family = family_of(text_encoder)
    pipeline_class = pipeline_class_name(unet, text_encoder)
    if family is LDMBERT:
        text_line = (f"- LDMBert text encoder: {_parameters(text_encoder)}, {b.encoder_layers} layers of width "
                     f"{b.d_model}, {b.encoder_attention_heads} heads, vocabulary {b.vocab_size}, "
                     f"{b.max_position_embeddings} tokens")
    elif family.name == "clip":
        length = tokens or b.max_position_embeddings
        text_line = (f"- CLIP text encoder: {_parameters(text_encoder)}, "
                     f"{b.num_hidden_layers} layers of width {b.hidden_size}, {b.num_attention_heads} heads, "
                     f"vocabulary {b.vocab_size}, {b.max_position_embeddings} positions, prompts of {length} tokens")
    elif family.name == "sd3":
        clip_l, clip_g, t5 = (e.config for e in text_encoder.encoders)
        text_line = (f"- Stable Diffusion 3's text encoders (frozen): {_parameters(text_encoder)}; CLIP-L "
                     f"{clip_l.num_hidden_layers} layers of width {clip_l.hidden_size} and CLIP-G "
                     f"{clip_g.num_hidden_layers} layers of width {clip_g.hidden_size}, both with projections (pooled "
                     f"{b.projection_dim}), T5 {t5.num_layers} layers of width {t5.d_model}; prompts of {tokens} "
                     "tokens for each")
    else:
        text_line = (f"- T5 text encoder (frozen): {_parameters(text_encoder)}, {b.num_layers} layers of width "
                     f"{b.d_model}, {b.num_heads} heads, vocabulary {b.vocab_size}, prompts of {tokens} tokens, "
                     "padding masked")
    backbone_line = f"- {describe_backbone(unet)}, predicts {prediction_type_of(scheduler_config)}"
    score_lines = [f"- {name.split('/')[1]} {value:.4g} (held-out evaluation at update {step})"
                   for name, (step, value) in sorted(scores.items())] or ["- FID, CLIP score: not measured during "
                                                                          "training (`python -m ldm.evaluate run`)"]
    lines = [
        "---", "library_name: diffusers", "pipeline_tag: text-to-image", "tags: [latent-diffusion, text-to-image]",
        "---", "", "# Text-to-image latent diffusion model", "",
        f"A `{pipeline_class}` {made} and exported in diffusers' layout: PyTorch safetensors for the "
        f"{family_of_backbone(unet).folder}, the text encoder and the KL autoencoder.", "",
        "## Architecture", "",
        backbone_line,
        text_line,
        f"- AutoencoderKL (frozen): {_parameters(vae)}, channels {list(v.block_out_channels)}, "
        f"{v.latent_channels} latent channels, scaling factor {v.scaling_factor}",
        schedule_line(scheduler_config),
        f"- weights: {'the EMA average' if used_ema else 'the trained weights (no EMA)'}", "",
        "## Training", "", *(_training_lines(record) if config else [f"- {UNKNOWN}"]), "",
        "## Evaluation", "", *score_lines, "",
        "## Loading", "", *loading_lines(pipeline_class, tokens),
    ]
    return "\n".join(lines)


PROMPT = '"a red circle on a blue background"'
LDM_GENERATE = ["```bash", f"python -m ldm.generate --model THIS_FOLDER --prompt {PROMPT}",
                "python -m ldm.export --checkpoint THIS_FOLDER --output PADDLE_FOLDER   # ppdiffusers' own layout",
                "```", ""]


def loading_lines(pipeline_class: str, tokens: int | None) -> list[str]:
    """How the exported folder loads, in diffusers and in ppdiffusers, for its pipeline class: what each library's
    pipeline does with the caption length, and what it cannot read. (A flow-matching model is exported for diffusers
    only where its pipeline steps the sampler: `ldm.inference.export.check_diffusers_sampler`.)"""
    def diffusers(call: str) -> list[str]:
        return ["```python", f"from diffusers import {pipeline_class}", "",
                f'pipeline = {pipeline_class}.from_pretrained("THIS_FOLDER")', f"image = pipeline({call}).images[0]",
                "```", ""]

    if pipeline_class == "LDMTextToImagePipeline":
        return ["diffusers (PyTorch; its pipeline gives the text encoder 77 tokens, which this one reads: ldm-laion "
                "refuses to export a model of fewer for diffusers):", "",
                *diffusers(f"{PROMPT}, num_inference_steps=50"),
                "ppdiffusers (PaddlePaddle), with ldm-laion, which reads this layout (ppdiffusers' own "
                "`from_pretrained(..., from_diffusers=True)` fails for the LDMBert text encoder in 0.29):", "",
                *LDM_GENERATE]
    length = f"{tokens} tokens" if tokens else "its tokenizer's `model_max_length`"
    if pipeline_class == "PixArtAlphaPipeline":
        call = (f"{PROMPT}, num_inference_steps=20, {f'max_sequence_length={tokens}, ' if tokens else ''}"
                "use_resolution_binning=False, clean_caption=False")
        return ["diffusers (PyTorch). The pipeline pads prompts to `max_sequence_length` (120 unless given): this "
                f"model was trained on {length} (the T5's padding is masked, so the length only bounds a prompt); "
                "`use_resolution_binning=False` samples at sizes other than its bins, `clean_caption=False` needs no "
                "`bs4` or `ftfy`:", "", *diffusers(call),
                "ppdiffusers (PaddlePaddle) reads this layout (its pipeline pads prompts to 120 tokens, whatever the "
                "model; call it without `max_sequence_length`):", "", "```python",
                "from ppdiffusers import PixArtAlphaPipeline", "",
                'pipeline = PixArtAlphaPipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)', "```", "",
                "ldm-laion samples and converts it too:", "", *LDM_GENERATE]
    if pipeline_class == "StableDiffusion3Pipeline":
        call = f"{PROMPT}, num_inference_steps=28{f', max_sequence_length={tokens}' if tokens else ''}"
        return ["diffusers (PyTorch). The pipeline pads the CLIP prompts to the tokenizers' `model_max_length` "
                f"and T5's to `max_sequence_length` (256 unless given): this model was trained on {length} for each "
                "(T5's padding is not masked in SD3, so pass its length):", "", *diffusers(call),
                "ppdiffusers (PaddlePaddle) reads this layout (its pipeline pads every prompt to the first "
                "tokenizer's `model_max_length`, as trained):", "", "```python",
                "from ppdiffusers import StableDiffusion3Pipeline", "",
                'pipeline = StableDiffusion3Pipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)', "```", "",
                "ldm-laion samples and converts it too:", "", *LDM_GENERATE]
    return [f"diffusers (PyTorch). The pipeline pads prompts to the tokenizer's `model_max_length` ({length}), the "
            "caption length this model was trained with; it loads without a safety checker:", "",
            *diffusers(f"{PROMPT}, num_inference_steps=50"),
            "ppdiffusers (PaddlePaddle), with ldm-laion, which reads this layout and writes ppdiffusers' own, which "
            "ppdiffusers' `StableDiffusionPipeline.from_pretrained` loads:", "", *LDM_GENERATE]
