"""Held-out validation loss: the diffusion loss of fixed records at fixed timesteps with fixed noise.

The training loss is drawn at random timesteps with random noise; its curve is noisy and says little
about whether one run is better than another. Here each of the first `--validation_samples` records
of `--validation_file_list` (read in file-list order, one pass, any shard kind the stream reads) is
evaluated at K evenly spaced timesteps (the centres of K equal bins of the schedule, as MLPerf's
text-to-image benchmark does at 8) with noise drawn from a generator seeded by the record's place in
that list: the number depends on the weights alone, not on the run's random state, its data position,
the number of ranks or loader workers. Images are encoded to the posterior mean (latent records: their
mean), captions are not dropped, crops are centred, nothing is flipped. Crops are square unless asked for in the
run's aspect-ratio buckets (`--validation_aspect_buckets`); records of one shape are evaluated together.

Ranks split the records (record i on rank i mod world size) and add up their sums; the model runs in
eval mode without gradients, and the training's random state is not touched (numpy generators of
their own). `python -m ldm.evaluate loss` computes the same numbers offline for a pipeline or a checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import paddle
import paddle.nn.functional as F

from ldm.models.families import predict
from ldm.models.text import encode_prompt

logger = logging.getLogger("ldm.train")

NOISE_SEED = 20240305  # any fixed number: the noise of record i is drawn from a generator seeded (NOISE_SEED, i)


def fixed_timesteps(count: int, num_train_timesteps: int) -> list[int]:
    """The centres of `count` equal bins of the training schedule (1000 steps, 8: 62, 187, ..., 937)."""
    return [int((k + 0.5) * num_train_timesteps / count) for k in range(count)]


def read_records(file_list: str, samples: int, *, resolution: int, tokenizer, model_max_length: int,
                 autoencoder: str | None = None, autoencoder_source: str = "", buckets=None,
                 added_conditions: tuple[str, ...] = ()) -> list[dict]:
    """The first `samples` usable records of `file_list` in order (one pass; fewer when it holds fewer), each
    {"pixel_values" or "latent_moments", "input_ids", "added": the added conditions} without a batch axis."""
    from ldm.data.dataset import CaptionImageStream
    from ldm.data.filelist import check_shards, read_file_list
    from ldm.data.latents import LatentTransform
    from ldm.data.record import ImageTransform
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.models.conditioning import GEOMETRY

    shards = read_file_list(file_list)
    check_shards(shards, file_list)
    stream = CaptionImageStream(
        shards, tokenize=CaptionTokenizer(tokenizer, model_max_length),
        transform=ImageTransform(resolution, center_crop=True, random_flip=False, buckets=buckets),
        latents=LatentTransform(autoencoder, autoencoder_source, resolution, False, buckets,
                                reads_geometry=GEOMETRY in added_conditions) if autoencoder else None,
        batch_size=1, caption_dropout_prob=0.0, seed=0, rank=0, world_size=1, num_workers=0, shuffle_buffer=1)
    records = []
    for batch in stream.batches(0):
        if json.loads(batch["stream_state"])["pass"] > 0 or len(records) == samples:
            break
        record = {name: value[0] for name, value in batch.items() if name not in ("stream_state", "conditioning")}
        record["added"] = {name: value[0] for name, value in batch.get("conditioning", {}).get("added", {}).items()}
        records.append(record)
    return records


class HeldOut:
    """This rank's share of the held-out records, their latents encoded once (the autoencoder is frozen)."""

    def __init__(self, records: list[dict], timesteps: list[int], dist, batch_size: int = 8):
        self.total, self.timesteps, self.dist, self.batch_size = len(records), timesteps, dist, batch_size
        self.indices = list(range(dist.rank, len(records), dist.world_size))
        self.records = [records[i] for i in self.indices]
        self.latents: list[np.ndarray] | None = None
        by_shape: dict[tuple, list[int]] = {}  # a forward pass takes one shape (aspect-ratio buckets)
        for position, record in enumerate(self.records):
            sample = record["pixel_values"] if "pixel_values" in record else record["latent_moments"]
            by_shape.setdefault(sample.shape, []).append(position)
        self.chunks = [positions[start:start + batch_size] for positions in by_shape.values()
                       for start in range(0, len(positions), batch_size)]

    @paddle.no_grad()
    def _encode(self, model) -> list[np.ndarray]:
        from ldm.models.autoencoder import posterior, scaled_latents

        latents: list[np.ndarray | None] = [None] * len(self.records)
        for chunk in self.chunks:
            records = [self.records[p] for p in chunk]
            if "latent_moments" in records[0]:
                moments = paddle.to_tensor(np.stack([r["latent_moments"] for r in records])).astype("float32")
                mean = paddle.chunk(moments, 2, axis=1)[0]
            else:
                pixels = paddle.to_tensor(np.stack([r["pixel_values"] for r in records]))
                mean = posterior(model.vae, pixels, model.vae_dtype).mean.astype("float32")
            scaled = scaled_latents(model.vae, mean, model.scaling_factor).numpy()
            for position, latent in zip(chunk, scaled, strict=True):
                latents[position] = latent
        return latents

    @paddle.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        """{"loss": mean over records and timesteps, "loss_t<t>": mean over records} of `model` (a LatentDiffusion),
        the same on every rank (a collective)."""
        was_training = model.training
        model.eval()
        try:
            if self.latents is None:
                self.latents = self._encode(model)
            sums = np.zeros(len(self.timesteps))
            for chunk in self.chunks:
                sums += self._batch_sums(model, chunk)
        finally:
            if was_training:
                model.train()
        sums = np.sum(self.dist.gather(sums.tolist()), axis=0) / max(self.total, 1)
        metrics = {"loss": float(np.mean(sums))}
        metrics.update({f"loss_t{t}": float(v) for t, v in zip(self.timesteps, sums, strict=True)})
        return metrics

    def _batch_sums(self, model, chunk: list[int]) -> np.ndarray:
        indices = [self.indices[p] for p in chunk]
        latents = paddle.to_tensor(np.stack([self.latents[p] for p in chunk]))
        noise = paddle.to_tensor(np.stack([
            np.random.default_rng([NOISE_SEED, i]).standard_normal(latents.shape[1:]).astype("float32")
            for i in indices]))
        ids = paddle.to_tensor(np.stack([self.records[p]["input_ids"] for p in chunk]))
        names = set.intersection(*(set(self.records[p]["added"]) for p in chunk))
        added = {name: paddle.to_tensor(np.stack([self.records[p]["added"][name] for p in chunk])) for name in names}
        conditioning = replace(encode_prompt(model.text_encoder, ids), added=added)
        sums = []
        for t in self.timesteps:
            timesteps = paddle.full([len(indices)], t, dtype="int64" if model.flow is None else "float32")
            noisy, target = model.noised(latents, noise, timesteps)
            prediction = predict(model.unet, noisy, timesteps, conditioning).astype("float32")
            loss = F.mse_loss(prediction, target.astype("float32"), reduction="none").mean(axis=[1, 2, 3])
            sums.append(float(loss.astype("float64").sum()))
        return np.array(sums)
