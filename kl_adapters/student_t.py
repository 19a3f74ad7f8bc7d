"""Student's t distribution: the two-sided p-value of a t statistic (the task and long-horizon reports' paired tests)
and its quantile (`kl-adapters measure`'s jackknife intervals). Pinned by tests/trl/test_long_horizon.py (p-values)
and tests/core/test_measure_statistics.py (quantiles against the table)."""

from __future__ import annotations

import math
from functools import cache


def two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with df degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    return _betainc(df / 2, 0.5, df / (df + t * t))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            numerator = 1.0
        elif i % 2 == 0:
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + numerator * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + numerator / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-14:
            break
    return front * (f - 1)


@cache
def quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (0.5 < p < 1): bisection on `two_sided_p`, to 1e-12."""
    low, high = 0.0, 1.0
    while two_sided_p(high, df) > 2 * (1 - p):
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if two_sided_p(mid, df) > 2 * (1 - p) else (low, mid)
        if high - low < 1e-12:
            break
    return (low + high) / 2
