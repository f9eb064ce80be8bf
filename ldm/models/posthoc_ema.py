"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models", EDM2;
their reference is NVlabs/edm2 `training/phema.py`): during training, EMAs of power-function profiles of a few
relative widths σ_rel, snapshotted at regular updates; after it, the EMA of any other width as a weighted sum of the
snapshots, the weights solving a small least-squares problem between the profiles.

A power-function EMA at time t averages the weights θ_τ of every earlier time with the density
p_t(τ) = (γ + 1) τ^γ / t^(γ+1) on [0, t]. Its width relative to t is σ_rel, with σ_rel² = (γ + 1) / ((γ + 2)² (γ + 3))
(the paper's eq. 123): γ → 0 is the plain average of the whole run, σ_rel = √(1/12) ≈ 0.2887, the widest a power
function has (γ > 0 here, as in the paper); larger γ is narrower. It is tracked by
θ̂_t = β_t θ̂_{t-1} + (1 - β_t) θ_t, β_t = (1 - 1/t)^(γ+1) (eq. 127), where t counts the run's updates (the paper
counts images: with a fixed batch the two are the same profile). β_1 = 0: the first update's weights start it, so its
starting value never matters.

The inner product of two profiles (a at time t_a with γ_a, b at t_b with γ_b, t_a ≤ t_b) is
∫ p_a p_b dτ = (γ_a + 1)(γ_b + 1) (t_a / t_b)^γ_b / ((γ_a + γ_b + 1) t_b) (the paper's eq. 151). The snapshots'
weights x solving min ‖Σ x_i p_i − p_target‖² satisfy the normal equations A x = b, A_ij = ⟨p_i, p_j⟩,
b_i = ⟨p_i, p_target⟩; they are then scaled to sum to 1, so that a reconstruction is an average of the snapshots.
"""

from __future__ import annotations

import math

import numpy as np

from ldm.models.ema import EMA
from ldm.runtime.errors import UserError

MAX_SIGMA_REL = math.sqrt(1 / 12)  # γ = 0: the plain average of every update so far
SNAPSHOT_DTYPES = ("auto", "float32", "float16")  # auto: the trained weights' own


class PosthocEMAError(UserError, ValueError):
    """A width no power function has, or a reconstruction the snapshots cannot give."""


def exponent(sigma_rel: float) -> float:
    """The power γ > 0 of the profile of relative width `sigma_rel`: the largest real root of
    γ³ + 7γ² + (16 − σ_rel⁻²)γ + 12 − σ_rel⁻² = 0, eq. 123 multiplied out."""
    sigma_rel = float(sigma_rel)
    if not 0 < sigma_rel < MAX_SIGMA_REL:
        raise PosthocEMAError(f"sigma_rel {sigma_rel:g} is outside what a power-function EMA can have: it must be in "
                              f"(0, {MAX_SIGMA_REL:.4f}) (sqrt(1/12): the plain average of the whole run)")
    t = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - t, 12.0 - t])
    return float(max(root.real for root in roots if abs(root.imag) < 1e-9))


def relative_width(gamma: float) -> float:
    """σ_rel of the profile of power `gamma` (eq. 123)."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def decay(gamma: float, t: int) -> float:
    """β_t = (1 − 1/t)^(γ+1): the decay of update t (counted from 1) of the profile of power `gamma`."""
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def inner_products(t_a, gamma_a, t_b, gamma_b) -> np.ndarray:
    """⟨p_a, p_b⟩ of profiles at times `t_a`, `t_b` (> 0) with powers `gamma_a`, `gamma_b`, broadcast (eq. 151)."""
    t_a, gamma_a, t_b, gamma_b = (np.asarray(v, np.float64) for v in (t_a, gamma_a, t_b, gamma_b))
    later_b = t_a <= t_b
    ratio = np.where(later_b, t_a / t_b, t_b / t_a)
    power = np.where(later_b, gamma_b, gamma_a)  # the later profile's power, over the earlier one's span
    return (gamma_a + 1) * (gamma_b + 1) * ratio ** power / ((gamma_a + gamma_b + 1) * np.maximum(t_a, t_b))


def coefficients(steps, sigma_rels, step: float, sigma_rel: float) -> np.ndarray:
    """The weights of snapshots (taken at updates `steps` of profiles of widths `sigma_rels`) whose sum is closest to
    the profile of width `sigma_rel` at update `step`, scaled to sum to 1."""
    gammas = np.array([exponent(s) for s in sigma_rels])
    times = np.asarray(steps, np.float64)
    gram = inner_products(times[:, None], gammas[:, None], times[None, :], gammas[None, :])
    target = inner_products(times, gammas, float(step), exponent(sigma_rel))
    try:
        solved = np.linalg.solve(gram, target)
    except np.linalg.LinAlgError:
        raise PosthocEMAError("the snapshots' profiles are linearly dependent (two snapshots of one profile at one "
                              "update?): no unique reconstruction") from None
    return solved / solved.sum()


class PowerEMA(EMA):
    """The EMA of one power-function profile (`ldm.models.ema.EMA` with the decay β_t above). `num_updates` is t,
    the run's update count: a skipped update (`skip`, a non-finite one) counts, its weights are not averaged in, so
    that the profile's time stays the run's update and a snapshot's step is its time."""

    def __init__(self, model, sigma_rel: float):
        super().__init__(model, decay=1.0 - 1e-9)  # the base's bound is unused: `decay` is the profile's own
        self.sigma_rel, self.gamma = float(sigma_rel), exponent(sigma_rel)

    def decay(self, update: int | None = None) -> float:
        return decay(self.gamma, self.num_updates if update is None else update)

    def skip(self) -> None:
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates, "sigma_rel": self.sigma_rel,
                **{f"shadow.{n}": t for n, t in self.shadow.items()}}


def profile_name(sigma_rel: float) -> str:
    """The state and file name of a profile in checkpoints and snapshots: `ema_sigma_rel-0.05`."""
    return f"ema_sigma_rel-{float(sigma_rel):g}"


def parse_sigma_rels(text: str | None, flag: str = "--ema_sigma_rels") -> list[float]:
    """`--ema_sigma_rels 0.05,0.10`: the widths, each a power function's, distinct by their names."""
    if not text:
        return []
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PosthocEMAError(f"{flag} takes widths separated by commas (0.05,0.10), not {text!r}") from None
    for value in values:
        exponent(value)
    if len({profile_name(v) for v in values}) != len(values):
        raise PosthocEMAError(f"{flag} {text}: a width is given twice")
    return values


class EMAProfiles:
    """A run's post-hoc EMA: one `PowerEMA` per width of `--ema_sigma_rels`, and when to snapshot them
    (`snapshot_steps`: every that many updates and at the last one; 0: never) in which dtype (`snapshot_dtype`:
    auto is the trained weights' own). Each profile is a part of the checkpoints (`ldm.checkpoint.manager`)."""

    def __init__(self, model, sigma_rels, snapshot_steps: int = 0, snapshot_dtype: str = "auto"):
        self.profiles = [PowerEMA(model, sigma_rel) for sigma_rel in sigma_rels]
        self.snapshot_steps = snapshot_steps
        trained = [p for p in model.parameters() if not p.stop_gradient]
        weights = str(trained[0].dtype).replace("paddle.", "") if trained else "float32"
        self.dtype = weights if snapshot_dtype == "auto" else snapshot_dtype
        if self.dtype not in ("float32", "float16"):  # bfloat16 weights: numpy, and so the snapshot, has no such type
            self.dtype = "float32"
        self.elements = sum(int(p.numel()) for p in trained)

    def updated(self, skipped: bool) -> None:
        """After an update: each profile averages its weights in, or counts it (`skipped`)."""
        for profile in self.profiles:
            profile.skip() if skipped else profile.update()

    def snapshot_due(self, step: int, *, last: bool, stopping: bool) -> bool:
        """Every `snapshot_steps` updates, and at the run's last (not at a stop: the resumed run goes on)."""
        return bool(self.snapshot_steps) and (step % self.snapshot_steps == 0 or (last and not stopping))

    def describe(self) -> dict:
        """The profiles and the snapshots' disk cost, for the run's record."""
        size = self.elements * (2 if self.dtype == "float16" else 4) * len(self.profiles)
        return {"sigma_rels": [p.sigma_rel for p in self.profiles], "gammas": [p.gamma for p in self.profiles],
                "snapshot_steps": self.snapshot_steps, "snapshot_dtype": self.dtype, "snapshot_bytes": size,
                "bytes_per_1000_updates": size * 1000 // self.snapshot_steps if self.snapshot_steps else 0}
