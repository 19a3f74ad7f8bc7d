"""Diagnostics: the reduced presets with some fitted statistics set to zero (bench/variance.py --zero,
bench/reduction_components.py).

Each reduction term has zero mean for any coefficient that is a function of the other rows, so zeroing a
`KLStatistics` field (cv_coef = a, eos_coef = h, past_coef = lambda, baseline = m) keeps the gradient exact and shows
that term's share of the variance.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch

import kl_adapters.reductions as reductions

FIELDS = ("cv_coef", "eos_coef", "past_coef", "baseline")


@contextmanager
def zeroed(names: tuple[str, ...] | list[str]) -> Iterator[None]:
    """Within the block, reductions.batch_statistics returns its statistics with the named fields set to zero."""
    unknown = [n for n in names if n not in FIELDS]
    if unknown:
        raise ValueError(f"unknown statistics {unknown}; choose from {', '.join(FIELDS)}")
    fitted = reductions.batch_statistics

    def batch_statistics(*args, **kwargs):
        stats = fitted(*args, **kwargs).as_dict()
        return reductions.KLStatistics(**{k: torch.zeros_like(v) if k in names else v for k, v in stats.items()})

    reductions.batch_statistics = batch_statistics
    try:
        yield
    finally:
        reductions.batch_statistics = fitted
