"""One measurement: sampled prompt groups split into folds, each quantity's fold means, and what they estimate.

With E the exact KL gradient's estimate, D_c = (configuration c's KL gradient) - E on the same samples, T the task
gradient (GRPO's advantages; a reward is given) and the cross-fitted moments M, C of `crossfit` (M[a, b] estimates
<E[a], E[b]> without noise inflation, C[a] one prompt group's trace covariance), per configuration:

    bias      |E[D_c]| / |E[E]|                          = |E g_c - grad KL_seq| / |grad KL_seq| (the audit's bias)
    cosine    cos(E[E + D_c], E[E])                      the expected native gradient against the exact one
    trained   beta |E[D_c]| / |E[T + beta E]|            the bias against the expected trained gradient
    noise     beta |E[D_c]| / sigma,  sigma^2 = C[T + beta (E + D_c)] / (groups per step)
                                                         against one optimizer step's noise at the training batch
    horizon   (sigma / (beta |E[D_c]|))^2 = 1 / noise^2  steps until the bias, adding up linearly (n b), outweighs
                                                         the noise, adding up as sqrt(n) sigma (plain SGD, fixed policy)

Each with a jackknife interval over folds; `bias` and `horizon` are monotone maps of the interval of a ratio of
cross-fitted inner products (bias^2, noise^2), so an interval of bias^2 reaching below 0 gives a bias interval from 0.
The same for each completion-length bin of the first judged configuration: bias of the bin's own exact gradient, and
the bin's |E[D_c, bin]| / |E[E]| share. Sources: `ModelSource` (a transformers model, models.py) and the tests'
enumerable tabular and bigram policies (tests/core/test_measure_exact.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from torch import Tensor

from .crossfit import MIN_FOLDS, CrossFit, Interval, Moments
from .gradients import GradientView, TokenBatch, fold_vectors
from .plan import Plan

#: (stage, done, total) after each unit of work
Progress = Callable[[str, int, int], None]


class Source(Protocol):
    """Sampled completions, G per prompt group, already drawn; `batch` computes their log-probs with a gradient."""

    group_size: int
    off_policy: bool

    @property
    def lengths(self) -> Tensor: ...  # [groups, G] completion lengths (EOS included)

    def batch(self, groups: Tensor) -> TokenBatch: ...  # the rows of these groups, G consecutive rows each


@dataclass(frozen=True)
class Row:
    """One configuration's figures (trained, noise and horizon only with a task gradient)."""

    name: str
    preset: str
    judged: bool
    bias: Interval
    cosine: Interval
    absolute: Interval  # |E[D_c]| in the measured gradient's units
    trained: Interval | None = None
    noise: Interval | None = None
    horizon: Interval | None = None


@dataclass(frozen=True)
class LengthRow:
    low: int
    high: int  # [low, high) tokens
    completions: float  # share of the completions
    bias: Interval  # |E[D, bin]| / |E[E, bin]|
    share: Interval  # |E[D, bin]| / |E[E]|


@dataclass(frozen=True)
class Measurement:
    rows: tuple[Row, ...]
    by_length: tuple[LengthRow, ...]
    exact_norm: Interval  # |E[E]|, the exact KL gradient's norm (measured units)
    trained_norm: Interval | None  # |E[T + beta E]|
    folds: int
    groups: int
    group_size: int
    step_groups: float
    confidence: float
    beta: float

    def as_dict(self) -> dict:
        def plain(x):
            if isinstance(x, Interval):
                return x.as_dict()
            if isinstance(x, (list, tuple)):
                return [plain(v) for v in x]
            if isinstance(x, dict):
                return {k: plain(v) for k, v in x.items()}
            return x

        return {k: plain(v) for k, v in {**asdict(self), "rows": [r.__dict__ for r in self.rows],
                                         "by_length": [r.__dict__ for r in self.by_length],
                                         "exact_norm": self.exact_norm, "trained_norm": self.trained_norm}.items()}


def fold_of(groups: int, folds: int) -> Tensor:
    """[groups] fold index of each group, dealt round-robin (sizes differ by at most one)."""
    return torch.arange(groups) % folds


def collect(source: Source, plan: Plan, view: GradientView, *, folds: int, micro_batch: int,
            progress: Progress | None = None) -> tuple[Tensor, list[int]]:
    """[K, Q, m] fold means of every quantity and the folds' sizes (groups)."""
    groups, g = source.lengths.shape
    k = min(folds, groups)
    if k < MIN_FOLDS:
        raise ValueError(f"need at least {MIN_FOLDS} prompt groups for an interval, got {groups}")
    fold = fold_of(groups, k)
    per_batch = max(1, micro_batch // g)
    out = torch.zeros(k, len(plan.quantities), view.dimension, dtype=view.dtype, device=view.parameters[0].device)
    sizes, done = [], 0
    for f in range(k):
        ids = torch.nonzero(fold == f).flatten()
        sizes.append(len(ids))
        for start in range(0, len(ids), per_batch):
            chunk = ids[start:start + per_batch]
            out[f] += fold_vectors(source.batch(chunk), plan, view, 1.0 / (g * len(ids)))
            done += len(chunk)
            if progress:
                progress("gradients", done, groups)
    return out, sizes


def summarize(crossfit: CrossFit, plan: Plan, lengths: Tensor, *, step_batch: int, confidence: float) -> Measurement:
    """The figures of the module docstring from the folds' cross-fitted moments; lengths [groups, G] of the
    completions (their shares per bin)."""
    exact = plan.weights("exact")
    task = plan.weights("task") if plan.with_task else None
    group_size = lengths.shape[1]
    step_groups = step_batch / group_size

    def interval(statistic: Callable[[Moments], float]) -> Interval:
        return crossfit.interval(statistic, confidence)

    def rows_of(name: str, preset: str, judged: bool) -> Row:
        d = plan.weights(f"diff:{preset}")
        bias2 = interval(lambda m: _ratio(m.dot(d, d), m.dot(exact, exact)))
        cosine = interval(lambda m: _cosine(m, exact, d)).map(_unit)
        absolute = interval(lambda m: m.dot(d, d)).map(_root)
        if task is None:
            return Row(name, preset, judged, bias2.map(_root), cosine, absolute)
        trained = task + plan.beta * exact
        taken = trained + plan.beta * d
        beta2 = plan.beta ** 2
        trained2 = interval(lambda m: _ratio(beta2 * m.dot(d, d), m.dot(trained, trained)))
        noise2 = interval(lambda m: _ratio(beta2 * m.dot(d, d), m.variance(taken) / step_groups))
        return Row(name, preset, judged, bias2.map(_root), cosine, absolute, trained2.map(_root), noise2.map(_root),
                   Interval(_inverse(noise2.estimate), _inverse(noise2.high), _inverse(noise2.low)))

    judged = {c.preset for c in plan.judged}
    rows = [rows_of(c.name, c.preset, True) for c in plan.judged]
    rows += [rows_of(p, p, False) for p in plan.compared if p not in judged]
    by_length = []
    for b, (low, high) in enumerate(plan.bins):
        e_b, d_b = plan.weights(f"exact@{b}"), plan.weights(f"diff@{b}")
        inside = ((lengths >= low) & (lengths < high)).to(torch.float64).mean()
        by_length.append(LengthRow(low, high, float(inside),
                                   interval(lambda m: _ratio(m.dot(d_b, d_b), m.dot(e_b, e_b))).map(_root),
                                   interval(lambda m: _ratio(m.dot(d_b, d_b), m.dot(exact, exact))).map(_root)))
    trained_norm = None if task is None else interval(
        lambda m: m.dot(task + plan.beta * exact, task + plan.beta * exact)).map(_root)
    return Measurement(tuple(rows), tuple(by_length), interval(lambda m: m.dot(exact, exact)).map(_root),
                       trained_norm, crossfit.folds, int(crossfit.sizes.sum()), group_size, step_groups, confidence,
                       plan.beta)


def measure(source: Source, plan: Plan, view: GradientView, *, folds: int = 16, micro_batch: int = 64,
            step_batch: int = 64, confidence: float = 0.95, progress: Progress | None = None) -> Measurement:
    """Fold means of every quantity over `source`'s groups, then `summarize` (step_batch: completions per optimizer
    step, for the per-step noise)."""
    vectors, sizes = collect(source, plan, view, folds=folds, micro_batch=micro_batch, progress=progress)
    return summarize(CrossFit.of(vectors, sizes), plan, source.lengths, step_batch=step_batch, confidence=confidence)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _root(x: float) -> float:
    return math.sqrt(max(x, 0.0)) if not math.isnan(x) else math.nan


def _unit(x: float) -> float:
    """x clipped to [-1, 1] (a cosine), nan kept."""
    return x if math.isnan(x) else min(1.0, max(-1.0, x))


def _inverse(x: float) -> float:
    """1 / x for x = noise^2 (the horizon in steps): infinite where x <= 0 (no bias resolved)."""
    if math.isnan(x):
        return math.nan
    return 1.0 / x if x > 0 else math.inf


def _cosine(m: Moments, exact: Tensor, d: Tensor) -> float:
    ee, de, dd = m.dot(exact, exact), m.dot(d, exact), m.dot(d, d)
    nn = ee + 2 * de + dd
    return (ee + de) / math.sqrt(ee * nn) if ee > 0 and nn > 0 else math.nan
