"""The post-hoc EMA's least-squares coefficients computed independently of `ldm.models.posthoc_ema`, in 50-digit
arithmetic (mpmath), written to tests/fixtures/posthoc_ema/coefficients.json for tests/test_ema_posthoc.py.

Written from the paper (Karras et al. 2024, EDM2, appendix C), not from the package's code:
- the power γ of a width σ_rel by bisection on σ_rel(γ)² = (γ + 1) / ((γ + 2)² (γ + 3)), decreasing for γ > 0 (the
  package takes the largest root of the cubic);
- a profile at time t: the density p(τ) = (γ + 1) τ^γ / t^(γ+1) on [0, t];
- the inner product of two profiles by numerical integration (tanh-sinh quadrature) of p_a p_b over [0, min(t_a,
  t_b)], checked against the integral done by hand, (γ_a + 1)(γ_b + 1) t_min^(γ_a+γ_b+1) / ((γ_a + γ_b + 1)
  t_a^(γ_a+1) t_b^(γ_b+1)), to 1e-20 of its value (far below float64's 1e-16);
- the normal equations A x = b by LU in 50 digits, x scaled to sum to 1.

    /work/refvenv/bin/python tests/reference/make_posthoc_ema_fixtures.py     (mpmath: any Python with it)
"""

import json
import os

import mpmath as mp

mp.mp.dps = 50
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "posthoc_ema",
                   "coefficients.json")


def gamma_of(sigma_rel):
    target = mp.mpf(sigma_rel) ** 2
    low, high = mp.mpf(0), mp.mpf(10) ** 6
    if not ((low + 1) / ((low + 2) ** 2 * (low + 3)) > target):
        raise ValueError(f"no power function has width {sigma_rel}")
    for _ in range(400):
        middle = (low + high) / 2
        if (middle + 1) / ((middle + 2) ** 2 * (middle + 3)) > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def density(t, gamma):
    return lambda tau: (gamma + 1) * tau ** gamma / t ** (gamma + 1)


def inner(t_a, g_a, t_b, g_b):
    t_a, t_b = mp.mpf(t_a), mp.mpf(t_b)
    end = min(t_a, t_b)
    a, b = density(t_a, g_a), density(t_b, g_b)
    numeric = mp.quad(lambda tau: a(tau) * b(tau), [0, end / 2, end])
    by_hand = (g_a + 1) * (g_b + 1) * end ** (g_a + g_b + 1) / ((g_a + g_b + 1) * t_a ** (g_a + 1) * t_b ** (g_b + 1))
    assert abs(numeric - by_hand) <= mp.mpf(10) ** -20 * by_hand, (numeric, by_hand)
    return by_hand


def solve(snapshots, step, sigma_rel):
    gammas = {s: gamma_of(s) for s in {w for _, w in snapshots} | {sigma_rel}}
    n = len(snapshots)
    gram = mp.matrix(n, n)
    right = mp.matrix(n, 1)
    for i, (t_i, w_i) in enumerate(snapshots):
        right[i] = inner(t_i, gammas[w_i], step, gammas[sigma_rel])
        for j, (t_j, w_j) in enumerate(snapshots):
            gram[i, j] = inner(t_i, gammas[w_i], t_j, gammas[w_j])
    x = mp.lu_solve(gram, right)
    total = sum(x)
    return [float(v / total) for v in x], float(mp.norm(gram, 1) * mp.norm(mp.inverse(gram), 1))


def case(every, last, step, sigma_rel, widths=(0.05, 0.10)):
    snapshots = [(t, w) for t in range(every, last + 1, every) for w in widths if t <= step]
    coefficients, condition = solve(snapshots, step, sigma_rel)
    return {"snapshots": [{"step": t, "sigma_rel": w} for t, w in snapshots], "step": step, "sigma_rel": sigma_rel,
            "coefficients": coefficients, "condition_number": condition}


def main():
    cases = [
        case(2, 6, 6, 0.05),  # a tracked width at a snapshot: that snapshot alone
        case(2, 6, 4, 0.10),
        case(2, 6, 6, 0.07),
        case(2, 6, 5, 0.13),  # between snapshots: those before it
        case(100, 800, 800, 0.08),
        case(100, 800, 800, 0.2),
        case(1000, 8000, 6000, 0.03),
        case(1000, 8000, 8000, 0.15, widths=(0.05, 0.10, 0.20)),
    ]
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"made_by": "tests/reference/make_posthoc_ema_fixtures.py", "cases": cases}, f, indent=1)
    for c in cases:
        print(f"{len(c['snapshots'])} snapshots, sigma_rel {c['sigma_rel']} at {c['step']}: condition number "
              f"{c['condition_number']:.3g}")


if __name__ == "__main__":
    main()
