"""How far two arithmetic paths of the same training may end apart, from the arithmetic (docs/training.md,
"Two forms of the same update"), not from one CPU's result.

Two runs that make the same updates by different arithmetic (the flat or per-tensor update, one rank or two, another
GEMM kernel on another CPU) compute every gradient with other roundings. float32 sums K terms in any order to within
K·u of the terms' magnitudes (u = 2^-24, Higham's bound for summation), and a gradient of the tiny models here passes
through D such reductions with K·D ≤ 2^14 (ldm-tiny: 2 × 2 samples × 8 × 8 latent positions per weight gradient, a few
dozen reductions deep). So each gradient is known to a relative `GRADIENT_ERROR` = 2^14·u = 2^-10, and so are AdamW's
moments, which sum gradients with fixed weights. AdamW's direction m̂/(√v̂ + ε) is a ratio of the two, of size about
1: an update of learning rate η moves a weight within η·GRADIENT_ERROR of the other path's, whatever the weight's own
size. A bias two updates from zero is η-sized, which is why a bound relative to each tensor's largest value failed
on another CPU; a weight near 1 adds a few roundings of its own (`ROUNDINGS_PER_UPDATE`: the decay, the step, the
EMA's interpolation and its rounding to float32).

Measured on ldm-tiny, 4 updates (docs/training.md): the forms of one machine end within 3 % of this bound, and the same
form with MKL's GEMM forced to another code path (MKL_CBWR=AVX2, another rounding of every matrix product) within 16 %;
a 1 % change of the learning rate exceeds it tenfold.
"""

import numpy as np

UNIT_ROUNDOFF = 2.0 ** -24
GRADIENT_ERROR = 2.0 ** -10
ROUNDINGS_PER_UPDATE = 4
GRADIENT_STATE = ("moment1", "moment2", "beta1_pow", "beta2_pow")


def training_bound(reference: np.ndarray, other: np.ndarray, name: str, learning_rate: float,
                   updates: int) -> np.ndarray:
    """The largest difference the arithmetic allows, element by element, between two paths' value of `name`
    (a weight, an EMA average or an AdamW state) after `updates` updates of learning rate at most `learning_rate`."""
    if any(kind in name for kind in GRADIENT_STATE):
        # a moment is a fixed weighted sum of gradients (a power of β, exact): the gradients' relative error, counted
        # twice for the second moment's square, of the tensor's own magnitude
        return (2 if "moment2" in name else 1) * GRADIENT_ERROR * np.abs(reference).max()
    size = np.maximum(np.abs(reference), np.abs(other))
    return GRADIENT_ERROR * learning_rate * updates + ROUNDINGS_PER_UPDATE * updates * UNIT_ROUNDOFF * size


def training_differences(a: dict, b: dict, learning_rate: float, updates: int) -> dict[str, float]:
    """Each tensor's largest difference between `a` and `b` as a fraction of what `training_bound` allows."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    fractions = {}
    for name in b:
        x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
        assert x.shape == y.shape, name
        bound = training_bound(y, x, name, learning_rate, updates)
        fractions[name] = float((np.abs(x - y) / np.maximum(bound, np.finfo(np.float64).tiny)).max(initial=0.0))
    return fractions


def assert_same_training(a: dict, b: dict, *, learning_rate: float, updates: int) -> None:
    """`a` and `b` (name → array: weights, EMA averages, AdamW state) end within what different roundings of the
    same `updates` updates allow."""
    fractions = training_differences(a, b, learning_rate, updates)
    worst = max(fractions, key=fractions.get, default=None)
    assert worst is None or fractions[worst] <= 1, (
        f"{worst}: {fractions[worst]:.3g} times what {updates} updates at learning rate {learning_rate:g} allow")


def assert_identical(a: dict, b: dict) -> None:
    """The same arithmetic: the same bits."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for name in a:
        assert np.array_equal(np.asarray(a[name]), np.asarray(b[name])), name
