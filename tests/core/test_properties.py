"""Property tests of kl_surrogate and friends over random shapes, masks, dtypes and presets (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_adapters import SAMPLED_TOKEN_PRESETS, kl_coefficients, kl_reward, kl_surrogate, sequence_kl

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@st.composite
def batches(draw, off_policy=None):
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None] < lengths[:, None]
    if draw(st.booleans()):  # holes, e.g. tool tokens the policy did not sample
        mask &= torch.rand(b, t, generator=gen) > 0.2
    mask_kind = draw(st.sampled_from(["bool", "long", "float"]))
    mask = {"bool": mask, "long": mask.long(), "float": mask.float()}[mask_kind]
    lp = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 3).to(dtype)
    ref = (lp.double() + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)).to(dtype)
    use_old = draw(st.booleans()) if off_policy is None else off_policy
    old = (lp.double() + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)).to(dtype) if use_old else None
    return lp, ref, mask, old


def _grad(lp, ref, mask, old, **kw):
    x = lp.clone().requires_grad_(True)
    out = kl_surrogate(x, ref, mask, old_logp=old, **kw)
    out.backward()
    return out, x.grad


@settings(max_examples=60, deadline=None)
@given(batch=batches(), name=st.sampled_from(list(SAMPLED_TOKEN_PRESETS)), beta=st.floats(0, 3))
def test_output_scalar_wide_dtype_and_gradient_is_beta_over_b_times_coefficients(batch, name, beta):
    lp, ref, mask, old = batch
    out, g = _grad(lp, ref, mask, old, preset=name, beta=beta)
    assert out.dim() == 0 and out.dtype in (torch.float32, torch.float64)
    assert torch.isfinite(out)
    coef = kl_coefficients(lp, ref, mask, preset=name, old_logp=old)
    expected = (beta * coef / lp.shape[0]).to(g.dtype)
    assert torch.allclose(g.double(), expected.double(), rtol=2e-2 if lp.dtype in (torch.bfloat16, torch.float16) else 1e-5,
                          atol=1e-6)
    assert torch.all(g[~mask.bool()] == 0)  # padding never receives gradient


@settings(max_examples=40, deadline=None)
@given(batch=batches(), name=st.sampled_from(list(SAMPLED_TOKEN_PRESETS)))
def test_padding_junk_is_never_read(batch, name):
    lp, ref, mask, old = batch
    pad = ~mask.bool()
    junk = lambda x: None if x is None else x.masked_fill(pad, float("nan"))  # noqa: E731
    out1, g1 = _grad(lp, ref, mask, old, preset=name)
    out2, g2 = _grad(junk(lp), junk(ref), mask, junk(old), preset=name)
    assert torch.equal(out1, out2) and torch.equal(g1, g2)


@settings(max_examples=40, deadline=None)
@given(batch=batches(), name=st.sampled_from(list(SAMPLED_TOKEN_PRESETS)), extra=st.integers(1, 3))
def test_extra_padding_columns_and_batch_order_do_not_matter(batch, name, extra):
    lp, ref, mask, old = batch
    out, g = _grad(lp, ref, mask, old, preset=name)
    padc = lambda x: None if x is None else torch.cat([x, torch.zeros(x.shape[0], extra, dtype=x.dtype)], -1)  # noqa
    out_p, g_p = _grad(padc(lp), padc(ref), padc(mask), padc(old), preset=name)
    assert torch.allclose(out, out_p) and torch.allclose(g, g_p[:, : lp.shape[1]])
    perm = torch.randperm(lp.shape[0])
    sel = lambda x: None if x is None else x[perm]  # noqa: E731
    out_r, g_r = _grad(sel(lp), sel(ref), sel(mask), sel(old), preset=name)
    assert torch.allclose(out, out_r, rtol=1e-5, atol=1e-6) and torch.allclose(g[perm], g_r)


@settings(max_examples=40, deadline=None)
@given(batch=batches(off_policy=False))
def test_on_policy_identities(batch):
    """On-policy: sequence and reward give the same per-sample gradient; old_logp = logp is the on-policy case."""
    lp, ref, mask, _ = batch
    _, g_seq = _grad(lp, ref, mask, None, preset="sequence")
    _, g_rew = _grad(lp, ref, mask, None, preset="reward")
    assert torch.allclose(g_seq, g_rew, rtol=1e-5, atol=1e-6)
    for name in ("sequence", "token", "reward"):
        _, g_on = _grad(lp, ref, mask, None, preset=name)
        _, g_same = _grad(lp, ref, mask, lp.detach(), preset=name)
        assert torch.allclose(g_on, g_same)


@settings(max_examples=40, deadline=None)
@given(batch=batches(), beta=st.floats(0.01, 2))
def test_value_is_beta_times_mean_sequence_kl_and_nonnegative(batch, beta):
    lp, ref, mask, old = batch
    out = kl_surrogate(lp, ref, mask, beta=beta, old_logp=old)
    per_seq = sequence_kl(lp, ref, mask, old_logp=old)
    assert torch.all(per_seq >= 0)
    assert torch.allclose(out, beta * per_seq.mean(), rtol=1e-5, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(batch=batches(off_policy=False), beta=st.floats(0, 2))
def test_kl_reward_is_detached_minus_beta_k1_and_its_return(batch, beta):
    lp, ref, mask, _ = batch
    x = lp.clone().requires_grad_(True)
    r = kl_reward(x, ref, mask, beta=beta)
    rtg = kl_reward(x, ref, mask, beta=beta, to_go=True)
    assert not r.requires_grad and not rtg.requires_grad
    m = mask.bool()
    wide = torch.float64 if lp.dtype == torch.float64 else torch.float32
    k1 = torch.where(m, lp.to(wide) - ref.to(wide), 0.0)
    assert r.dtype == wide and torch.allclose(r, -beta * k1, atol=1e-6)
    assert torch.allclose(rtg, (r.flip(-1).cumsum(-1).flip(-1)) * m, atol=1e-5)


def test_bf16_inputs_are_computed_in_float32():
    torch.manual_seed(0)
    lp = (-torch.rand(4, 9) * 2).bfloat16()
    ref = (lp.float() + 0.4 * torch.randn(4, 9)).bfloat16()
    mask = torch.ones(4, 9, dtype=torch.bool)
    out16 = kl_surrogate(lp, ref, mask)
    out64 = kl_surrogate(lp.double(), ref.double(), mask)
    assert out16.dtype == torch.float32
    assert float(out16) == pytest.approx(float(out64), rel=1e-6)  # same bf16 values, float32 arithmetic


def test_k3_has_no_cancellation_near_zero_and_no_gradient_clamp():
    from kl_adapters.estimators import k3

    x = torch.tensor([1e-6, -1e-6, 1e-4], dtype=torch.float32)
    assert torch.allclose(k3(x).double(), (x.double() ** 2) / 2, rtol=1e-3)  # exp(d)-d-1 would give 0 or < 0
    lp = torch.tensor([[-60.0, -0.1]], requires_grad=True)  # pi << pi_ref: k1 = -60, exp(60) would overflow k3 in fp16
    ref = torch.tensor([[-0.01, -0.1]])
    for name in SAMPLED_TOKEN_PRESETS:
        lp.grad = None
        kl_surrogate(lp, ref, torch.ones(1, 2), preset=name).backward()
        assert torch.all(torch.isfinite(lp.grad)) and lp.grad[0, 0] != 0, name  # no silent zeroing
