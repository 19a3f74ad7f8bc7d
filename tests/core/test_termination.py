"""The termination control variate's increments eta_t = nu_t (p_t - e_t) (reductions.termination_increments)."""

from __future__ import annotations

import pytest
import torch

from kl_adapters import EndOfSequence, kl_surrogate
from kl_adapters.reductions import termination_increments


def _nu_by_definition(p: float, after: int, gamma: float) -> float:
    """nu = sum_{k=1}^{n} gamma^k (1 - p)^(k - 1): the discounted count of the positions a stop at t gives up."""
    return sum(gamma ** k * (1 - p) ** (k - 1) for k in range(1, after + 1))


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_increments_equal_their_definition(gamma):
    gen = torch.Generator().manual_seed(0)
    width, horizon = 7, 9
    prob = torch.rand(3, width, generator=gen, dtype=torch.float64)
    prob[0, :3] = torch.tensor([0.0, 1.0, 1e-13], dtype=torch.float64)
    is_eos = torch.rand(3, width, generator=gen) < 0.3
    mask = torch.ones(3, width, dtype=torch.float64)
    got = termination_increments(EndOfSequence(prob, is_eos, horizon), mask, torch.float64, gamma)
    for b in range(3):
        for t in range(width):
            p = float(prob[b, t])
            want = _nu_by_definition(p, horizon - 1 - t, gamma) * (p - float(is_eos[b, t]))
            assert got[b, t].item() == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_certain_and_impossible_stops_stay_finite(dtype, gamma):
    """p = 1 at the last position (q = 0 and nothing left to give up) once gave NaN in float32 (0 x log 0)."""
    prob = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]], dtype=dtype)
    is_eos = torch.tensor([[True, False, False, True], [True, True, False, False]])
    mask = torch.ones(2, 4, dtype=dtype)
    eta = termination_increments(EndOfSequence(prob, is_eos), mask, dtype, gamma)
    assert torch.isfinite(eta).all()
    assert eta[0, 3] == 0 and eta[1, 3] == 0  # the last position gives up nothing
    logp = torch.full((2, 4), -0.5, dtype=dtype, requires_grad=True)
    loss = kl_surrogate(logp, logp.detach() - 0.1, mask, eos=EndOfSequence(prob, is_eos), discount=gamma)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_padding_gives_zero_whatever_it_holds():
    prob = torch.tensor([[0.2, 0.7, 2.0, float("nan")]])
    is_eos = torch.tensor([[False, True, True, True]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    eta = termination_increments(EndOfSequence(prob, is_eos), mask, torch.float32)
    assert eta[0, 2:].tolist() == [0.0, 0.0]
    assert torch.isfinite(eta).all()
