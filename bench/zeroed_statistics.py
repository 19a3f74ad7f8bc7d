"""Diagnostics: the reduced presets with some fitted statistics set to zero (bench/variance.py --zero,
bench/reduction_components.py).

Each reduction term has zero mean for any coefficient that is a function of the other rows, so zeroing a
`KLStatistics` field (cv_coef = a, eos_coef = h, past_coef = lambda, baseline = m) keeps the gradient exact and shows
that term's share of the variance.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

from kl_adapters.reductions import ReductionConfig, reduction_config

FIELDS = ("cv_coef", "eos_coef", "past_coef", "baseline")
#: the `ReductionConfig` switch of each statistic
SWITCHES = {"cv_coef": "control_variate", "eos_coef": "termination", "past_coef": "past_kl", "baseline": "baseline"}


@contextmanager
def zeroed(names: tuple[str, ...] | list[str]) -> Iterator[None]:
    """Within the block, the fit returns its statistics with the named fields set to zero (their `ReductionConfig`
    switches off)."""
    unknown = [n for n in names if n not in FIELDS]
    if unknown:
        raise ValueError(f"unknown statistics {unknown}; choose from {', '.join(FIELDS)}")
    with reduction_config(ReductionConfig(**{SWITCHES[n]: False for n in names})):
        yield
