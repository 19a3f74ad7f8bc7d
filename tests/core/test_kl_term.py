"""kl_term: one validated pass gives exactly what kl_surrogate, kl_coefficients and sequence_kl give separately."""

import pytest
import torch

from kl_adapters import kl_coefficients, kl_surrogate, kl_term, sequence_kl


def _batch(seed=0, B=5, T=7):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old = logp.detach() + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.arange(T)[None] < torch.tensor([7, 3, 5, 1, 6])[:, None]
    return logp, ref, mask, old


@pytest.mark.parametrize("preset, is_clip", [("sequence", None), ("sequence", 1.5), ("reward", None), ("token", 2.0),
                                             ("k3-loss", None)])
@pytest.mark.parametrize("off_policy", [False, True])
def test_kl_term_equals_the_separate_functions(preset, is_clip, off_policy):
    logp, ref, mask, old = _batch()
    old = old if off_policy else None
    is_clip = is_clip if off_policy else None
    term = kl_term(logp, ref, mask, preset=preset, old_logp=old, is_clip=is_clip)
    assert torch.equal(term.coefficients, kl_coefficients(logp, ref, mask, preset=preset, old_logp=old, is_clip=is_clip))
    assert torch.equal(term.sequence_kl, sequence_kl(logp, ref, mask, old_logp=old, is_clip=is_clip))
    ours, theirs = term.surrogate(0.3), kl_surrogate(logp, ref, mask, preset=preset, beta=0.3, old_logp=old,
                                                     is_clip=is_clip)
    assert torch.equal(ours, theirs)
    assert torch.equal(*(torch.autograd.grad(x, logp, retain_graph=True)[0] for x in (ours, theirs)))
    assert torch.equal(term.coefficients_of("k3-loss"), kl_coefficients(logp, ref, mask, preset="k3-loss", old_logp=old))
    assert torch.equal(term.coefficients_of("token", on_policy=True), kl_coefficients(logp, ref, mask, preset="token"))


def test_kl_term_refuses_a_silent_is_clip():
    logp, ref, mask, old = _batch()
    with pytest.raises(ValueError, match="silent no-op"):
        kl_term(logp, ref, mask, preset="k3-loss", old_logp=old, is_clip=2.0)
    with pytest.raises(ValueError, match="beta"):
        kl_term(logp, ref, mask).surrogate(-1.0)
