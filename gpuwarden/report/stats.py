"""Exact (Garwood) confidence intervals for a Poisson count. Pure.

For k events the interval of the mean is [chi2(a/2; 2k) / 2, chi2(1 - a/2; 2k + 2) / 2]. Up to
`EXACT_UP_TO` events the bounds are found where the Poisson tails equal a/2 (bisection on
`scoring.poisson_sf`, the lemon scorer's tail, exact there); above it, where that tail's
exp(-mean) would underflow, the chi-square quantiles come from Wilson-Hilferty's cube-root
normal approximation (relative error under 1e-4 at 2k > 600).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

from gpuwarden.lemon.scoring import poisson_sf

LEVEL = 0.95
EXACT_UP_TO = 300
METHOD = ("exact Poisson (Garwood) 95% interval on the failure count k: "
          "[chi2(0.025; 2k)/2, chi2(0.975; 2k+2)/2]")


def _bisect(tail: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """m in [lo, hi] with tail(m) = target, tail rising with m; bisection on log m."""
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if tail(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-12:
            break
    return math.sqrt(lo * hi)


def chi2_quantile(p: float, dof: int) -> float:
    """Wilson-Hilferty: dof * (1 - 2/(9 dof) + z sqrt(2/(9 dof)))^3."""
    z = NormalDist().inv_cdf(p)
    c = 2 / (9 * dof)
    return float(dof * (1 - c + z * math.sqrt(c)) ** 3)


def poisson_interval(k: int, level: float = LEVEL) -> tuple[float, float]:
    """(lower, upper) bound of the Poisson mean after seeing ``k`` events."""
    if k < 0:
        raise ValueError(f"a count, not {k}")
    a = (1 - level) / 2
    if k > EXACT_UP_TO:
        return chi2_quantile(a, 2 * k) / 2, chi2_quantile(1 - a, 2 * k + 2) / 2
    cap = k + 20 * math.sqrt(k + 1) + 20
    # Upper: P(X <= k; m) = a, i.e. P(X >= k + 1; m) = 1 - a. Lower: P(X >= k; m) = a.
    upper = _bisect(lambda m: poisson_sf(k + 1, m), 1 - a, 1e-12, cap)
    lower = 0.0 if k == 0 else _bisect(lambda m: poisson_sf(k, m), a, 1e-12, cap)
    return lower, upper


def mttf_interval(hours: float, failures: int) -> tuple[float | None, float | None]:
    """(low, high) MTTF in hours: hours / upper, hours / lower (None: no upper bound)."""
    if hours <= 0:
        return None, None
    lo, hi = poisson_interval(failures)
    return hours / hi, (hours / lo if lo > 0 else None)
