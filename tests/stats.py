"""Goodness-of-fit helpers for the sampling tests (no scipy needed)."""

from __future__ import annotations

import math


def chi2_sf(x: float, df: int) -> float:
    """P(X² ≥ x) for df degrees of freedom: the regularized upper incomplete gamma Q(df/2, x/2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    lg = math.lgamma(a)
    if z < a + 1:  # series for P, then Q = 1 − P
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - lg))
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)  # Lentz continued fraction for Q
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - lg) * h


def chi2_pvalue(counts: dict, expected_p: dict) -> float:
    """Goodness of fit of observed counts to expected probabilities; bins with < 5 expected are pooled."""
    n = sum(counts.values())
    keys = set(counts) | set(expected_p)
    assert sum(counts.get(k, 0) for k in keys if expected_p.get(k, 0.0) == 0.0) == 0, "sampled a 0-prob token"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        e = n * expected_p.get(k, 0.0)
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_sf(stat, len(obs) - 1)
