"""The autoencoder's training objective and the measurement of its latent scale.

Loss: L1 reconstruction of the sampled posterior's decoding + `kl_weight` x KL(posterior || N(0, I))
(per image, summed over latent elements). The CompVis autoencoders add LPIPS and a patch
discriminator on top; both need pretrained or extra networks and are left out here.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import paddle
from paddle import nn


class AutoencoderTraining(nn.Layer):
    def __init__(self, vae: nn.Layer, kl_weight: float = 1e-6):
        super().__init__()
        self.vae, self.kl_weight = vae, float(kl_weight)

    def forward(self, pixel_values: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """(loss, L1 reconstruction error, KL per image)."""
        pixel_values = unit_range(pixel_values)
        posterior = self.vae.encode(pixel_values).latent_dist
        reconstruction = self.vae.decode(posterior.sample()).sample
        l1 = (reconstruction.astype("float32") - pixel_values.astype("float32")).abs().mean()
        kl = posterior.kl().astype("float32").mean()
        return l1 + self.kl_weight * kl, l1, kl


@paddle.no_grad()
def latent_moments(vae: nn.Layer, pixel_values: paddle.Tensor) -> np.ndarray:
    """[sum, sum of squares, count] of posterior samples: what the diffusion model is trained on."""
    latents = vae.encode(unit_range(pixel_values)).latent_dist.sample().astype("float64")
    return np.array([float(latents.sum()), float((latents * latents).sum()), latents.size], dtype=np.float64)


def shift_factor(vae) -> float:
    """The latents' shift (Stable Diffusion 3's 16-channel autoencoder: 0.0609), 0 for an autoencoder without one: a
    model is trained on (latents - shift) * scaling factor, and sampled images are decoded from latents / scaling
    factor + shift, as diffusers' SD3 training and pipeline do."""
    return float(vae.config.get("shift_factor") or 0.0)


def scaled_latents(vae, latents: paddle.Tensor, factor: float) -> paddle.Tensor:
    """Posterior samples (or means) -> what the diffusion model is trained on."""
    shift = shift_factor(vae)
    return (latents - shift) * factor if shift else latents * factor


def unscaled_latents(vae, latents: paddle.Tensor) -> paddle.Tensor:
    """A diffusion model's latents -> what the autoencoder decodes."""
    latents = latents / float(vae.config.scaling_factor)
    shift = shift_factor(vae)
    return latents + shift if shift else latents


def scaling_factor(moments: np.ndarray) -> float:
    """1 / standard deviation of the latents, so that scaled latents have unit variance."""
    total, squares, count = moments
    mean = total / count
    return float(1.0 / np.sqrt(max(squares / count - mean * mean, 1e-12)))


@paddle.no_grad()
def reconstruct(vae: nn.Layer, pixel_values: paddle.Tensor) -> np.ndarray:
    """uint8 [N, H, W, 3] decodings of the posterior means (what `reconstructions.png` shows)."""
    return to_uint8(vae.decode(vae.encode(unit_range(pixel_values)).latent_dist.mode()).sample)


def encode_autocast(dtype: str):
    """Where the frozen encoder runs: float32 (also under a training run's AMP), or float16/bfloat16 under
    autocast; its weights stay float32 either way, so its identity and its export do not change."""
    if dtype == "float32":
        return paddle.amp.auto_cast(enable=False)
    return paddle.amp.auto_cast(enable=True, dtype=dtype, level="O1")


def posterior(vae: nn.Layer, pixel_values: paddle.Tensor, dtype: str = "float32"):
    """The frozen encoder's posterior of a batch of pixels (uint8 or [-1, 1]), computed in `dtype`."""
    with encode_autocast(dtype):
        return vae.encode(unit_range(pixel_values)).latent_dist


def unit_range(pixels: paddle.Tensor) -> paddle.Tensor:
    """Batch pixels as float32 in [-1, 1] on the device: uint8 batches (as the loader sends them) are
    scaled here; float ones are taken as already scaled."""
    if pixels.dtype == paddle.uint8:
        return pixels.astype("float32") * (2.0 / 255.0) - 1.0
    return pixels.astype("float32")


def to_uint8(pixel_values: paddle.Tensor | np.ndarray) -> np.ndarray:
    """[-1, 1] NCHW pixels -> uint8 NHWC."""
    pixels = pixel_values.numpy() if isinstance(pixel_values, paddle.Tensor) else pixel_values
    return ((pixels / 2 + 0.5).clip(0, 1) * 255).round().astype(np.uint8).transpose(0, 2, 3, 1)


def autoencoder_identity(vae: nn.Layer) -> dict:
    """What makes two frozen autoencoders the same: a hash of the config and one of the weights.

    Recorded in every LDM checkpoint; resuming or exporting with another autoencoder is refused,
    because the UNet learned the latents of this one.
    """
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    weights = hashlib.sha256()
    for name, tensor in sorted(vae.state_dict().items()):
        array = np.ascontiguousarray(tensor.numpy())
        weights.update(f"{name}:{array.dtype}:{array.shape};".encode())
        weights.update(array.tobytes())
    return {"config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
            "weights_sha256": weights.hexdigest()}
