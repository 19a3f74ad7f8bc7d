"""The bias-variance dial (issue 22): a discount gamma on the future-KL return of the discountable presets.

c_t = w_{1:t} k1_t + sum_{s>t} gamma^(s-t) (...): biased for gamma < 1 (the audit measures it, exactly), exact at
gamma = 1. The variance reductions stay exact relative to the discounted plain form: their added terms have zero
expectation whatever gamma (reductions.py), so over every ordered batch the reduced `sequence` and the plain
`sequence-plain` with the same gamma have the same expected gradient.
"""

import pytest
import torch

from kl_adapters import EndOfSequence, PRESETS, kl_coefficients, kl_surrogate
from kl_adapters.audit import audit, batch_moments, random_policies, relative_error
from kl_adapters.estimators import reverse_cumsum


@pytest.mark.parametrize("gamma", [1.0, 0.999, 0.99, 0.9, 0.5, 1e-3])
@pytest.mark.parametrize("width", [1, 7, 3000])
def test_discounted_reverse_cumsum_equals_the_recursion(gamma, width):
    x = torch.randn(2, 3, width, dtype=torch.float64, generator=torch.Generator().manual_seed(width))
    expected, acc = torch.empty_like(x), torch.zeros_like(x[..., 0])
    for t in range(width - 1, -1, -1):  # y_t = x_t + gamma y_{t+1}
        acc = x[..., t] + gamma * acc
        expected[..., t] = acc
    torch.testing.assert_close(reverse_cumsum(x, gamma), expected, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(reverse_cumsum(x.float(), gamma)).all()  # no power overflows in float32 at any length


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.discountable and not p.needs_full_logits])
def test_discount_one_is_the_exact_form(name):
    gen = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(5, 6, generator=gen), -torch.rand(5, 6, generator=gen)
    mask = torch.rand(5, 6, generator=gen) < 0.8
    assert torch.equal(kl_coefficients(logp, ref, mask, preset=name, discount=1.0),
                       kl_coefficients(logp, ref, mask, preset=name))
    assert not torch.equal(kl_coefficients(logp, ref, mask, preset=name, discount=0.5),
                           kl_coefficients(logp, ref, mask, preset=name))


@pytest.mark.parametrize("regime", ["on-policy", "off-policy"])
@pytest.mark.parametrize("size", [2, 3])
def test_reductions_stay_exact_relative_to_the_discounted_plain_form(regime, size):
    pol = random_policies(3, 3, 1, drift=0.8, off_policy=0.5)
    behaviour = pol.behaviour_logits if regime == "off-policy" else None
    rewards = torch.rand(pol.space.num_sequences, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    plain, _ = batch_moments(pol.space, pol.logits, pol.ref_logits, "sequence-plain", size,
                             behaviour_logits=behaviour, discount=0.7)
    reduced, _ = batch_moments(pol.space, pol.logits, pol.ref_logits, "sequence", size, behaviour_logits=behaviour,
                               discount=0.7, rewards=rewards, eos=True, precomputed=size == 3)
    assert relative_error(reduced, plain) < 1e-10


def test_the_audit_measures_the_dials_bias():
    """The bias grows as gamma falls and vanishes at gamma = 1 (exact enumeration, V = 3, T = 4)."""
    bias = {}
    for gamma in (0.5, 0.9, 0.99):
        rows = audit(3, 4, 0, presets=("sequence",), is_clip=None, discount=gamma)
        (row,) = [r for r in rows if r.discount == gamma and r.regime == "on-policy"]
        bias[gamma] = row.relative_bias
        assert row.target is None
    assert bias[0.5] > bias[0.9] > bias[0.99] > 1e-4
    exact = [r for r in audit(3, 4, 0, presets=("sequence",), is_clip=None) if r.regime == "on-policy"][0]
    assert exact.relative_bias < 1e-12


def test_bad_discounts_are_refused():
    logp, ref, mask = -torch.rand(2, 3), -torch.rand(2, 3), torch.ones(2, 3)
    for bad in (0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"discount must be a number in \(0, 1\]"):
            kl_surrogate(logp, ref, mask, discount=bad)
    with pytest.raises(ValueError, match="no future-KL return to discount"):
        kl_surrogate(logp, ref, mask, preset="k3-loss", discount=0.9)
    eos = EndOfSequence(torch.full((2, 3), 0.1), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.isfinite(kl_surrogate(logp, ref, mask, eos=eos, discount=0.9))
