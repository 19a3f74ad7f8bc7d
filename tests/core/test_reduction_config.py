"""`reductions.ReductionConfig`: the fit's priors and a switch for each part, and its thresholds as conditions.

* The defaults are the presets' behaviour, written once (`reduction_settings.ReductionConfig`), and every switch and
  prior is wired: changing it changes the statistics of a batch where the part acts. Each switch's benefit:
  tests/core/test_reduction_switches.py.
* Every setting keeps the expected gradient exact (each is a function of the other rows, or the fade of the row's own
  prefix), on- and off-policy, with task advantages and the termination control variate: exact enumeration.
* The two thresholds stated as conditions: `variance_floor` must lie above the rounding of the leave-one-out sums
  (0 biases the gradient) and below the relative variance of a feature the fit should use; the relative prefix weights
  of `relative_returns` are exact within e^(log_relative_weight_floor) of a row's largest and finite beyond.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch
from torch import Tensor

from kl_adapters import EndOfSequence, TaskAdvantages, kl_coefficients, kl_statistics
from kl_adapters import reduction_settings, reductions
from kl_adapters.audit import batch_moments, random_policies, relative_error
from kl_adapters.reduction_settings import ReductionConfig, reduction_config

DEFAULT = ReductionConfig()
#: a setting of each field that differs from its default (a prior moved, a switch off)
CHANGED = {"tail_z": 0.5, "cv_prior_tokens": 0.0, "joint_prior_tokens": 0.0, "fit_prior_dof": 0.0,
           "variance_floor": 0.5, "log_relative_weight_floor": -1.0, "baseline_free_log_weight": 0.0, "fit": False,
           "control_variate": False, "termination": False, "past_kl": False, "baseline": False, "task": False,
           "unseen_tail": False, "james_stein": False, "off_policy_task_weight": False, "baseline_fade": False}


def test_the_defaults_are_written_once_and_every_switch_is_on():
    """One source: the defaults are `ReductionConfig`'s (kl_adapters/reduction_settings.py), with no module constant
    of the same name beside them; every field says what it sets; every switch is on by default."""
    names = {f.name for f in fields(ReductionConfig)}
    assert not [n for n in (*dir(reductions), *dir(reduction_settings)) if n.isupper() and n.lower() in names]
    assert all(f.metadata.get("help") for f in fields(ReductionConfig))
    assert all(getattr(DEFAULT, f.name) is True for f in fields(ReductionConfig) if f.type in (bool, "bool"))
    assert set(CHANGED) == names
    assert reductions.ReductionConfig is ReductionConfig and reductions.reduction_config is reduction_config
    assert reductions.active_reduction_config() == DEFAULT
    with reduction_config(ReductionConfig(fit=False)) as config:
        assert reductions.active_reduction_config() is config
    assert reductions.active_reduction_config() == DEFAULT
    with pytest.raises(TypeError, match="ReductionConfig"):
        with reduction_config({"fit": False}):
            pass


def _batch():
    """An off-policy batch whose other rows have missed xi's upper tail (pi has suppressed a token pi_ref allows: the
    unseen-tail guard acts), near the regularized optimum (advantages beta x the row's KL plus noise: the prefix-KL
    baseline acts), with end-of-sequence probabilities."""
    gen = torch.Generator().manual_seed(0)
    B, T, beta = 8, 12, 0.2
    logp = math.log(0.99) + 0.02 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = torch.full((B, T), math.log(0.5), dtype=torch.float64) + 0.3 * torch.randn(B, T, generator=gen,
                                                                                   dtype=torch.float64)
    old = logp + 0.5 + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # |log w| past e^4: the fade
    mask = torch.arange(T)[None] < torch.tensor([12, 12, 10, 9, 12, 7, 11, 12])[:, None]
    advantages = beta * ((logp - ref) * mask).sum(-1) + 0.05 * torch.randn(B, generator=gen, dtype=torch.float64)
    eos = EndOfSequence(0.1 * torch.rand(B, T, generator=gen, dtype=torch.float64) * mask, torch.zeros_like(mask))
    return logp, ref, mask, old, TaskAdvantages(advantages, beta), eos


def _coefficients(off_policy_with_task: bool) -> Tensor:
    """`sequence`'s weights on `_batch`, off-policy and fitted with the task, or on a plain on-policy batch fitted to
    the KL term alone (where the joint fit's control-variate coefficient reaches its clamp at 1, so the token-level
    prior on a~ shows)."""
    if off_policy_with_task:
        logp, ref, mask, old, task, eos = _batch()
        return kl_coefficients(logp, ref, mask, old_logp=old, task=task, eos=eos)
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(8, 12, generator=gen, dtype=torch.float64)
    return kl_coefficients(logp, logp + 0.3 * torch.randn(8, 12, generator=gen, dtype=torch.float64),
                           torch.ones(8, 12, dtype=torch.bool))


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_every_setting_is_wired(name):
    default = [_coefficients(regime) for regime in (True, False)]
    with reduction_config(replace(DEFAULT, **{name: CHANGED[name]})):
        changed = [_coefficients(regime) for regime in (True, False)]
    assert any(not torch.allclose(a, b, rtol=1e-9, atol=0) for a, b in zip(changed, default)), name
    assert all(torch.equal(_coefficients(regime), d) for regime, d in zip((True, False), default))


def _bias(config: ReductionConfig, off_policy: bool, normalized: bool = False) -> float:
    """|E g - exact| / |exact| of `sequence`'s KL gradient fitted with GRPO advantages of binary rewards and the
    termination control variate, every ordered batch of G = 3 (V = 3, T = 3, seed 0)."""
    pol = random_policies(3, 3, 0, drift=1.0)
    r = (torch.rand(pol.space.num_sequences, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
         > 0.5).double()
    behaviour = pol.behaviour_logits if off_policy else None
    kwargs = dict(behaviour_logits=behaviour, rewards=r, normalized=normalized, eos=True)
    exact, _ = batch_moments(pol.space, pol.logits, pol.ref_logits, "sequence-plain", 3, **kwargs)
    with reduction_config(config):
        got, _ = batch_moments(pol.space, pol.logits, pol.ref_logits, "sequence", 3, **kwargs)
    return relative_error(got, exact)


@pytest.mark.parametrize("name", sorted(set(CHANGED) - {"variance_floor"}))
def test_every_setting_keeps_the_gradient_exact(name):
    """(off-policy to 1e-10, as tests/core/test_batch_exactness.py: the importance weights amplify rounding)"""
    config = replace(DEFAULT, **{name: CHANGED[name]})
    assert _bias(config, off_policy=True) < 1e-10 and _bias(config, off_policy=False, normalized=True) < 1e-12


def test_the_variance_floor_lies_above_the_rounding_of_the_leave_one_out_sums():
    """`_joint_fit`'s condition of exactness: the other rows' centred variance of a feature is a group total minus the
    row's own terms, so where it is 0 exactly (e.g. the other rows' prefix KL equal) the computed one is the rounding
    of row b's own terms, and a coefficient fitted to it depends on row b: with the floor at 0 the gradient is
    biased."""
    assert _bias(DEFAULT, off_policy=False) < 1e-12
    assert _bias(replace(DEFAULT, variance_floor=0.0), off_policy=False) > 1e-4


def test_the_variance_floor_lies_below_the_variance_of_a_feature_the_fit_should_use():
    """The prefix KL of the other rows varies by 1% around 1 (centred variance 1e-4 of its raw second moment, far
    above rounding) and the preset's return is minus its deviation: lambda = 1 removes it, times the ridge's
    tokens / (tokens + joint_prior_tokens) and the shrinkage dof / (dof + fit_prior_dof). A floor at 1e-2 of the raw
    moment would leave the feature out (lambda = 0)."""
    gen = torch.Generator().manual_seed(1)
    B, T = 6, 8
    past = 1 + 0.01 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ret = -(past - 1) + 1e-4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask, zero = torch.ones(B, T, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    returns = reductions.Returns(ret=ret, cv=torch.zeros_like(ret), past=past)

    def past_coef() -> Tensor:
        return reductions.batch_statistics(returns, zero, zero, None, mask, mask, None).past_coef

    tokens, dof = (B - 1) * T, (B - 2) * T
    expected = tokens / (tokens + DEFAULT.joint_prior_tokens) * dof / (dof + DEFAULT.fit_prior_dof)
    assert torch.allclose(past_coef(), torch.full((B,), expected, dtype=torch.float64), rtol=0.02)
    with reduction_config(replace(DEFAULT, variance_floor=1e-2)):
        assert torch.all(past_coef() == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relative_returns_are_exact_within_the_weight_floor_and_finite_beyond(dtype):
    """R_t = sum_{s>=t} w_{t+1:s} x_s from weights relative to the row's largest: exact (to the working dtype) for
    prefix weights down to e^-50 of the row's largest, which a floor at e^-5 would clamp; finite in float32 when they
    span 200 nats (the floor keeps 1 / relative weight e^20 inside float32's range, room for the returns)."""
    T = 20
    x = torch.linspace(0.5, 1.5, T, dtype=dtype)[None, None]
    mask = torch.ones(1, T, dtype=dtype)
    log_rho = torch.full((1, T), -2.5, dtype=dtype)  # log w_{1:t} from -2.5 to -50
    got = reductions.relative_returns(x, mask, log_rho)[0, 0].double()
    log_w = log_rho.double().cumsum(-1)[0]
    want = torch.stack([(torch.exp(log_w[t:] - log_w[t]) * x[0, 0, t:].double()).sum() for t in range(T)])
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)
    far = reductions.relative_returns(x, mask, torch.full((1, T), -10.0, dtype=dtype))
    assert torch.isfinite(far).all()
    assert -math.log(torch.finfo(torch.float32).max) + 20 < DEFAULT.log_relative_weight_floor <= -50
