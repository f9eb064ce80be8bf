"""What a training run trains: the objective (model, loss, what a checkpoint holds of it, validation and
export) and the start of its batches.

The run's life (`ldm.train.run`) calls these, whichever driver runs the updates. Gradient norms are
`ldm.train.gradients`, the logged window `ldm.train.metrics`, the checks before the first write `ldm.train.preflight`.
"""

from __future__ import annotations

import contextlib
import logging
import os

import paddle

from ldm.checkpoint.format import (
    check_autoencoder,
    load_initial_weights,
    load_ldm_weights,
    save_model,
    text_identity_difference,
    write_frozen_autoencoder,
    write_frozen_text_encoder,
)
from ldm.checkpoint.resume import Resume
from ldm.checkpoint.run_folder import CheckpointError, RunFolder
from ldm.config.args import DataArguments, ModelArguments, SamplingArguments, ValidationArguments
from ldm.data.latents import fingerprint, text_fingerprint
from ldm.data.tokenize import CaptionTokenizer
from ldm.evaluation.heldout import HeldOut, fixed_timesteps, read_records
from ldm.models.autoencoder import autoencoder_identity
from ldm.models.buckets import BucketError, backbone_buckets, bucket_name, size_step
from ldm.models.ema import EMA
from ldm.models.posthoc_ema import EMAProfiles, parse_sigma_rels
from ldm.models.text import text_encoder_identity
from ldm.runtime.distributed import Distributed
from ldm.runtime.tracking import NullWriter
from ldm.train import samples, setup
from ldm.train.batches import DataPosition, TimedBatches, build_batches

logger = logging.getLogger("ldm.train")


QUARTERS = 4


class Objective:
    """What a run trains. `model` is the training wrapper: its trainable parameters are optimised."""

    model: paddle.nn.Layer
    tokenizer = None  # batches carry `input_ids` when set
    data: DataArguments | None = None  # the data arguments as it resolved them (the caption length); None: as given
    ema: EMA | None = None
    ema_profiles: EMAProfiles | None = None  # the post-hoc EMA's (`--ema_sigma_rels`)
    latents_of: str | None = None  # trains on latent shards of this autoencoder (fingerprint); None: images only
    buckets: tuple[tuple[int, int], ...] | None = None  # its --aspect_buckets, for its model's size step; None: squares
    latent_scale = 8  # the autoencoder's downsampling
    autoencoder_source = ""
    cached_text: str | None = None  # cached text states it takes (`build_batches`): its frozen encoder's fingerprint
    added_conditions: tuple[str, ...] = ()  # the added conditions its model reads (`ModelFamily.reads_added`)
    on_cached_text = False  # its batches carry cached text states (known once they started)

    def loss(self, net, batch: dict) -> tuple[paddle.Tensor, dict[str, paddle.Tensor]]:
        """(loss to minimise, extra scalars to log) of one micro-batch; `net` is the (DataParallel) model. An extra
        value may be a (sum, count) pair: logged as the window's sum over its count (over ranks too)."""
        raise NotImplementedError

    def initialise(self) -> dict | None:
        """A fresh run (not a resume): load the starting weights it was asked for; their lineage, or None."""
        return None

    def check_resume(self, resume: Resume) -> None:
        """Refuse a checkpoint this objective cannot continue (called before anything is written)."""

    def write_frozen(self, run_dir: RunFolder) -> None:
        """Write what the run needs before training (the folder exists now)."""

    def trained_parts(self) -> dict:
        """The parts whose weights a checkpoint holds, by folder (`{"unet": layer, ...}`): the checkpoint manager writes
        their weights, every rank a share (`ldm.checkpoint.format.weight_jobs`)."""
        raise NotImplementedError

    def save(self, folder: str, final_folder: str, shares: list) -> None:
        """Write the rest of the model into a checkpoint folder: the parts' configurations, the tokenizer, ...
        (`shares`: the names of the weights each rank wrote)."""
        raise NotImplementedError

    def load(self, folder: str) -> None:
        raise NotImplementedError

    def log_images(self, writer: NullWriter, step: int, batch: dict | None) -> None:
        """Images for the trackers every `image_logging_steps`: called on every rank (a sharded EMA is gathered
        first), written by the rank whose writer is active."""

    def export(self, checkpoint: str | None, batches, dist: Distributed, run_dir: RunFolder) -> None:
        """After the last update, on every rank: the final export."""

    def prepare_validation(self, dist: Distributed) -> None:
        """Read what `evaluate` needs (before the first write: unusable held-out data fails the start)."""

    def validation_due(self, step: int, last: bool) -> bool:
        return False

    def evaluate(self, dist: Distributed) -> dict[str, float]:
        """Held-out metrics under the trackers' names (`eval_<name>`), the same on every rank; {}: none."""
        return {}

    def flops_per_sample(self, on_latents: bool, shape: tuple[int, int] | None = None) -> dict[str, int] | None:
        """FLOPs of one training sample by part, with "total" (`ldm.models.flops`), at `shape` (height, width; default
        the square resolution); None: not counted."""
        return None

    def identity(self) -> dict:
        """What the run trains, for its record (`ldm.config.record`): where the model came from and what it is."""
        return {"parameters": sum(int(p.numel()) for p in self.model.parameters()),
                "trained_parameters": sum(int(p.numel()) for p in self.model.parameters() if not p.stop_gradient)}


class TextToImage(Objective):
    """The latent diffusion model: the UNet trained, the autoencoder frozen, the text encoder trained (LDMBert, by
    default) or frozen (a pretrained CLIP's: `ldm.models.text`)."""

    def __init__(self, model_args: ModelArguments, data: DataArguments, sampling: SamplingArguments, *,
                 recompute: bool, seed: int, validation: ValidationArguments | None = None,
                 resume: Resume | None = None):
        """`resume`: the checkpoint this run continues; without --vae_name_or_path it continues with the autoencoder
        that checkpoint was trained with (its run's `vqvae/`), not the model source's."""
        self.sampling, self.validation = sampling, validation or ValidationArguments()
        self.text = setup.text_source(model_args, resume)
        self.tokenizer = setup.build_tokenizer(data, self.text)
        self.data = data = setup.with_caption_length(data, self.text, self.tokenizer, model_args.model_name_or_path)
        vae = model_args.vae_name_or_path or (resume.autoencoder_folder if resume else None)
        if vae and not model_args.vae_name_or_path:
            logger.info("resuming %s with the autoencoder it was trained with, %s", resume.path, vae)
        self.model, self.components = setup.build_model(model_args, data, self.tokenizer, recompute=recompute,
                                                         seed=seed, vae_name_or_path=vae, text=self.text)
        self.text_identity = None if self.text.trained else text_encoder_identity(
            self.model.text_encoder, self.text.family, data.model_max_length)
        self.cached_text = text_fingerprint(self.text_identity) if self.text_identity else ""
        if self.text_identity:  # what a dropped caption's cached states are replaced by
            self.model.keep_empty_caption(CaptionTokenizer(self.tokenizer, data.model_max_length)(""))
        self.text_folder = None
        self.ema = EMA(self.model, model_args.ema_decay) if model_args.use_ema else None
        sigma_rels = parse_sigma_rels(model_args.ema_sigma_rels)
        self.ema_profiles = EMAProfiles(self.model, sigma_rels, model_args.ema_snapshot_steps,
                                        model_args.ema_snapshot_dtype) if sigma_rels else None
        self.init_source = model_args.init_from_checkpoint
        self.vae_identity = autoencoder_identity(self.components.vae)
        self.latents_of, self.autoencoder_source = fingerprint(self.vae_identity), self.components.vae_source
        self.latent_scale = size_step(self.components.vae.config)
        self.buckets = backbone_buckets(data.aspect_buckets, data.resolution, data.max_aspect_ratio,
                                        self.components.vae.config, self.components.unet.config)
        self.added_conditions = self.model.family.reads_added(self.model.unet)
        self.vae_folder = None
        self.nan_batches = nan_fault_batches()
        self.batches_seen = 0
        self.held_out: HeldOut | None = None
        self.generated = None  # (GeneratedMetrics, Sampling) with --fid_steps
        self.due = (False, False)  # (held-out loss, generated images) at the update `validation_due` was asked

    def prepare_validation(self, dist: Distributed) -> None:
        """Read the held-out records (every rank reads them all and keeps its share): before the first write, so
        an unusable --validation_file_list fails the start. With --fid_steps, what the FID needs too."""
        v = self.validation
        if v.validation_aspect_buckets and not (self.buckets and v.validation_file_list):
            raise BucketError("--validation_aspect_buckets computes the held-out loss in the run's buckets: it needs "
                              f"{'--aspect_buckets' if not self.buckets else '--validation_file_list'}")
        if v.fid_steps:
            self.prepare_generated_metrics(dist)
        if not v.validation_file_list:
            return
        records = read_records(v.validation_file_list, v.validation_samples, resolution=self.data.resolution,
                               tokenizer=self.tokenizer, model_max_length=self.data.model_max_length,
                               autoencoder=self.latents_of, autoencoder_source=self.autoencoder_source,
                               buckets=self.buckets if v.validation_aspect_buckets else None,
                               added_conditions=self.added_conditions)
        timesteps = fixed_timesteps(v.validation_timesteps, self.model.noise_scheduler.config.num_train_timesteps)
        self.held_out = HeldOut(records, timesteps, dist, v.validation_batch_size)
        crops = (f"in buckets {', '.join(map(bucket_name, self.buckets))}" if v.validation_aspect_buckets
                 else f"{self.data.resolution}px squares")
        logger.info("validation: %d held-out records (%s) at timesteps %s, every %d updates", len(records), crops,
                    timesteps, v.validation_steps)

    def prepare_generated_metrics(self, dist: Distributed) -> None:
        """With --fid_steps: the Inception, the reference statistics, CLIP and the prompts, checked before the first
        write (weights of the wrong kind, a reference of another mode, resolution or Inception are one line)."""
        from ldm.evaluation.clip import ClipScorer
        from ldm.evaluation.fid import Statistics
        from ldm.evaluation.generated import GeneratedMetrics, Sampling, file_list_captions, read_prompts
        from ldm.evaluation.inception import Inception
        from ldm.models.build import model_resolution

        v = self.validation
        # read once, on rank 0: every rank generates from the same prompts and compares with the same reference
        prompts, reference = dist.from_main(lambda: (
            read_prompts(v.fid_prompts) if v.fid_prompts else file_list_captions(v.validation_file_list,
                                                                                 v.fid_samples),
            Statistics.load(v.fid_reference)))
        resolution = model_resolution(self.model.unet, self.model.vae)  # what the sampler makes, whatever the crops
        metrics = GeneratedMetrics(Inception.from_file(v.inception), reference, ClipScorer(v.clip) if v.clip else None,
                                   mode=reference.mode or "clean", resolution=resolution)
        sampling = Sampling(prompts, v.fid_samples, [v.fid_guidance_scale], v.fid_inference_steps,
                            batch_size=v.validation_batch_size)
        for note in metrics.check(sampling):
            if dist.is_main:
                logger.warning("%s", note)
        self.generated = (metrics, sampling)
        logger.info("FID%s: %d images (%d prompts, guidance %g, %d DDIM steps) every %d updates", " and CLIP score"
                    if v.clip else "", v.fid_samples, len(prompts), v.fid_guidance_scale, v.fid_inference_steps,
                    v.fid_steps)

    def validation_due(self, step: int, last: bool) -> bool:
        self.due = (self.held_out is not None and (step % self.validation.validation_steps == 0 or last),
                    self.generated is not None and (step % self.validation.fid_steps == 0 or last))
        return any(self.due)

    def evaluate(self, dist):
        loss_due, generated_due = self.due
        metrics = {}
        if loss_due:
            metrics.update({f"eval_{name}": value for name, value in self.held_out.evaluate(self.model).items()})
        if self.ema is None:
            if generated_due:
                metrics.update(self.generated_metrics(dist))
            return metrics
        with self.ema.gathered(), self.ema.swapped(self.model):  # a sharded EMA whole for the evaluation
            if loss_due:
                ema = self.held_out.evaluate(self.model)
                metrics.update({f"eval_ema_{name}": value for name, value in ema.items()})
            if generated_due:
                metrics.update(self.generated_metrics(dist))
        return metrics

    def generated_metrics(self, dist) -> dict[str, float]:
        """FID (and CLIP score) of the model's images as they are now: the EMA's when the caller swapped it in."""
        from ldm.evaluation.clip import ClipError
        from ldm.evaluation.fid import FIDError
        from ldm.evaluation.generated import pipeline_images
        from ldm.inference.sampling import sampling_scheduler
        from ldm.models.noise import scheduler_config

        metrics, sampling = self.generated
        model = self.model
        scheduler = sampling_scheduler(scheduler_config(model.noise_scheduler))
        make = pipeline_images(model.unet, model.text_encoder, model.vae, scheduler,
                               CaptionTokenizer(self.tokenizer, self.data.model_max_length), sampling)
        try:
            scored = metrics.evaluate(make, sampling, dist)[0]
        except (FIDError, ClipError) as e:  # raised on every rank (the FID comes from rank 0): the run goes on
            logger.warning("FID not computed at this update: %s", e)
            return {"eval_fid": float("nan")}
        out = {"eval_fid": scored.fid, "eval_fid_seconds": scored.seconds}
        if scored.clip_score is not None:
            out["eval_clip_score"] = scored.clip_score
        return out

    def flops_per_sample(self, on_latents, shape=None):
        flops = self.model.family.training_flops(self.model, resolution=shape or self.data.resolution,
                                                 text_length=self.data.model_max_length, on_latents=on_latents)
        if self.on_cached_text:  # no encoder forward at all
            flops["total"] -= flops["text_encoder"]
            flops["text_encoder"] = 0
        return flops

    def identity(self):
        return {**super().identity(), "source": self.components.source, "class": type(self.model.unet).__name__,
                "prediction_type": self.model.prediction_type, "autoencoder_source": self.components.vae_source,
                "autoencoder": self.vae_identity, "text_encoder": type(self.model.text_encoder).__name__,
                "text_encoder_trained": self.text.trained, "text_encoder_identity": self.text_identity}

    def initialise(self):
        if not self.init_source:
            return None
        frozen = None if self.text_identity is None else (self.text_identity, self.identify_text,
                                                          type(self.model.text_encoder), self.text.family.folder)
        lineage = load_initial_weights(self.init_source, self.trained_parts(), self.model, self.ema, self.vae_identity,
                                       frozen)
        logger.info("a new stage from %s (%s; EMA: %s)", lineage["init_from"], lineage["kind"], lineage["ema"])
        return lineage

    def check_resume(self, resume):
        if self.init_source:
            logger.info("resuming %s: --init_from_checkpoint %s is not loaded again", resume.path, self.init_source)
        check_autoencoder(resume.path, resume.autoencoder, self.vae_identity,
                          f"this run's autoencoder ({self.components.vae_source})", self.components.vae_source)
        if resume.text_encoder != self.text_identity and not setup.legacy_frozen(resume, self.text.family):
            if resume.text_encoder is not None and self.text_identity is not None:  # both frozen: say what differs
                raise CheckpointError(f"{resume.path} kept its text encoder frozen, and this run's differs from it "
                                      f"({text_identity_difference(resume.text_encoder, self.text_identity)}): resume "
                                      "with the model and --model_max_length the run started with")
            said = ("trained its text encoder" if resume.text_encoder is None else
                    f"kept the text encoder {resume.text_encoder.get('family')} "
                    f"{resume.text_encoder.get('weights_sha256', '')[:12]} frozen")
            raise CheckpointError(f"{resume.path} {said}, and this run's is "
                                  f"{'trained' if self.text_identity is None else 'another, frozen'}: resume with the "
                                  "model and --train_text_encoder the run started with")

    def identify_text(self, layer) -> dict:
        return text_encoder_identity(layer, self.text.family, self.data.model_max_length)

    def write_frozen(self, run_dir):
        self.vae_folder = write_frozen_autoencoder(run_dir, self.components.vae, self.vae_identity)
        if self.text_identity is not None:
            self.text_folder = write_frozen_text_encoder(run_dir, self.model.text_encoder, self.text_identity,
                                                         self.identify_text)

    def loss(self, net, batch):
        loss, per_sample, timesteps = net(batch.get("pixel_values"), batch.get("input_ids"),
                                          batch.get("latent_moments"), details=True,
                                          conditioning=batch.get("conditioning"))
        self.batches_seen += 1
        if self.batches_seen in self.nan_batches:  # the fault hook of the tests (`nan_fault_batches`)
            loss = loss * float("nan")
        # the loss by quarter of the noise schedule (guided-diffusion's quartiles): (sum, count) pairs, so that a
        # quarter no sample of a batch drew counts for nothing rather than for zero
        quarter = (timesteps.astype("float32") * QUARTERS / self.model.num_train_timesteps).floor().astype("int64")
        per_sample = per_sample.detach()
        extra = {}
        for q in range(QUARTERS):
            mask = (quarter == q).astype("float32")
            extra[f"loss_q{q + 1}"] = ((per_sample * mask).sum(), mask.sum())
        return loss, extra

    def trained_parts(self):
        parts = {self.model.family.backbone_folder: self.model.unet}
        if self.text.trained:
            parts[self.text.family.folder] = self.model.text_encoder
        return parts

    def save(self, folder, final_folder, shares):
        frozen = None if self.text_identity is None else (self.text_folder, self.text_identity)
        save_model(folder, parts=self.trained_parts(), tokenizer=self.tokenizer,
                   noise_scheduler=self.model.noise_scheduler, vae_folder=self.vae_folder,
                   vae_identity=self.vae_identity, final_folder=final_folder, shares=shares, frozen_text=frozen)

    def load(self, folder):
        load_ldm_weights(folder, self.trained_parts())

    def log_images(self, writer, step, batch):
        with self.ema.gathered() if self.ema is not None else contextlib.nullcontext():  # on every rank
            if writer.active:
                samples.log_validation(writer, step, self.model, self.tokenizer, self.data.model_max_length,
                                       self.sampling, ema=self.ema, sizes=samples.validation_sizes(self.buckets))

    def export(self, checkpoint, batches, dist, run_dir):
        if dist.is_main and checkpoint:
            from ldm.inference.export import NoPipeline, export_checkpoint

            try:
                pipeline, used_ema = export_checkpoint(checkpoint, run_dir.path("pipeline"))
            except NoPipeline as e:
                logger.info("no pipeline is exported: %s", e)
                return
            logger.info("exported %s (%s weights) to %s", checkpoint, "EMA" if used_ema else "raw", pipeline)


NAN_FAULT = "LDM_TEST_NAN_BATCHES"


def nan_fault_batches() -> set[int]:
    """For tests only (the chaos soak): `LDM_TEST_NAN_BATCHES=3,7` makes the loss of this process's 3rd and 7th
    batch NaN, as a real overflow would, so that the non-finite guard is exercised through the real entry points.
    No flag reaches it; unset, nothing changes."""
    value = os.environ.get(NAN_FAULT, "")
    return {int(part) for part in value.split(",") if part.strip().isdigit()}


def make_batches(objective: Objective, position: DataPosition, data: DataArguments, *, batch_size: int, seed: int,
                 dist: Distributed, num_workers: int) -> TimedBatches:
    """The started batches, continuing from the data `position` restored (none: from the beginning); unusable data
    fails here. Called after building the model and before the first write."""
    batches = build_batches(data, objective.tokenizer, batch_size=batch_size, seed=seed, dist=dist,
                            num_workers=num_workers, saved_streams=position.saved,
                            autoencoder=objective.latents_of, autoencoder_source=objective.autoencoder_source,
                            buckets=objective.buckets, latent_scale=objective.latent_scale,
                            cached_text=objective.cached_text, added_conditions=objective.added_conditions)
    position.follow(batches.tracker)
    batches.start()
    objective.on_cached_text = batches.cached_text
    return batches
