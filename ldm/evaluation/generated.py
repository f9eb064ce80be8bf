"""FID and CLIP score of the images a model generates: `python -m ldm.evaluate run` and the in-training evaluation
(`--fid_steps`) are this one function.

For each guidance scale, sample i (i < num_samples) is prompt i mod len(prompts), generated with DDIM from noise
seeded by (seed, i) (`ldm.inference.sampling.generate`), so an image does not depend on the batch, the rank or the
number of ranks it was made on. The samples are cut into batches of `batch_size`, and the batches into contiguous
runs, one per rank: a batch holds the same samples in every layout, each rank scores its own batches (Inception
pool3 features, CLIP's 100 cos), and the ranks gather them in sample order, so the statistics, the FID and the CLIP
score of two processes are those of one. Images go from the decoder to the metrics as uint8 arrays (what a PNG would
hold), never through JPEG.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ldm.evaluation.fid import (
    Statistics,
    check_comparable,
    fid,
    inception_features,
    small_sample_warning,
    statistics,
)

logger = logging.getLogger("ldm.evaluation")


@dataclass
class Sampling:
    """What is generated: `num_samples` images per guidance scale, prompts cycled."""

    prompts: list[str]
    num_samples: int
    guidance_scales: list[float]
    num_inference_steps: int = 25
    seed: int = 0
    batch_size: int = 8


@dataclass
class Scored:
    """One guidance scale's result."""

    guidance_scale: float
    samples: int
    seconds: float
    fid: float | None = None
    clip_score: float | None = None
    images: np.ndarray | None = None  # the first `keep_images` samples (rank 0)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"guidance_scale": self.guidance_scale, "fid": self.fid, "clip_score": self.clip_score,
                "samples": self.samples, "seconds": round(self.seconds, 3)}


def rank_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[range]:
    """The sample ranges (whole batches, contiguous) that `rank` of `world_size` generates."""
    batches = math.ceil(num_samples / batch_size)
    first, last = batches * rank // world_size, batches * (rank + 1) // world_size
    return [range(b * batch_size, min(num_samples, (b + 1) * batch_size)) for b in range(first, last)]


class GeneratedMetrics:
    """FID against `reference` (statistics of real images) with `inception` in `mode`, and the CLIP score with
    `clip` (None: no CLIP score), of images made by `make_images(prompts, first_index, guidance_scale)`."""

    def __init__(self, inception, reference: Statistics | None, clip=None, mode: str = "clean",
                 resolution: int | None = None, fid_method: str = "eigenvalues"):
        self.inception, self.reference, self.clip, self.mode = inception, reference, clip, mode
        self.resolution, self.fid_method = resolution, fid_method

    def check(self, sampling: Sampling) -> list[str]:
        """Warnings about what the result can be compared with; FIDError when the reference cannot be used."""
        notes = []
        if self.reference is not None:
            generated = Statistics(self.reference.mu, self.reference.sigma, self.mode, sampling.num_samples,
                                   self.inception.fingerprint, self.resolution)
            notes += check_comparable(generated, self.reference, "the generated images", "the reference")
            notes += [w for w in (small_sample_warning(generated, "the generated images"),
                                  small_sample_warning(self.reference, "the reference")) if w]
        return notes

    def evaluate(self, make_images: Callable[[list[str], int, float], np.ndarray], sampling: Sampling, dist,
                 keep_images: int = 0) -> list[Scored]:
        results = []
        mine = rank_batches(sampling.num_samples, sampling.batch_size, dist.rank, dist.world_size)
        for scale in sampling.guidance_scales:
            start = time.perf_counter()
            features, clip, kept = [], [], []
            for samples in mine:
                prompts = [sampling.prompts[i % len(sampling.prompts)] for i in samples]
                images = make_images(prompts, samples.start, scale)
                features.append(inception_features(images, self.inception, self.mode, batch_size=len(images)))
                if self.clip is not None:
                    clip.append(self.clip.scores(images, prompts))
                if len(kept) < keep_images:
                    kept.extend(images[:keep_images - len(kept)])
            gathered = dist.gather((features, clip, kept))  # waits for every rank: what follows is wall time
            result = Scored(scale, sampling.num_samples, time.perf_counter() - start)
            features = np.concatenate([f for rank_features, _, _ in gathered for f in rank_features])
            if self.reference is not None:
                stats = statistics(features, self.mode, self.inception.fingerprint, self.resolution)
                # every rank computes the same distance: a rank waiting in a collective while rank 0 took scipy's
                # matrix square root alone timed out under gloo (30 s) on a busy 2-core machine
                result.fid = fid(stats, self.reference, self.fid_method)
            if self.clip is not None:
                from ldm.evaluation.clip import aggregate

                result.clip_score = aggregate(np.concatenate([c for _, rank_clip, _ in gathered for c in rank_clip]))
            kept = [image for _, _, rank_kept in gathered for image in rank_kept][:keep_images]
            result.images = np.stack(kept) if kept else None
            results.append(result)
        return results


def pipeline_images(unet, text_encoder, vae, scheduler, tokenize, sampling: Sampling):
    """`make_images` of a model's parts: DDIM with classifier-free guidance (`ldm.inference.sampling.generate`)."""
    from ldm.inference.sampling import generate

    def make(prompts: Sequence[str], first_index: int, guidance_scale: float) -> np.ndarray:
        return generate(unet, text_encoder, vae, scheduler, tokenize, list(prompts), guidance_scale=guidance_scale,
                        num_inference_steps=sampling.num_inference_steps, seed=sampling.seed,
                        batch_size=len(prompts), first_index=first_index)

    return make


def read_prompts(path: str) -> list[str]:
    """A prompt file's non-empty lines; FIDError when it cannot be read or holds none."""
    from ldm.evaluation.fid import FIDError

    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise FIDError(f"prompts {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not prompts:
        raise FIDError(f"prompts {path}: no prompt in it (one per line)")
    return prompts


def file_list_captions(file_list: str, count: int) -> list[str]:
    """The first `count` non-empty captions of a file list's records, in order (images are not decoded)."""
    from ldm.data.filelist import read_file_list
    from ldm.data.filters import record_parts
    from ldm.data.latents import parse_latent_record
    from ldm.data.readers import iter_records
    from ldm.data.record import SkipRecord, parse_record
    from ldm.data.shard import ShardError
    from ldm.evaluation.fid import FIDError

    captions: list[str] = []
    for shard in read_file_list(file_list):
        try:
            for _, record in iter_records(shard.path):
                try:
                    _, caption, _ = record_parts(record, parse_record, parse_latent_record, None)
                except SkipRecord:
                    continue
                if caption:
                    captions.append(caption)
                if len(captions) == count:
                    return captions
        except ShardError:
            continue
    if not captions:
        raise FIDError(f"{file_list} holds no captioned record to prompt with: give --fid_prompts")
    return captions
