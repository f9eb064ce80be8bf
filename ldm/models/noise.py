"""The noise processes a model trains on, chosen by its scheduler's config: DDPM (the target is the noise,
`epsilon`, or the velocity, `v_prediction`) or rectified flow (`flow_matching`).

Flow matching, as Stable Diffusion 3 trains it (Esser et al. 2024) and diffusers' `train_dreambooth_sd3.py` computes
it: x_t = (1 - σ) x0 + σ ε, the target ε - x0, the backbone's timestep 1000 σ (`FlowMatchEulerDiscreteScheduler`'s
convention). σ is drawn logit-normal, uniform or by SD3's mode sampling (`compute_density_for_timestep_sampling`),
then moved by the scheduler's resolution `shift` (σ' = shift σ / (1 + (shift - 1) σ)); the loss may be weighted
(`compute_loss_weighting_for_sd3`). The scheduler that samples is built from the same config (`sampling_scheduler`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import paddle

PREDICTION_TYPES = ("epsilon", "v_prediction", "flow_matching")
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)
SIGMA_SAMPLING = ("logit_normal", "uniform", "mode")
FLOW_WEIGHTING = ("none", "sigma_sqrt", "cosmap")


def scheduler_config(scheduler) -> dict:
    """A live scheduler's config as its `scheduler_config.json` holds it: with its class (`is_flow` reads it)."""
    return {**dict(scheduler.config), "_class_name": type(scheduler).__name__}


def is_flow(config: dict) -> bool:
    """Whether a scheduler config (`scheduler_config.json`'s, or `scheduler_config`'s) describes rectified flow."""
    return config.get("_class_name") in FLOW_SCHEDULERS


def prediction_type_of(config: dict) -> str:
    return "flow_matching" if is_flow(config) else config.get("prediction_type", "epsilon")


def training_scheduler(config: dict):
    """The training noise scheduler of a config: `FlowMatchEulerDiscreteScheduler` or `DDPMScheduler`."""
    from ppdiffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    return (FlowMatchEulerDiscreteScheduler if is_flow(config) else DDPMScheduler).from_config(config)


@dataclass(frozen=True)
class FlowSettings:
    """How flow matching draws σ and weights the loss (training only: the scheduler's config holds the shift)."""

    sigma_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    weighting: str = "none"


def shifted(sigmas: paddle.Tensor, shift: float) -> paddle.Tensor:
    """The resolution shift of SD3 (its paper, section 5.3.2): more noise for more pixels at the same σ."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def draw_sigmas(count: int, settings: FlowSettings, shift: float = 1.0) -> paddle.Tensor:
    """`count` noise levels in (0, 1), float32, from the global generator. The SD3 paper's t is the noise level, so
    a logit-normal mean > 0 means more noise (diffusers indexes its descending timesteps with u, which flips it)."""
    if settings.sigma_sampling == "logit_normal":
        u = paddle.nn.functional.sigmoid(paddle.normal(settings.logit_mean, settings.logit_std, [count]))
    else:
        u = paddle.rand([count], dtype="float32")
        if settings.sigma_sampling == "mode":
            u = 1 - u - settings.mode_scale * (paddle.cos(math.pi * u / 2) ** 2 - 1 + u)
    return shifted(u.astype("float32"), shift)


def flow_loss_weights(sigmas: paddle.Tensor, weighting: str) -> paddle.Tensor | None:
    """diffusers' `compute_loss_weighting_for_sd3`: `sigma_sqrt` is σ⁻², `cosmap` 2 / (π (1 - 2σ + 2σ²))."""
    if weighting == "sigma_sqrt":
        return sigmas ** -2.0
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return None


def flow_noisy(latents: paddle.Tensor, noise: paddle.Tensor, sigmas: paddle.Tensor):
    """(x_t, target) of rectified flow at per-sample σ."""
    sigma = sigmas.reshape([-1] + [1] * (latents.ndim - 1)).astype(latents.dtype)
    return (1 - sigma) * latents + sigma * noise, noise - latents


# -- learned sigma: improved DDPM's variational bound (Nichol & Dhariwal 2021), as DiT and PixArt-α train it ---------
def _normal_kl(mean1, logvar1, mean2, logvar2):
    return 0.5 * (-1.0 + logvar2 - logvar1 + paddle.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * paddle.exp(-logvar2))


def _standard_normal_cdf(x):
    return 0.5 * (1.0 + paddle.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _discretized_gaussian_log_likelihood(x, means, log_scales):
    """guided-diffusion's decoder likelihood of x in 255 bins of [-1, 1] (applied to latents as DiT does)."""
    centered, inv_stdv = x - means, paddle.exp(-log_scales)
    cdf_plus = _standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = _standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = paddle.log(cdf_plus.clip(min=1e-12))
    log_one_minus_cdf_min = paddle.log((1.0 - cdf_min).clip(min=1e-12))
    log_delta = paddle.log((cdf_plus - cdf_min).clip(min=1e-12))
    return paddle.where(x < -0.999, log_cdf_plus, paddle.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def variational_bound(scheduler, latents, noisy, epsilon, variance, timesteps):
    """Each sample's term of the variational bound in bits per dimension (guided-diffusion's `_vb_terms_bpd`), the
    variance "learned_range" (`variance` in [-1, 1] interpolates log β_t and the posterior's clipped log variance),
    the mean from `epsilon` as given (the caller detaches it: the bound trains the variance only, as DiT's
    `frozen_out`). At t = 0 the decoder's negative log-likelihood, elsewhere KL(posterior || model)."""
    betas = scheduler.betas.astype("float32")
    alphas_cumprod = scheduler.alphas_cumprod.astype("float32")
    previous = paddle.concat([paddle.ones([1]), alphas_cumprod[:-1]])
    posterior_variance = betas * (1.0 - previous) / (1.0 - alphas_cumprod)
    clipped = paddle.log(paddle.concat([posterior_variance[1:2], posterior_variance[1:]]))

    def at(table):
        return paddle.gather(table, timesteps).reshape([-1, 1, 1, 1])

    a_bar, a_prev, beta = at(alphas_cumprod), at(previous), at(betas)
    coef_x0, coef_xt = beta * paddle.sqrt(a_prev) / (1 - a_bar), (1 - a_prev) * paddle.sqrt(1 - beta) / (1 - a_bar)
    true_mean, true_log_variance = coef_x0 * latents + coef_xt * noisy, at(clipped)
    frac = (variance + 1) / 2
    model_log_variance = frac * paddle.log(beta) + (1 - frac) * true_log_variance
    predicted_x0 = paddle.sqrt(1 / a_bar) * noisy - paddle.sqrt(1 / a_bar - 1) * epsilon
    model_mean = coef_x0 * predicted_x0 + coef_xt * noisy
    kl = _normal_kl(true_mean, true_log_variance, model_mean, model_log_variance).mean(axis=[1, 2, 3]) / math.log(2.0)
    nll = -_discretized_gaussian_log_likelihood(latents, model_mean, 0.5 * model_log_variance).mean(
        axis=[1, 2, 3]) / math.log(2.0)
    return paddle.where(timesteps == 0, nll, kl)
