"""Inner products of *expected* gradients from independent folds, not inflated by noise, with jackknife intervals.

The samples are split into K folds of independent units (prompt groups). Fold k holds, for each of Q measured
quantities q (gradient vectors: the exact KL gradient's estimate, a configuration's difference from it, the task
gradient, ...), the mean F_k[q] over its n_k units. Everything `kl-adapters measure` reports is a function of two
Q x Q matrices estimated from the fold Gram tensor G[j, k, q, r] = <F_j[q], F_k[r]>:

    M[q, r] = sum_{j != k} G[j, k, q, r] / (K (K - 1))
        unbiased for <mu_q, mu_r>, mu_q = E[F[q]]: two different folds are independent, so E<F_j, F_k> = <mu, mu>
        exactly, while |F_k|^2 itself would carry the noise tr Cov / n_k (the norm of an average is inflated by noise;
        a cross-fitted inner product is not). A negative M[q, q] means mu_q is not resolved from zero.
    C[q, r] = sum_k n_k <F_k[q] - Fbar[q], F_k[r] - Fbar[r]> / (K - 1),   Fbar = sum_k n_k F_k / N
        the per-unit covariance (trace of Cov over the vector's coordinates) of one unit's vectors.

Intervals: the delete-one-fold jackknife of the statistic (K replicates, each computed from K - 1 folds) and
Student's t with K - 1 degrees of freedom. Calibration on enumerable policies: tests/core/test_measure_exact.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..student_t import quantile

#: the fewest folds with a jackknife interval (K - 1 = 2 degrees of freedom, each replicate from 2 folds)
MIN_FOLDS = 3


@dataclass(frozen=True)
class Moments:
    """M (inner products of expected vectors) and C (per-unit covariance) over the Q quantities."""

    inner: Tensor  # [Q, Q]
    covariance: Tensor  # [Q, Q]

    def dot(self, a: Tensor, b: Tensor) -> float:
        """<a . mu, b . mu> for weight vectors a, b [Q] over the quantities."""
        return float(a @ self.inner @ b)

    def variance(self, a: Tensor) -> float:
        """tr Cov of one unit's a . F."""
        return float(a @ self.covariance @ a)


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval (nan where the statistic is undefined)."""

    estimate: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return {"estimate": _finite_or_none(self.estimate), "low": _finite_or_none(self.low),
                "high": _finite_or_none(self.high)}

    def map(self, f: Callable[[float], float]) -> Interval:
        """The interval of a non-decreasing function of the statistic."""
        return Interval(f(self.estimate), f(self.low), f(self.high))


def _finite_or_none(x: float) -> float | str | None:
    if math.isnan(x):
        return None
    return "inf" if math.isinf(x) else x


def fold_gram(folds: Tensor) -> Tensor:
    """G[j, k, q, r] = <F_j[q], F_k[r]> in float64 from fold means [K, Q, m]."""
    k, q, m = folds.shape
    flat = folds.reshape(k * q, m).to(torch.float64)
    return (flat @ flat.T).reshape(k, q, k, q).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class CrossFit:
    """The fold Gram tensor and fold sizes; `moments()` of every fold, or of all but one (`jackknife`)."""

    gram: Tensor  # [K, K, Q, Q] float64
    sizes: Tensor  # [K] units per fold, float64

    @classmethod
    def of(cls, folds: Tensor, sizes: list[int] | Tensor) -> CrossFit:
        sizes = torch.as_tensor(sizes, dtype=torch.float64)
        if folds.shape[0] < MIN_FOLDS or sizes.shape != (folds.shape[0],) or bool((sizes < 1).any()):
            raise ValueError(f"need at least {MIN_FOLDS} non-empty folds with one size each, got {folds.shape[0]} "
                             f"folds and sizes {sizes.tolist()}")
        return cls(fold_gram(folds), sizes)

    @property
    def folds(self) -> int:
        return self.gram.shape[0]

    def moments(self, keep: Tensor | None = None) -> Moments:
        """M and C from the folds where keep [K] is 1 (all folds by default)."""
        w = torch.ones(self.folds, dtype=torch.float64) if keep is None else keep.to(torch.float64)
        diagonal = torch.diagonal(self.gram, dim1=0, dim2=1).permute(2, 0, 1)  # [K, Q, Q] <F_k[q], F_k[r]>
        count = float(w.sum())
        pairs = torch.einsum("j,k,jkqr->qr", w, w, self.gram) - torch.einsum("k,kqr->qr", w, diagonal)
        n = w * self.sizes
        total = float(n.sum())
        spread = torch.einsum("k,kqr->qr", n, diagonal) - torch.einsum("j,k,jkqr->qr", n, n, self.gram) / total
        return Moments(pairs / (count * (count - 1)), spread / (count - 1))

    @cached_property
    def _all(self) -> Moments:
        return self.moments()

    @cached_property
    def _jackknife(self) -> list[Moments]:
        """The K delete-one-fold replicates' moments (computed once for every statistic)."""
        return [self.moments(keep) for keep in 1 - torch.eye(self.folds, dtype=torch.float64)]

    def interval(self, statistic: Callable[[Moments], float], confidence: float) -> Interval:
        """statistic(M, C) with a delete-one-fold jackknife interval (Student's t, K - 1 degrees of freedom).

        nan replicates (a ratio whose denominator is not resolved in some replicate) make the interval nan."""
        estimate = statistic(self._all)
        replicates = torch.tensor([statistic(m) for m in self._jackknife], dtype=torch.float64)
        k = self.folds
        if not (math.isfinite(estimate) and bool(torch.isfinite(replicates).all())):
            return Interval(estimate, math.nan, math.nan)
        se = math.sqrt((k - 1) / k * float((replicates - replicates.mean()).square().sum()))
        half = quantile(0.5 + confidence / 2, k - 1) * se
        return Interval(estimate, estimate - half, estimate + half)
