"""Argument groups, defined once and shared by both entry points.

`ModelArguments`, `DataArguments` and `SamplingArguments` are parsed by both scripts; the Trainer
path adds PaddleNLP's `TrainingArguments`, the hand-written loop adds `LoopArguments`. Field names
are the flags of the original documentation; `aliases` adds the other spelling where the two
scripts historically differ (`--pretrained_model_name_or_path`, `--checkpoints_total_limit`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

from ldm.runtime.cli import unknown_flags_message
from ldm.runtime.device import VAE_DTYPES
from ldm.runtime.errors import UserError
from ldm.runtime.home import writable_caches_or_exit

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
MIXED_PRECISION = ("no", "fp16", "bf16")




class ArgumentError(UserError, ValueError):
    """A flag has a value the run cannot use."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def arg(default, help: str, **metadata):
    return field(default=default, metadata={"help": help, **metadata})


def arg_list(default: list, help: str, **metadata):
    return field(default_factory=lambda: list(default), metadata={"help": help, **metadata})


@dataclass
class ModelArguments:
    model_name_or_path: str = arg(
        "ldm-32layer", "preset (ldm-32layer, ldm-12layer, ldm-tiny, sd-1.5, sd-2-base, sd-tiny, pixart-alpha-512, "
        "pixart-alpha-1024, pixart-tiny, pixart-ms-tiny), folder of configs, pipeline folder (ours, or a diffusers "
        "Stable Diffusion or PixArt-alpha one) "
        "or hub name",
        aliases=["--pretrained_model_name_or_path"])
    vae_name_or_path: Optional[str] = arg(None, "pretrained autoencoder: a folder, or a hub name org/repo[/subfolder] "
                                                "(default: the model's vqvae/)")
    allow_untrained_vae: bool = arg(False, "train on an autoencoder that has no trained weights (tests only: its "
                                           "latents are random projections)")
    prediction_type: Optional[str] = arg(None, "epsilon, v_prediction or flow_matching (rectified flow, as Stable "
                                               "Diffusion 3; default: the model source's scheduler, else epsilon)")
    flow_shift: Optional[float] = arg(None, "flow matching: the resolution shift of sigma, sigma' = shift sigma / (1 + "
                                            "(shift - 1) sigma), in training and sampling (default: the model "
                                            "source's flow scheduler's, else 1; SD3 uses 3 at 1024 px)")
    flow_sigma_sampling: str = arg("logit_normal", "flow matching: how sigma is drawn: logit_normal "
                                                   "(--flow_logit_mean, --flow_logit_std), uniform, or mode (SD3's "
                                                   "mode sampling, --flow_mode_scale)")
    flow_logit_mean: float = arg(0.0, "flow matching: the mean of the logit-normal sigma")
    flow_logit_std: float = arg(1.0, "flow matching: the standard deviation of the logit-normal sigma")
    flow_mode_scale: float = arg(1.29, "flow matching: the scale of SD3's mode sampling")
    flow_weighting: str = arg("none", "flow matching: the loss weighting, none, sigma_sqrt or cosmap (diffusers' "
                                      "compute_loss_weighting_for_sd3)")
    noise_offset: float = arg(0.0, "noise offset (0: off)")
    snr_gamma: Optional[float] = arg(None, "min-SNR loss weighting gamma (e.g. 5.0; default off)")
    train_text_encoder: Optional[bool] = arg(None, "train the text encoder with the UNet (default: true for "
                                                   "LDMBert, false for a pretrained CLIP text encoder, which stays "
                                                   "frozen: no gradient, optimizer state, EMA or checkpoint copy)")
    freeze_text_encoder: bool = arg(False, "the same as --train_text_encoder false (an earlier spelling)")
    allow_untrained_text_encoder: bool = arg(False, "keep a text encoder that has no trained weights frozen (tests "
                                                    "only: its states are random)")
    use_ema: bool = arg(False, "keep an EMA of every trained weight; exported by default")
    attention: str = arg("default", "UNet attention: default (ppdiffusers') or sdpa (Paddle's fused "
                                    "scaled_dot_product_attention: FlashAttention on a GPU in fp16/bf16)")
    ema_decay: float = arg(0.9999, "maximum EMA decay (warm-up (1+n)/(10+n) below it)")
    ema_sigma_rels: Optional[str] = arg(None, "post-hoc EMA (EDM2): track one power-function EMA per relative width "
                                              "given, e.g. 0.05,0.10 (each below sqrt(1/12) = 0.2887); any other width "
                                              "is reconstructed after training from --ema_snapshot_steps' snapshots "
                                              "(python -m ldm.ema)")
    ema_snapshot_steps: int = arg(0, "post-hoc EMA: write a snapshot of every profile every N updates (and at the "
                                     "last) to <output_dir>/ema_snapshots/ (0: none)")
    ema_snapshot_dtype: str = arg("auto", "post-hoc EMA: the snapshots' dtype, auto (the trained weights'), float32 "
                                          "or float16 (half the disk)")
    vae_dtype: str = arg("float32", "precision of the frozen autoencoder's encode: float32, or float16/bfloat16 under "
                                    "autocast on a GPU (its weights stay float32; float32 where unsupported)")
    init_from_checkpoint: Optional[str] = arg(
        None, "start a new stage (a resolution curriculum: 256 then 512) from a training checkpoint's or a "
              "pipeline's weights (and EMA), with a fresh optimizer, schedule and data pass; the lineage goes to "
              "run.json. Ignored when the run resumes a checkpoint of its own")

    def __post_init__(self):
        _check(not (self.freeze_text_encoder and self.train_text_encoder),
               "--freeze_text_encoder and --train_text_encoder true contradict each other: pass one")
        if self.freeze_text_encoder:
            self.train_text_encoder = False
        from ldm.models.noise import FLOW_WEIGHTING, PREDICTION_TYPES, SIGMA_SAMPLING

        _check(self.prediction_type in (None, *PREDICTION_TYPES),
               f"--prediction_type must be one of {', '.join(PREDICTION_TYPES)}, not {self.prediction_type!r}")
        _check(self.flow_sigma_sampling in SIGMA_SAMPLING, f"--flow_sigma_sampling must be one of "
               f"{', '.join(SIGMA_SAMPLING)}, not {self.flow_sigma_sampling!r}")
        _check(self.flow_weighting in FLOW_WEIGHTING,
               f"--flow_weighting must be one of {', '.join(FLOW_WEIGHTING)}, not {self.flow_weighting!r}")
        _check(self.flow_shift is None or self.flow_shift > 0, "--flow_shift must be > 0")
        _check(self.flow_logit_std > 0, "--flow_logit_std must be > 0")
        _check(self.noise_offset >= 0, "--noise_offset must be >= 0")
        _check(self.snr_gamma is None or self.snr_gamma > 0, "--snr_gamma must be > 0")
        _check(0 < self.ema_decay < 1, "--ema_decay must be in (0, 1)")
        from ldm.models.posthoc_ema import SNAPSHOT_DTYPES, PosthocEMAError, parse_sigma_rels

        try:
            parse_sigma_rels(self.ema_sigma_rels)
        except PosthocEMAError as e:
            raise ArgumentError(str(e)) from None
        _check(self.ema_snapshot_steps >= 0, "--ema_snapshot_steps must be >= 0")
        _check(not self.ema_snapshot_steps or bool(self.ema_sigma_rels),
               "--ema_snapshot_steps snapshots the post-hoc EMA's profiles: pass --ema_sigma_rels too (e.g. 0.05,0.10)")
        _check(self.ema_snapshot_dtype in SNAPSHOT_DTYPES,
               f"--ema_snapshot_dtype must be one of {', '.join(SNAPSHOT_DTYPES)}, not {self.ema_snapshot_dtype!r}")
        _check(self.attention in ("default", "sdpa"), f"--attention must be default or sdpa, not {self.attention!r}")
        _check(self.vae_dtype in VAE_DTYPES,
               f"--vae_dtype must be one of {', '.join(VAE_DTYPES)}, not {self.vae_dtype!r}")


@dataclass
class DataArguments:
    file_list: str = arg("./data/filelist/train.filelist.list", "list of filelists (one filelist [weight] per line)")
    tokenizer_name: str = arg("bert-base-uncased",
                              "BERT WordPiece tokenizer: a name (online) or a folder with vocab.txt")
    model_max_length: Optional[int] = arg(None, "caption length in tokens (padded/truncated); default: the model's, "
                                                "its tokenizer's saved length within its text encoder's positions "
                                                "(CLIP 77, PixArt's T5 120; LDMBert 77), as encode uses it")
    resolution: int = arg(256, "training image size")
    center_crop: bool = arg(False, "center crop instead of random crop")
    aspect_buckets: str = arg("none", "aspect-ratio buckets: none (square crops), auto (area about --resolution "
                                      "squared, sides multiples of the model's size step, ratios within "
                                      "--max_aspect_ratio) or a list HxW,HxW,... (e.g. 384x192,256x256,192x384)")
    max_aspect_ratio: float = arg(2.0, "the widest ratio (long side / short side) a bucket of --aspect_buckets may "
                                       "have (auto makes them up to it)")
    random_flip: bool = arg(False, "random horizontal flip")
    caption_dropout_prob: float = arg(0.1, "probability of replacing a caption by '' (classifier-free guidance)")
    min_image_size: int = arg(0, "skip (and count) images whose shorter side is smaller")
    metadata_filter: list[str] = arg_list([], "keep only records whose metadata passes every 'KEY OP NUMBER' (OP: < "
                                              "<= > >= == !=), e.g. 'punsafe < 0.5' 'AESTHETIC_SCORE >= 5'; derived "
                                              "keys min_side, aspect_ratio (see docs/data-formats.md)")
    shuffle_buffer: int = arg(256, "records in each loader slot's shuffle buffer")
    data_timeout: float = arg(600, "seconds without a batch before the run stops with stacks and the shards being "
                                   "read (0: wait forever)")
    allow_data_change: bool = arg(False, "resume even when the file list names other shards than the checkpoint's "
                                         "data position was made for: the interrupted pass ends there and a new "
                                         "pass over the new shards starts")

    def __post_init__(self):
        _check(self.model_max_length is None or self.model_max_length >= 2, "--model_max_length must be at least 2")
        _check(self.resolution >= 8 and self.resolution % 8 == 0, "--resolution must be a multiple of 8")
        _check(0 <= self.caption_dropout_prob <= 1, "--caption_dropout_prob must be in [0, 1]")
        _check(self.shuffle_buffer >= 1, "--shuffle_buffer must be at least 1")
        _check(self.data_timeout >= 0, "--data_timeout must be >= 0")
        _check(self.max_aspect_ratio >= 1, "--max_aspect_ratio must be >= 1")
        from ldm.models.buckets import BucketError, parse_buckets

        try:  # the form here (8: every model's size step divides by it); the model's own step when it is built
            parse_buckets(self.aspect_buckets, self.resolution, 8, self.max_aspect_ratio)
        except BucketError as e:
            raise ArgumentError(str(e)) from None
        if self.metadata_filter:
            from ldm.data.filters import MetadataFilters

            try:
                MetadataFilters(self.metadata_filter)
            except ValueError as e:
                raise ArgumentError(str(e)) from None


@dataclass
class SamplingArguments:
    num_inference_steps: int = arg(50, "DDIM steps of the validation images logged during training")
    image_logging_steps: int = arg(0, "log validation images every N updates (0: off)")
    validation_prompts: Optional[list[str]] = arg(
        None, "prompts of the validation images: strings, or files of one prompt per line (default: four "
        "general prompts)")
    validation_guidance_scales: list[float] = arg_list([1.0, 7.5], "a grid of validation images per scale")
    validation_seed: int = arg(0, "seed of the validation images' noise (the same every time: images compare)")

    def __post_init__(self):
        _check(self.num_inference_steps >= 1, "--num_inference_steps must be at least 1")
        _check(self.image_logging_steps >= 0, "--image_logging_steps must be >= 0")
        _check(all(scale >= 1 for scale in self.validation_guidance_scales) and self.validation_guidance_scales,
               "--validation_guidance_scales must be >= 1 (1: no guidance)")
        self.validation_prompts = read_prompts(self.validation_prompts)


def read_prompts(values: list[str] | None) -> list[str] | None:
    """Prompts given as strings or as files of one prompt per line (a value naming a file is read)."""
    if values is None:
        return None
    prompts = []
    for value in values:
        if os.path.isfile(value):
            try:
                with open(value, encoding="utf-8") as f:
                    prompts.extend(line.strip() for line in f if line.strip())
            except (OSError, UnicodeDecodeError) as e:
                raise ArgumentError(f"--validation_prompts: cannot read {value}: {e}") from None
        elif value.endswith(".txt"):
            raise ArgumentError(f"--validation_prompts: prompt file not found: {value}")
        else:
            prompts.append(value)
    _check(bool(prompts), "--validation_prompts names no prompt")
    return prompts


@dataclass
class LoopArguments:
    """The hand-written loop's training flags (the Trainer path uses PaddleNLP's TrainingArguments)."""

    output_dir: str = arg("./outputs/ldm_no_trainer", "checkpoints, logs and the exported pipeline")
    overwrite_output_dir: bool = arg(False, "start afresh in a non-empty output_dir")
    resume_from_checkpoint: Optional[str] = arg(
        None, "a checkpoint folder, 'latest' (newest complete one in output_dir) or 'auto' (the same, or a fresh "
        "start when there is none)")
    train_batch_size: int = arg(6, "images per card per micro-step")
    gradient_accumulation_steps: int = arg(1, "micro-steps per optimizer update")
    learning_rate: float = arg(4.6875e-5, "peak learning rate")
    adam_weight_decay: float = arg(0.02, "AdamW weight decay")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.999, "AdamW beta2")
    adam_epsilon: float = arg(1e-8, "AdamW epsilon")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm (<= 0: off)")
    max_train_steps: int = arg(1000, "optimizer updates to run")
    lr_scheduler: str = arg("constant", "constant, constant_with_warmup, linear or cosine")
    lr_warmup_steps: int = arg(0, "warm-up, in optimizer updates")
    logging_steps: int = arg(50, "log every N updates")
    save_steps: int = arg(5000, "save a checkpoint every N updates")
    checkpoints_total_limit: Optional[int] = arg(None, "keep the N newest checkpoints",
                                                 aliases=["--save_total_limit"])
    seed: Optional[int] = arg(None, "seed of the model init, the noise and the data stream (default 23; resuming, "
                                    "the checkpoint's)")
    num_workers: int = arg(6, "data loader processes per card")
    mixed_precision: str = arg("no", "no, fp16 (dynamic loss scaling) or bf16")
    recompute: bool = arg(False, "gradient checkpointing of UNet and text encoder")
    report_to: list[str] = arg_list(["visualdl"], "trackers: visualdl, tensorboard, wandb (several allowed), all "
                                                  "(every one installed) or none")
    sharding: str = arg("", "stage1: each rank keeps the optimizer state and EMA of its own share of the trained "
                            "weights (ZeRO stage 1, fleet's sharding optimizer); as PaddleNLP's --sharding")
    sharding_parallel_degree: int = arg(-1, "ranks one shard group spans (-1: every rank); the world size must be "
                                            "a multiple of it")

    def __post_init__(self):
        _check(self.sharding in ("", "stage1"), f"--sharding {self.sharding}: the hand-written loop shards stage1 "
               "only (stage2 and stage3 run through the Trainer path, train_txt2img_laion400m_trainer.py, on GPUs)")
        _check(self.sharding_parallel_degree == -1 or self.sharding_parallel_degree >= 1,
               "--sharding_parallel_degree must be -1 (every rank) or at least 1")
        for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps", "logging_steps",
                     "save_steps"):
            _check(getattr(self, name) >= 1, f"--{name} must be at least 1")
        _check(self.lr_scheduler in LR_SCHEDULERS, f"--lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}")
        _check(self.mixed_precision in MIXED_PRECISION,
               f"--mixed_precision must be one of {', '.join(MIXED_PRECISION)}")
        _check(self.learning_rate > 0, "--learning_rate must be > 0")
        _check(self.lr_warmup_steps >= 0 and self.num_workers >= 0, "--lr_warmup_steps and --num_workers must be >= 0")
        _check(self.checkpoints_total_limit is None or self.checkpoints_total_limit >= 1,
               "--checkpoints_total_limit must be at least 1")
        from ldm.runtime.tracking import resolve_report_to

        resolve_report_to(self.report_to)  # a ValueError names the unknown tracker


PROGRESS = ("auto", "bar", "lines", "none")
FLAT_UPDATE = ("auto", "fused", "on", "off")


@dataclass
class ValidationArguments:
    """The held-out validation loss and the FID and CLIP score of generated images, during training
    (`ldm.evaluation`)."""

    validation_file_list: Optional[str] = arg(None, "held-out shards (a list of filelists, as --file_list; latent "
                                                    "shards too): logs eval/loss and eval/loss_t<t> (default: off)")
    validation_steps: int = arg(1000, "evaluate every N updates, and at the end")
    validation_samples: int = arg(256, "records of --validation_file_list evaluated (its first ones, in order)")
    validation_timesteps: int = arg(8, "timesteps per record: the centres of this many equal bins of the schedule")
    validation_batch_size: int = arg(8, "records per forward pass of the evaluation (and images per generation "
                                        "batch of --fid_steps)")
    validation_aspect_buckets: bool = arg(False, "the held-out loss on crops in the run's --aspect_buckets (default: "
                                                 "square crops, which compare across runs with and without buckets)")
    fid_steps: int = arg(0, "every N updates, and at the end, generate --fid_samples images (EMA weights where there "
                            "are some) and log eval/fid against --fid_reference (and eval/clip_score with --clip); "
                            "0: off (docs/evaluation.md)")
    fid_samples: int = arg(1024, "images generated per evaluation, split over the ranks (FID is biased below 2048)")
    fid_reference: Optional[str] = arg(None, "Inception statistics of real images at this --resolution "
                                             "(python -m ldm.evaluate stats)")
    inception: Optional[str] = arg(None, "FID Inception weights as safetensors (python -m ldm.evaluate "
                                         "convert-inception)")
    clip: Optional[str] = arg(None, "a CLIP folder in Hugging Face's format (e.g. openai/clip-vit-large-patch14): "
                                    "also log eval/clip_score")
    fid_prompts: Optional[str] = arg(None, "a file of prompts, one per line, cycled (default: the captions of "
                                           "--validation_file_list)")
    fid_guidance_scale: float = arg(7.5, "classifier-free guidance of the images generated for --fid_steps")
    fid_inference_steps: int = arg(25, "DDIM steps of the images generated for --fid_steps")

    def __post_init__(self):
        for name in ("validation_steps", "validation_samples", "validation_timesteps", "validation_batch_size",
                     "fid_inference_steps"):
            _check(getattr(self, name) >= 1, f"--{name} must be at least 1")
        _check(self.fid_steps >= 0, "--fid_steps must be >= 0")
        _check(self.fid_guidance_scale >= 1, "--fid_guidance_scale must be >= 1 (1: no guidance)")
        if self.fid_steps:
            _check(self.fid_samples >= 2, "--fid_samples must be at least 2 (FID needs thousands)")
            _check(bool(self.fid_reference and self.inception),
                   "--fid_steps needs --fid_reference (python -m ldm.evaluate stats) and --inception (weights: "
                   "python -m ldm.evaluate convert-inception)")
            _check(bool(self.fid_prompts or self.validation_file_list),
                   "--fid_steps needs prompts: --fid_prompts FILE, or --validation_file_list (its captions)")


@dataclass
class RunArguments:
    """What every entry point shares about watching a run: its recorded configuration, its progress output and
    its health checks (`ldm.config.record`, `ldm.train.progress`, `ldm.train.health`, `ldm.models.flops`)."""

    config: Optional[str] = arg(None, "a YAML or JSON file of flags (name: value); flags on the command line win")
    allow_config_change: bool = arg(False, "resume even when the model, the resolution or the prediction type "
                                           "differ from the checkpoint's (every difference is logged either way)")
    progress: str = arg("auto", "progress output: bar (redrawn, for a terminal), lines (a plain line at each logging "
                                "step and every --progress_seconds, for a log file), none, or auto (bar on a "
                                "terminal, lines otherwise)")
    progress_seconds: float = arg(60.0, "with lines: at most this many seconds between two progress lines")
    max_nonfinite_updates: int = arg(20, "stop after this many updates in a row were skipped for a NaN/inf loss or "
                                         "gradient norm (each one is skipped and logged)")
    peak_tflops: Optional[float] = arg(None, "peak dense TFLOP/s of one device in the training precision: logs "
                                             "train/mfu (model FLOPs utilisation)")
    async_save: bool = arg(True, "write checkpoints beside training: the updates wait only for a copy of the state "
                                 "to host memory (false: every save is waited for)")
    phase_timing: bool = arg(False, "log at each logging step the fraction of the time spent in each phase of the "
                                    "updates (data, forward, backward, sync, clip, vote, optimizer, ema, checkpoint, "
                                    "other): train/phase_<name>, rank 0's; waits for the device at each phase")
    flat_update: str = arg("auto", "on: the trained weights, their gradients, AdamW moments and EMA live in flat "
                                   "buffers, and the norm, clip, AdamW and EMA run a few of Paddle's kernels over "
                                   "them (an adamw_ and a lerp_ per span); fused (a CPU): the same buffers, and the "
                                   "clip, AdamW and EMA run as one pass on several threads, compiled with the "
                                   "machine's C compiler; off: a kernel or several per tensor; auto: fused on a CPU "
                                   "when the kernel builds on every rank, else on; on on a GPU (docs/training.md). "
                                   "Checkpoints are the same either way")
    profile_steps: Optional[str] = arg(None, "A-B: Paddle's profiler over updates A to B (each rank's trace for "
                                             "Perfetto or VisualDL, its table of operators and where the updates' "
                                             "time went, in <output_dir>/profile/)")

    def __post_init__(self):
        _check(self.progress in PROGRESS, f"--progress must be one of {', '.join(PROGRESS)}, not {self.progress!r}")
        _check(self.progress_seconds > 0, "--progress_seconds must be > 0")
        _check(self.flat_update in FLAT_UPDATE, f"--flat_update must be one of {', '.join(FLAT_UPDATE)}, not "
                                                f"{self.flat_update!r}")
        _check(self.max_nonfinite_updates >= 1, "--max_nonfinite_updates must be at least 1")
        _check(self.peak_tflops is None or self.peak_tflops > 0, "--peak_tflops must be > 0")
        _check(self.profile_steps is None or self.profile_window is not None,
               f"--profile_steps must be A-B, the first and last update to profile (1 <= A <= B), not "
               f"{self.profile_steps!r}")

    @property
    def profile_window(self) -> tuple[int, int] | None:
        # ASCII digits only: str.isdigit() accepts "²", which int() then refuses
        match = re.fullmatch(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*", self.profile_steps or "")
        if match is None or not 1 <= int(match.group(1)) <= int(match.group(2)):
            return None
        return int(match.group(1)), int(match.group(2))


@dataclass
class AutoencoderArguments:
    """The autoencoder entry point's model flags (`train_autoencoder.py`)."""

    model_name_or_path: str = arg(
        "ldm-32layer", "autoencoder to train: a preset (its vqvae/ config), a vqvae folder or a pipeline folder; "
        "trained weights there are fine-tuned, a config alone is trained from scratch")
    kl_weight: float = arg(1e-6, "weight of KL(posterior || N(0, I)) against the L1 reconstruction error")
    scale_batches: int = arg(16, "batches per card encoded after training to measure scaling_factor = 1 / std")
    image_logging_steps: int = arg(0, "log inputs vs reconstructions every N updates (0: off)")

    def __post_init__(self):
        _check(self.kl_weight >= 0, "--kl_weight must be >= 0")
        _check(self.scale_batches >= 1, "--scale_batches must be at least 1")
        _check(self.image_logging_steps >= 0, "--image_logging_steps must be >= 0")


@dataclass
class AutoencoderLoopArguments(LoopArguments):
    """The loop's flags with the autoencoder's defaults."""

    output_dir: str = arg("./outputs/autoencoder", "checkpoints, logs and the trained vqvae/")
    learning_rate: float = arg(1e-4, "peak learning rate")


# The argument groups of the hand-written loop's entry point (`train_txt2img_laion400m_no_trainer.py`), in the
# order `parse` returns them; each lands in a run's record (`run.json`) under its class name.
NO_TRAINER_GROUPS = (ModelArguments, DataArguments, SamplingArguments, LoopArguments, RunArguments,
                     ValidationArguments)


def make_parser(dataclass_types):
    """PaddleNLP's PdArgumentParser, plus flag aliases from field metadata."""
    from paddlenlp.trainer import PdArgumentParser

    class Parser(PdArgumentParser):
        @staticmethod
        def _parse_dataclass_field(parser, dc_field):
            aliases = dc_field.metadata.get("aliases", ())
            if not aliases:
                return PdArgumentParser._parse_dataclass_field(parser, dc_field)
            stripped = dataclasses.field(default=dc_field.default,
                                         metadata={k: v for k, v in dc_field.metadata.items() if k != "aliases"})
            stripped.name, stripped.type = dc_field.name, dc_field.type
            add_argument = parser.add_argument
            parser.add_argument = lambda name, *a, **kw: add_argument(name, *aliases, *a, **kw)
            try:
                return PdArgumentParser._parse_dataclass_field(parser, stripped)
            finally:
                del parser.add_argument

    return Parser(dataclass_types, allow_abbrev=False)  # a prefix of a flag is a typo, not that flag


def known_flags(dataclass_types) -> list[str]:
    return [flag for dc in dataclass_types for f in dataclasses.fields(dc)
            for flag in (f"--{f.name}", *f.metadata.get("aliases", ()))]


def trainer_arguments():
    """PaddleNLP's `TrainingArguments` with --seed unset by default: the recipe's 23, or, resuming, the checkpoint's
    (`ldm.config.record.resolve_seed`), as on the hand-written loop (PaddleNLP's own default is 42)."""
    from paddlenlp.trainer import TrainingArguments as PaddleNLPTrainingArguments

    @dataclass
    class TrainingArguments(PaddleNLPTrainingArguments):  # the same name: run records name their groups
        seed: Optional[int] = field(default=None, metadata={"help": "seed of the model init, the noise and the data "
                                                                    "stream (default 23; resuming, the checkpoint's)"})

    return TrainingArguments


def parse(dataclass_types, argv: list[str] | None = None):
    """Parse flags into the dataclasses; `--config FILE` (or a lone FILE.json/.yaml) adds the flags of a YAML or
    JSON file, the command line's winning. A user error exits 2 with one line."""
    writable_caches_or_exit()  # before the first import of Paddle, which a read-only HOME fails
    from ldm.config.record import expand_config
    from ldm.runtime.compat import readable_strategy

    readable_strategy()  # PaddleNLP's arguments log fleet's strategy, whose repr fails with the lock's protobuf
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser(dataclass_types)
    try:
        argv = expand_config(list(argv))
        *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if unknown:
            parser.exit(2, f"error: {unknown_flags_message(unknown, known_flags(dataclass_types))}\n")
        return tuple(parsed)
    except (ArgumentError, ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
