"""What the core does with what real runs produce (issue 25): empty micro-batches, all-masked rows and micro-batches,
weights that overflow, and random shapes / masks / dtypes / group layouts for every preset.

- An empty micro-batch (B = 0: after a dynamic-sampling filter, on an idle data-parallel rank) contributes 0 with a
  graph through logp, so that a collective backward pass still matches across ranks.
- All-masked rows and micro-batches contribute 0; their statistics are finite.
- Importance weights or pi_ref/pi that would overflow the working dtype are capped (estimators.capped): the loss and
  its gradient stay finite (the exact value cannot be represented there).
- Property-based: every preset, on- and off-policy, with and without task advantages / end-of-sequence
  probabilities / groups, in float32, float64 and bf16 inputs, gives a finite loss and a finite gradient.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_adapters import (SAMPLED_TOKEN_PRESETS, EndOfSequence, TaskAdvantages, full_kl_surrogate, kl_statistics,
                         kl_surrogate, kl_term)

REDUCED = [n for n, p in SAMPLED_TOKEN_PRESETS.items() if p.uses_batch_statistics]


def _extras(logp, task, eos):
    """TaskAdvantages / EndOfSequence arguments for a [B, T] batch (zeros-based, shapes only)."""
    out = {}
    if task:
        out["task"] = TaskAdvantages(torch.zeros(logp.shape[0], dtype=logp.dtype), 0.1, task == "normalized")
    if eos:
        out["eos"] = EndOfSequence(torch.zeros_like(logp), torch.zeros(logp.shape, dtype=torch.bool))
    return out


@pytest.mark.parametrize("name", list(SAMPLED_TOKEN_PRESETS))
def test_empty_micro_batch_contributes_zero_with_a_graph(name):
    logp = torch.zeros(0, 5, requires_grad=True)
    ref, mask = torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool)
    extra = _extras(logp, "advantages", True) if name in REDUCED else {}
    loss = kl_surrogate(logp, ref, mask, preset=name, beta=0.3, old_logp=torch.zeros(0, 5), **extra)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert logp.grad.shape == (0, 5)
    term = kl_term(logp, ref, mask, preset=name)
    assert term.is_ess.item() == 1.0 and term.coefficients.shape == (0, 5)


def test_empty_micro_batch_of_full_and_of_statistics():
    logits = torch.zeros(0, 4, 7, requires_grad=True)
    loss = full_kl_surrogate(logits, torch.zeros(0, 4, 7), torch.zeros(0, 4, dtype=torch.long),
                             torch.zeros(0, 4, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    stats = kl_statistics(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))
    assert stats.baseline.shape == (0, 4) and stats.cv_coef.shape == (0,)


@pytest.mark.parametrize("name", REDUCED)
def test_all_masked_rows_and_micro_batches(name):
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    ref = -torch.rand(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) < 0.7
    mask[[1, 4]] = False  # two rows without a real token
    advantages = torch.randn(6, generator=gen, dtype=torch.float64)
    extra = {"task": TaskAdvantages(advantages, 0.2, True),
             "eos": EndOfSequence(torch.full((6, 5), 0.1, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.bool))}
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    stats = kl_statistics(logp, ref, mask, group=group, preset=name, **extra)
    assert all(torch.isfinite(v).all() for v in stats.as_dict().values())
    term = kl_term(logp, ref, mask, preset=name, group=group, **extra)
    assert torch.all(term.coefficients[[1, 4]] == 0) and torch.all(term.sequence_kl[[1, 4]] == 0)
    loss = kl_surrogate(logp, ref, torch.zeros_like(mask), preset=name, **extra)  # a micro-batch of padding only
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)


@pytest.mark.parametrize("name", list(SAMPLED_TOKEN_PRESETS))
def test_overflowing_weights_stay_finite(name):
    """float32: 40 tokens each 3 nats more likely under pi than under the behaviour policy (w_{1:40} = e^120, beyond
    float32), and a token pi all but excludes (pi_ref/pi = e^150): a finite loss and gradient, not a NaN that the
    optimizer would write into the parameters."""
    logp = torch.full((2, 40), -0.5, requires_grad=True)
    old = logp.detach() - 3.0
    ref = logp.detach().clone()
    ref[1, 7] = logp[1, 7].item() + 150.0
    extra = _extras(logp, "advantages", True) if name in REDUCED else {}
    uses_weights = SAMPLED_TOKEN_PRESETS[name].uses_importance_weights
    loss = kl_surrogate(logp, ref, torch.ones(2, 40), preset=name, old_logp=old if uses_weights else None, **extra)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("name", REDUCED)
def test_overflowing_weights_with_batch_statistics(name):
    """Six rows (so the leave-one-out fit runs) up to 20 nats per token more likely under pi than under the behaviour
    policy over 40 tokens: the fit's weights pass float64's range and the baseline times the row's own capped weight
    float32's; the statistics fall back to the plain form / a bounded baseline (functions of the other rows), so
    loss and gradient stay finite (was NaN)."""
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 40, generator=gen) - 0.1).requires_grad_(True)
    old = logp.detach() - 20.0 * torch.rand(6, 40, generator=gen)
    ref = logp.detach() + 0.1 * torch.randn(6, 40, generator=gen)
    extra = _extras(logp, "normalized", True)
    loss = kl_surrogate(logp, ref, torch.ones(6, 40), preset=name, old_logp=old, **extra)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    stats = kl_statistics(logp.detach(), ref, torch.ones(6, 40), preset=name, old_logp=old, **extra)
    assert all(torch.isfinite(x).all() for x in stats.as_dict().values())


@st.composite
def batches(draw):
    b, t = draw(st.integers(0, 6)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10 ** 6)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    logp = (-3 * torch.rand(b, t, generator=gen, dtype=torch.float64)).to(dtype)
    ref = (logp.double() + 2 * torch.randn(b, t, generator=gen, dtype=torch.float64)).clamp(max=0).to(dtype)
    old = (logp.double() + draw(st.sampled_from([0.0, 0.3, 3.0])) * torch.randn(b, t, generator=gen,
                                                                                  dtype=torch.float64)).to(dtype)
    density = draw(st.sampled_from([0.0, 0.5, 1.0]))
    mask = torch.rand(b, t, generator=gen) < density
    group = torch.randint(0, 3, (b,), generator=gen) if draw(st.booleans()) else None
    return logp, ref, old if draw(st.booleans()) else None, mask, group, gen


@settings(max_examples=150, deadline=None)
@given(batch=batches(), name=st.sampled_from(list(SAMPLED_TOKEN_PRESETS)),
       task=st.sampled_from([None, "advantages", "normalized"]), per_token=st.booleans(), eos=st.booleans(),
       rollout=st.booleans())
def test_every_preset_gives_a_finite_loss_and_gradient(batch, name, task, per_token, eos, rollout):
    logp, ref, old, mask, group, gen = batch
    reduced = name in REDUCED
    extra = {}
    if reduced and task:
        shape = logp.shape if per_token else logp.shape[:1]
        extra["task"] = TaskAdvantages(torch.randn(shape, generator=gen, dtype=torch.float64).to(logp.dtype), 0.05,
                                       task == "normalized")
    if reduced and eos:
        prob = (0.3 * torch.rand(logp.shape, generator=gen, dtype=torch.float64)).to(logp.dtype)
        extra["eos"] = EndOfSequence(prob, mask & (torch.rand(logp.shape, generator=gen) < 0.2))
    if reduced and group is not None:
        extra["group"] = group
    if reduced and rollout:  # the rollout-time path: statistics of the batch, passed to the loss
        stats = kl_statistics(logp, ref, mask, old_logp=old, preset=name, **extra)
        assert all(torch.isfinite(v).all() for v in stats.as_dict().values())
        extra = {"statistics": stats, **({"eos": extra["eos"]} if "eos" in extra else {})}
    x = logp.detach().clone().requires_grad_(True)
    old = old if SAMPLED_TOKEN_PRESETS[name].uses_importance_weights else None
    loss = kl_surrogate(x, ref, mask, preset=name, beta=0.5, old_logp=old, **extra)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert torch.all(x.grad[~mask] == 0)  # padding never receives a gradient
