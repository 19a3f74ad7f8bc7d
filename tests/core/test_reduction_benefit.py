"""The variance reductions' benefit, pinned (issue 36, part 1, its first step): on fixed-seed tabular problems the
gradient a GRPO trainer takes under `sequence` -- task + KL, GRPO advantages, the termination control variate on,
exact over every ordered batch of G = 4 (`audit.task_audit`) -- has a lower variance than under `sequence-plain`, the
same unbiased estimator without the fitted statistics (both have the same expected gradient: tests/core/test_cli.py).

The thresholds sit between the measured ratios (0.910-0.977 at V = 3, T = 3, seeds 0-2, on- and off-policy) and 1:
with the fit switched off (`reductions.ReductionConfig(fit=False)`: every fitted statistic zero) `sequence` is
`sequence-plain` exactly and the ratio is 1, which `test_the_pin_fails_with_the_fit_switched_off` checks, so a change
that quietly disables the fit fails here. The bigram at T = 256: tests/core/test_reduction_benefit_bigram.py; each
setting of the fit (wired, exact, the floors as conditions): tests/core/test_reduction_config.py; the long-horizon
GPT-2 at T = 32 through TRL: tests/trl/test_reduction_benefit_long_horizon.py.
"""

from __future__ import annotations

import pytest

from kl_adapters import reductions
from kl_adapters.audit import task_audit

#: fixed-seed problems: V = 3 tokens incl. EOS, T = 3, drift 1.0, behaviour policy 0.5 off (task_audit's defaults)
SEEDS = (0, 1, 2)
G = 4
#: the largest ratio sequence / sequence-plain allowed (measured: at most 0.977)
THRESHOLD = 0.985


def variance_ratios(seed: int) -> dict[str, float]:
    """regime -> Var(sequence's task + KL gradient) / Var(sequence-plain's), exact at batch size G."""
    rows = task_audit(3, 3, seed, batch_sizes=(G,))
    by = {(r.config, r.regime): r.variance[G] for r in rows}
    return {regime: by[("sequence", regime)] / by[("sequence-plain", regime)] for regime in ("on-policy", "off-policy")}


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_trains_a_less_noisy_gradient_than_sequence_plain(seed):
    ratios = variance_ratios(seed)
    assert all(r < THRESHOLD for r in ratios.values()), (
        f"seed {seed}: the trained gradient's variance, sequence / sequence-plain = {ratios} (must be < {THRESHOLD}): "
        "the variance reductions no longer lower the noise of what is trained")


def test_the_pin_fails_with_the_fit_switched_off():
    """Every fitted statistic zero (`ReductionConfig(fit=False)`): `sequence` becomes `sequence-plain` (ratio 1 to
    1e-12), above the threshold."""
    with reductions.reduction_config(reductions.ReductionConfig(fit=False)):
        ratios = variance_ratios(SEEDS[0])
    assert all(abs(r - 1) < 1e-12 for r in ratios.values()), ratios
    assert not all(r < THRESHOLD for r in ratios.values())
