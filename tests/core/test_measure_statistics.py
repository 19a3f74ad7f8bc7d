"""The statistics of `kl-adapters measure` (kl_adapters/measure/crossfit.py, gradients.py, plan.py) on known cases.

- M (the cross-fitted inner products) is the mean over ordered pairs of distinct folds of <F_j, F_k>, and unbiased
  for <mu, mu> where |F|^2 is inflated by the noise; C is the per-unit trace covariance (unbiased, unequal folds).
- The jackknife interval is the delete-one-fold formula; Student's t quantile is the table to its three decimals.
- The count sketch keeps inner products in expectation; the flat view is the gradient itself.
- GRPO advantages as TRL computes them; length bins; the plan's quantities and weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from kl_adapters.measure.crossfit import CrossFit
from kl_adapters.student_t import quantile as t_quantile
from kl_adapters.measure.gradients import GradientView, advantages
from kl_adapters.measure.plan import Plan, PlanError, configuration, length_bins


def test_t_quantile_matches_the_table():
    table = {2: 4.303, 3: 3.182, 5: 2.571, 10: 2.228, 15: 2.131, 30: 2.042, 100: 1.984}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=6e-4)


def test_moments_are_the_pair_and_spread_formulas():
    gen = torch.Generator().manual_seed(0)
    folds = torch.randn(5, 3, 7, generator=gen, dtype=torch.float64)
    sizes = [3, 4, 3, 5, 4]
    m = CrossFit.of(folds, sizes).moments()
    k = len(sizes)
    pairs = sum(folds[j] @ folds[i].T for j in range(k) for i in range(k) if i != j) / (k * (k - 1))
    torch.testing.assert_close(m.inner, pairs)
    n = torch.tensor(sizes, dtype=torch.float64)
    mean = (n[:, None, None] * folds).sum(0) / n.sum()
    spread = sum(n[i] * (folds[i] - mean) @ (folds[i] - mean).T for i in range(k)) / (k - 1)
    torch.testing.assert_close(m.covariance, spread)


def test_inner_products_are_not_inflated_by_noise_and_the_covariance_is_unbiased():
    """Fold means of n i.i.d. units around mu with per-unit covariance sigma^2 I: E[M] = |mu|^2 (|F|^2 would add
    d sigma^2 / n), E[C] = d sigma^2; averaged over 4000 draws."""
    gen = torch.Generator().manual_seed(1)
    d, sigma = 20, 2.0
    mu = torch.zeros(d, dtype=torch.float64)
    mu[0] = 0.3
    sizes = torch.tensor([5, 6, 5, 6, 5, 6])
    inner, cov = [], []
    for _ in range(4000):
        units = [mu + sigma * torch.randn(int(s), d, generator=gen, dtype=torch.float64) for s in sizes]
        folds = torch.stack([u.mean(0) for u in units])[:, None]
        m = CrossFit.of(folds, sizes).moments()
        inner.append(float(m.inner[0, 0]))
        cov.append(float(m.covariance[0, 0]))
    inner, cov = torch.tensor(inner), torch.tensor(cov)
    assert abs(float(inner.mean()) - 0.09) < 4 * float(inner.std()) / math.sqrt(len(inner))
    assert abs(float(cov.mean()) - d * sigma ** 2) < 4 * float(cov.std()) / math.sqrt(len(cov))


def test_the_interval_is_the_delete_one_fold_jackknife():
    gen = torch.Generator().manual_seed(2)
    folds = torch.randn(6, 2, 4, generator=gen, dtype=torch.float64) + 1.0
    cf = CrossFit.of(folds, [2] * 6)
    a, b = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)

    def statistic(m):
        return m.dot(a, b) / m.dot(b, b)

    interval = cf.interval(statistic, 0.9)
    reps = torch.tensor([statistic(CrossFit.of(folds[torch.arange(6) != i], [2] * 5).moments()) for i in range(6)])
    se = math.sqrt(5 / 6 * float((reps - reps.mean()).square().sum()))
    assert interval.estimate == pytest.approx(statistic(cf.moments()))
    assert interval.high - interval.estimate == pytest.approx(t_quantile(0.95, 5) * se)
    with pytest.raises(ValueError, match="at least 3"):
        CrossFit.of(folds[:2], [2, 2])


def test_the_sketch_keeps_inner_products_in_expectation_and_the_flat_view_is_the_gradient():
    gen = torch.Generator().manual_seed(3)
    params = [torch.zeros(30, 20, dtype=torch.float64, requires_grad=True),
              torch.zeros(50, dtype=torch.float64, requires_grad=True)]
    x = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    y = [xi + 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for xi, p in zip(x, params)]
    flat = GradientView(params)
    torch.testing.assert_close(flat.project(x), torch.cat([xi.flatten() for xi in x]))
    exact = float(flat.project(x) @ flat.project(y))
    sketched = torch.tensor([float(GradientView(params, 64, seed=s).project(x) @ GradientView(params, 64, seed=s)
                                   .project(y)) for s in range(300)], dtype=torch.float64)
    assert abs(float(sketched.mean()) - exact) < 4 * float(sketched.std()) / math.sqrt(300)
    one = GradientView(params, 64, seed=7)
    torch.testing.assert_close(one.project(x), one.project(x))  # regenerated identically
    assert one.project([None, x[1]]).shape == (64,)
    with pytest.raises(ValueError, match="no parameter"):
        GradientView([torch.zeros(3)])


def test_advantages_are_trl_group_scaled():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    centred = advantages(rewards, group, scale=False)
    torch.testing.assert_close(centred[:4], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))
    scaled = advantages(rewards, group, scale=True)
    std = rewards[:4].std()  # Bessel's correction, as TRL's nanstd
    torch.testing.assert_close(scaled[:4], (centred[:4] / (std + 1e-4)).double())
    assert scaled[4:].abs().max() == 0  # a group whose rewards tie has no advantage


def test_length_bins_and_the_plan():
    lengths = torch.tensor([[1, 2, 3, 4], [4, 4, 2, 1]])
    assert length_bins(lengths, 2) == ((1, 3), (3, 5))
    assert length_bins(lengths, (2, 3)) == ((1, 2), (2, 3), (3, 5))
    assert length_bins(lengths, 1) == ((1, 5),)
    plan = Plan((configuration("trl-default"), configuration("k3-loss")), 0.1, ((1, 3), (3, 5)), with_task=True)
    assert plan.split == "token"
    assert plan.quantities[:4] == ("exact@0", "exact@1", "judged@0", "judged@1") and plan.quantities[-1] == "task"
    assert "diff:token" not in plan.quantities and "diff:k3-loss" in plan.quantities
    index = {q: i for i, q in enumerate(plan.quantities)}
    w = plan.weights("exact", "diff:token")
    assert {q for q in index if w[index[q]]} == {"exact@0", "exact@1", "judged@0", "judged@1"}
    with pytest.raises(PlanError, match="did you mean 'trl-default'"):
        configuration("trl-defualt")
    with pytest.raises(PlanError, match="cannot be measured"):
        configuration("verl:abs")
    with pytest.raises(PlanError, match="beta must be > 0"):
        Plan((configuration("token"),), 0.0, ((1, 2),))
