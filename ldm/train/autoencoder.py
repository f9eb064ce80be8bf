"""Train the KL autoencoder (`train_autoencoder.py`) with the same loop, data path and checkpoints.

The result is `<output_dir>/vqvae/`: an `AutoencoderKL` folder in the pipeline layout whose
`scaling_factor` is 1 / std of its latents, measured after training on `--scale_batches` batches
per rank. Pass it to the LDM entry points with `--vae_name_or_path <output_dir>/vqvae`.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import paddle
from ppdiffusers import AutoencoderKL

from ldm.checkpoint.format import refuse_pickles, write_part_configs
from ldm.checkpoint.run_folder import atomic_folder
from ldm.checkpoint.serialization import writes_failing_as_os_errors
from ldm.config.args import AutoencoderArguments, DataArguments, LoopArguments, RunArguments
from ldm.inference.sampling import image_grid
from ldm.models.autoencoder import (
    AutoencoderTraining,
    latent_moments,
    reconstruct,
    scaling_factor,
    to_uint8,
    unit_range,
)
from ldm.models.buckets import parse_buckets, size_step
from ldm.models.build import load_part, vae_folder
from ldm.models.flops import forward_flops
from ldm.models.init import pytorch_default_init
from ldm.train.loop import train_objective
from ldm.train.objective import Objective

logger = logging.getLogger("ldm.train")


def build_autoencoder(name_or_path: str, seed: int):
    """(AutoencoderKL, loaded?) from a preset's vqvae/, a vqvae folder or a pipeline folder."""
    with paddle.utils.unique_name.guard():
        paddle.seed(seed)
        vae, loaded = load_part(AutoencoderKL, vae_folder(name_or_path))
        if not loaded:
            pytorch_default_init(vae)
    return vae, loaded


class Autoencoder(Objective):
    def __init__(self, args: AutoencoderArguments, loop: LoopArguments, data: DataArguments):
        self.args, self.resolution = args, data.resolution
        vae, loaded = build_autoencoder(args.model_name_or_path, loop.seed)
        self.vae = vae
        self.latent_scale = size_step(vae.config)
        self.buckets = parse_buckets(data.aspect_buckets, data.resolution, self.latent_scale, data.max_aspect_ratio)
        self.model = AutoencoderTraining(vae, args.kl_weight)
        count = sum(int(p.numel()) for p in vae.parameters())
        logger.info("autoencoder from %s: %.2fM parameters (%s), downsampling x%d, %d latent channels",
                    args.model_name_or_path, count / 1e6, "loaded" if loaded else "from scratch",
                    self.latent_scale, vae.config.latent_channels)

    def flops_per_sample(self, on_latents, shape=None):
        height, width = shape or (self.resolution, self.resolution)
        pixels = paddle.zeros([1, 3, height, width], dtype="float32")
        forward = sum(forward_flops(self.model, lambda: self.model(pixels)).values())
        return {"autoencoder": 3 * forward, "total": 3 * forward}  # every part trains: forward and backward

    def identity(self):
        return {**super().identity(), "source": self.args.model_name_or_path, "class": type(self.vae).__name__,
                "latent_channels": self.vae.config.latent_channels}

    def loss(self, net, batch):
        loss, l1, kl = net(batch["pixel_values"])
        return loss, {"reconstruction_l1": l1, "kl": kl}

    def trained_parts(self):
        return {"vqvae": self.vae}

    def save(self, folder, final_folder, shares):
        write_part_configs(folder, self.trained_parts(), shares)

    def load(self, folder):
        refuse_pickles(folder)
        self.vae.set_state_dict(AutoencoderKL.from_pretrained(os.path.join(folder, "vqvae")).state_dict())

    def log_images(self, writer, step, batch):
        if not writer.active:
            return
        pixels = batch["pixel_values"][:8]
        self.vae.eval()
        try:
            outputs = reconstruct(self.vae, paddle.to_tensor(pixels))
        finally:
            self.vae.train()
        inputs = to_uint8(unit_range(paddle.to_tensor(pixels)))
        grid = image_grid(np.concatenate([inputs, outputs]), rows=2)
        writer.image("reconstructions/inputs_vs_outputs", np.asarray(grid), step)

    def export(self, checkpoint, batches, dist, run_dir):
        self.vae.eval()
        moments = np.zeros(3)
        for _ in range(self.args.scale_batches):
            moments += latent_moments(self.vae, paddle.to_tensor(next(batches)["pixel_values"]))
        moments = np.array(dist.gather(moments.tolist())).sum(axis=0)
        factor = scaling_factor(moments)
        self.vae.register_to_config(scaling_factor=factor)
        if dist.is_main:
            final = run_dir.path("vqvae")
            with atomic_folder(final) as folder, writes_failing_as_os_errors(folder):
                self.vae.save_pretrained(folder, safe_serialization=True)
            logger.info("latent std %.4f over %d values: wrote %s with scaling_factor %.5f",
                        1 / factor, int(moments[2]), final, factor)


def train(loop: LoopArguments, args: AutoencoderArguments, data: DataArguments,
          run_args: RunArguments | None = None) -> dict:
    run_args = run_args or RunArguments()
    result = train_objective(loop, data, lambda dist, resume, resolved: Autoencoder(args, resolved, data),
                 image_logging_steps=args.image_logging_steps, run_args=run_args, groups=(args, data, loop, run_args))
    result["vqvae"] = os.path.join(loop.output_dir, "vqvae")
    return result
