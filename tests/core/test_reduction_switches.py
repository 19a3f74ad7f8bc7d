"""Every switch of `ReductionConfig` earns its place (issue 45): with the switch on (its default) the gradient a trainer
takes (task + KL) has a lower variance than with it off, on a problem where its part acts, by a margin the test's own
noise cannot produce. `fit`, every part at once, is pinned by tests/core/test_reduction_benefit.py,
test_reduction_benefit_bigram.py and tests/trl/test_reduction_benefit_long_horizon.py; each other switch here.

* Exact (`bench/reduction_components.py`'s tabular problems: every ordered batch of G = 4, the batch size of
  tests/core/test_reduction_benefit.py, V = 3, T = 3; no noise, so the margin is the ratio itself): `control_variate`
  on the exact audit's drifted policy; `baseline`, `task` and `off_policy_task_weight` on the policy after 300 exact
  ascent steps towards pi*, off-policy; `baseline_fade` on the drifted policy far off-policy (mu = pi + 3 x N(0, 1)
  per logit: prefix weights past e^(+-4)).
* Monte Carlo (its bigram problems: G = 8, T = 64 and 256, every configuration on the same fixed-seed batches, a
  paired ratio with its standard error): `past_kl` and `james_stein` at a trained policy with the rewarded token;
  `unseen_tail` at a trained policy whose task penalizes a token the reference allows; `termination` on the KL term
  alone at T = 256, drift 0.2 (`rc.TIED`: the gradient of a group whose rewards tie, GRPO's advantages all zero).
  Each ratio must exceed its threshold and 1 + 5 standard errors.

Each threshold sits between 1 and the measured ratio (the comment beside it). Where each switch costs variance
instead, and every switch on every problem: docs/variance.md (the ablation, `bench/reduction_components.py`).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import reduction_components as rc  # noqa: E402

#: the exact pins' problems
PROBLEMS = {"drifted": lambda: rc.drifted(0, 1.0, None), "trained, off-policy": lambda: rc.trained(0, 300, True),
            "far off-policy": lambda: rc.drifted(1, 1.0, 3.0)}
#: switch -> (problem, the smallest ratio allowed): the exact pins
EXACT = {
    "control_variate": ("drifted", 1.05),  # measured 1.0753
    "baseline": ("trained, off-policy", 2.0),  # 2.9323
    "task": ("trained, off-policy", 1.5),  # 2.0473
    "off_policy_task_weight": ("trained, off-policy", 1.005),  # 1.0119
    "baseline_fade": ("far off-policy", 1.2),  # 1.3805
}
#: switch -> (bigram cell, the smallest ratio allowed): the Monte Carlo pins
MONTE_CARLO = {
    "past_kl": (rc.BigramCell(256, 0.2, "on", 80, 0.05, batches=256), 3.0),  # measured 5.5 +- 0.2 (512 batches)
    "james_stein": (rc.BigramCell(256, 0.2, "on", 80, 0.05, batches=256), 1.05),  # 1.108 +- 0.007
    "termination": (rc.TIED[1], 1.5),  # 2.389 +- 0.098 (KL term alone: a group whose rewards tie)
    "unseen_tail": (rc.BigramCell(64, 0.2, "on", 300, -0.5), 1.5),  # 2.39 +- 0.15
}


def test_every_switch_has_a_benefit_pin():
    assert {"fit", *EXACT, *MONTE_CARLO} == set(rc.SWITCHES)


@cache
def _variance(problem: str, switch: str | None) -> float:
    """Exact tr Cov of the trained gradient on one of PROBLEMS, with `switch` off (None: every switch on)."""
    return rc.tabular_variance(_problem(problem), rc.DEFAULT if switch is None else rc.without(switch))


@cache
def _problem(name: str) -> rc.Tabular:
    return PROBLEMS[name]()


@cache
def _monte_carlo(cell: rc.BigramCell) -> dict[str, tuple[float, float]]:
    return rc.bigram_ratios(cell, tuple(s for s, (c, _) in MONTE_CARLO.items() if c == cell))


@pytest.mark.parametrize("switch", sorted(EXACT))
def test_the_switch_lowers_the_exact_variance_of_the_trained_gradient(switch):
    problem, threshold = EXACT[switch]
    ratio = _variance(problem, switch) / _variance(problem, None)
    assert ratio > threshold, (f"{switch} off / on: {ratio:.4f} of the task + KL variance, exact at G = 4 "
                               f"on the {problem} problem (must be > {threshold}): the switch no longer earns its place")


@pytest.mark.parametrize("switch", sorted(MONTE_CARLO))
def test_the_switch_lowers_the_variance_of_the_trained_gradient_at_long_horizons(switch):
    cell, threshold = MONTE_CARLO[switch]
    ratio, se = _monte_carlo(cell)[switch]
    assert ratio > threshold and ratio - 5 * se > 1, (
        f"{switch} off / on: {ratio:.3f} +- {se:.3f} of the task + KL variance on the bigram at T = {cell.horizon}, "
        f"G = {cell.group} (must be > {threshold} and above 1 by 5 se): the switch no longer earns its place")
