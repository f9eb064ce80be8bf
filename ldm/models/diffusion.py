"""The training objective: a batch in, the loss out.

The wrapper owns no tokenizer, sampler or logger. The scheduler owns the noise math
(`add_noise`, `get_velocity`; rectified flow's is `ldm.models.noise`) and the VAE config its scaling factor.
"""

from __future__ import annotations

from dataclasses import replace

import paddle
import paddle.nn.functional as F
from paddle import nn
from ppdiffusers.models.vae import DiagonalGaussianDistribution

from ldm.models.autoencoder import posterior, scaled_latents
from ldm.models.conditioning import Conditioning
from ldm.models.families import family_of, predict_with_variance
from ldm.models.noise import (
    PREDICTION_TYPES,
    FlowSettings,
    draw_sigmas,
    flow_loss_weights,
    flow_noisy,
    prediction_type_of,
    scheduler_config,
    variational_bound,
)
from ldm.models.text import empty_caption, encode_prompt


def freeze(layer: nn.Layer) -> None:
    layer.eval()
    for parameter in layer.parameters():
        parameter.stop_gradient = True


class LatentDiffusion(nn.Layer):
    def __init__(
        self,
        unet: nn.Layer,
        text_encoder: nn.Layer,
        vae: nn.Layer,
        noise_scheduler,
        *,
        noise_offset: float = 0.0,
        snr_gamma: float | None = None,
        freeze_text_encoder: bool = False,
        recompute: bool = False,
        vae_dtype: str = "float32",
        flow: FlowSettings | None = None,
    ):
        """`flow`: how a flow-matching model (its scheduler is a flow one) draws σ and weights its loss."""
        super().__init__()
        prediction_type = prediction_type_of(scheduler_config(noise_scheduler))
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
        self.flow = (flow or FlowSettings()) if prediction_type == "flow_matching" else None
        self.unet, self.text_encoder, self.vae = unet, text_encoder, vae
        self.family = family_of(unet, text_encoder)
        self.noise_scheduler = noise_scheduler
        self.prediction_type = prediction_type
        self.noise_offset, self.snr_gamma = float(noise_offset), snr_gamma
        self.freeze_text_encoder = freeze_text_encoder
        self.vae_dtype = vae_dtype
        self.scaling_factor = float(vae.config.scaling_factor)
        freeze(vae)
        # LDMBert's `to_logits` head is never used to encode captions: keep it out of the optimizer
        # (and out of DataParallel's reducer, which would wait for its gradients forever).
        if hasattr(text_encoder, "to_logits"):
            freeze(text_encoder.to_logits)
        if freeze_text_encoder:
            freeze(text_encoder)
        if recompute:
            unet.enable_gradient_checkpointing()
            if not freeze_text_encoder and hasattr(text_encoder, "model"):  # LDMBert's; a frozen one keeps nothing
                text_encoder.model.gradient_checkpointing = True
        if self.flow is None:
            alphas_cumprod = noise_scheduler.alphas_cumprod.astype("float32")
            self.register_buffer("snr", alphas_cumprod / (1.0 - alphas_cumprod), persistable=False)
        self.empty: Conditioning | None = None  # the empty caption's text conditioning (a frozen encoder's)
        self.empty_ids: paddle.Tensor | None = None  # its token ids [1, L]

    def keep_empty_caption(self, input_ids) -> None:
        """Encode the empty caption's token ids once: a dropped caption's cached states are replaced by these (a
        frozen encoder gives every dropped caption the same states)."""
        self.empty_ids = paddle.to_tensor(input_ids)[None]
        with paddle.no_grad():
            self.empty = empty_caption(self.text_encoder, self.empty_ids).astype("float32")

    def train(self):
        super().train()
        self.vae.eval()
        if self.freeze_text_encoder:
            self.text_encoder.eval()
        return self

    @paddle.no_grad()
    def encode_latents(self, pixel_values: paddle.Tensor) -> paddle.Tensor:
        """Frozen VAE in `vae_dtype` (float32 by default, even under AMP): float32 latents shifted and scaled by the
        VAE config's factors (`scaled_latents`)."""
        latents = posterior(self.vae, pixel_values, self.vae_dtype).sample().astype("float32")
        return scaled_latents(self.vae, latents, self.scaling_factor)

    def encode_text(self, input_ids: paddle.Tensor) -> Conditioning:
        """The text conditioning of token ids (`ldm.models.text.encode_prompt`)."""
        if self.freeze_text_encoder:
            with paddle.no_grad():
                return encode_prompt(self.text_encoder, input_ids)
        return encode_prompt(self.text_encoder, input_ids)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.noise_scheduler.config.num_train_timesteps)

    def draw_timesteps(self, batch: int) -> paddle.Tensor:
        """The backbone's timesteps of a batch: DDPM's uniform integers, or flow matching's 1000 σ (float32)."""
        if self.flow is None:
            return paddle.randint(0, self.num_train_timesteps, [batch], dtype="int64")
        return draw_sigmas(batch, self.flow, float(self.noise_scheduler.config.shift)) * self.num_train_timesteps

    def noised(self, latents: paddle.Tensor, noise: paddle.Tensor, timesteps: paddle.Tensor):
        """(noisy latents, the backbone's target) at `timesteps`."""
        if self.flow is not None:
            return flow_noisy(latents, noise, timesteps.astype("float32") / self.num_train_timesteps)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            return noisy, noise
        return noisy, self.noise_scheduler.get_velocity(latents, noise, timesteps)

    def loss_weights(self, timesteps: paddle.Tensor) -> paddle.Tensor | None:
        """Min-SNR-gamma weighting (Hang et al. 2023): min(SNR, gamma) / SNR, or / (SNR + 1) for v; flow matching's
        `--flow_weighting`."""
        if self.flow is not None:
            return flow_loss_weights(timesteps.astype("float32") / self.num_train_timesteps, self.flow.weighting)
        if not self.snr_gamma:
            return None
        snr = self.snr[timesteps]
        clipped = paddle.minimum(snr, paddle.full_like(snr, self.snr_gamma))
        return clipped / (snr + 1.0) if self.prediction_type == "v_prediction" else clipped / snr

    @paddle.no_grad()
    def sample_latents(self, latent_moments: paddle.Tensor) -> paddle.Tensor:
        """Precomputed posterior moments (`ldm.data.latents`) -> scaled latents: what `encode_latents` gives."""
        sample = DiagonalGaussianDistribution(latent_moments.astype("float32")).sample()
        return scaled_latents(self.vae, sample, self.scaling_factor)

    def context(self, input_ids, conditioning: dict | None = None) -> Conditioning:
        """What the backbone is conditioned on: the text encoder's of `input_ids`, or the batch's cached text states
        (`conditioning`'s `states`, `mask`, `pooled`, float32 or int64 arrays) with the empty caption's where
        `dropped`; with the batch's added conditions (`added`) either way."""
        fields = dict(conditioning or {})
        dropped = fields.pop("dropped", None)
        given = Conditioning.from_arrays(fields)
        if input_ids is not None:
            found = replace(self.encode_text(input_ids), added=given.added)
            if self.empty is not None:  # a dropped caption's conditioning, as from cached states (`empty_caption`)
                dropped = (input_ids == self.empty_ids.astype(input_ids.dtype)).all(axis=1)
                found = found.text_where(dropped, self.empty.astype(found.states.dtype))
        elif given.states is None:
            raise ValueError("a batch without token ids needs cached text states")
        elif self.empty is None:
            raise ValueError("cached text states need the empty caption's (keep_empty_caption)")
        else:
            found = given.text_where(paddle.to_tensor(dropped).astype("bool"), self.empty)
        self.family.check_conditioning(found, self.unet)
        return found

    def forward(self, pixel_values: paddle.Tensor | None, input_ids: paddle.Tensor | None,
                latent_moments: paddle.Tensor | None = None, details: bool = False, conditioning: dict | None = None):
        """The loss of a batch of images (uint8 or [-1, 1]), or of their precomputed latents instead (and of their
        captions' token ids, or their cached text states: `context`); `details`: (loss, each sample's loss, each
        sample's timestep)."""
        if latent_moments is not None:
            latents = self.sample_latents(latent_moments)
        else:
            latents = self.encode_latents(pixel_values)
        batch = latents.shape[0]
        noise = paddle.randn(latents.shape, dtype=latents.dtype)
        if self.noise_offset:
            noise = noise + self.noise_offset * paddle.randn([batch, latents.shape[1], 1, 1], dtype=latents.dtype)
        timesteps = self.draw_timesteps(batch)
        noisy_latents, target = self.noised(latents, noise, timesteps)
        model_pred, variance = predict_with_variance(self.unet, noisy_latents, timesteps,
                                                     self.context(input_ids, conditioning))
        loss = F.mse_loss(model_pred.astype("float32"), target.astype("float32"), reduction="none")
        loss = loss.mean(axis=[1, 2, 3])
        weights = self.loss_weights(timesteps)
        if weights is not None:
            loss = loss * weights
        if variance is not None and self.prediction_type == "epsilon":  # learned sigma: PixArt's and DiT's hybrid loss
            loss = loss + variational_bound(self.noise_scheduler, latents, noisy_latents,
                                            model_pred.detach().astype("float32"), variance.astype("float32"),
                                            timesteps)
        return (loss.mean(), loss, timesteps) if details else loss.mean()
