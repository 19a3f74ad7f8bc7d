"""Exact expected gradients of every preset, by enumerating all sequences of tiny tabular policies (float64).

Identities pinned here (theory notes, configuration table rows in brackets):
    sequence   E_pi[g] = E_mu[g] = grad KL_seq                          [#10, #20]
    reward     E_pi[g] = grad KL_seq                                     [#5]
    reward-sum E_pi[g] = grad KL_seq                                     [#4]
    token      E_q[g] = sum_t E_{y<t ~ q} grad KL_t(pi || pi_ref)        [#2, #16]  (partial reverse, q = pi or mu)
    k1-loss    E_pi[g] = 0                                               [#1]
    k2-loss    E_pi[g] = partial reverse                                 [#2]
    k3-loss    E_pi[g] = sum_t E_{y<t ~ pi} grad KL_t(pi_ref || pi)      [#3]  (partial *forward*)
    k3-reward  E_pi[g] = grad KL_seq - partial forward                   [#7]
    value      E_q[value] = KL_seq (per-decision weights off-policy)
"""

import pytest
import torch

from kl_adapters import SAMPLED_TOKEN_PRESETS, kl_surrogate
from kl_adapters.audit import (
    audit,
    kl_seq,
    preset_moments,
    random_policies,
    relative_error,
    sequence_space,
    targets,
    token_logps,
)
from kl_adapters.estimators import k3

PROBLEMS = [(3, 3, 0), (4, 4, 1), (3, 5, 2), (5, 3, 3), (4, 4, 4)]  # (vocab incl. EOS, horizon, seed)
REGIMES = ["on-policy", "off-policy"]


@pytest.fixture(scope="module", params=PROBLEMS, ids=lambda p: f"V{p[0]}T{p[1]}s{p[2]}")
def problem(request):
    vocab, horizon, seed = request.param
    pol = random_policies(vocab, horizon, seed, drift=1.0, off_policy=0.6)
    tg = {"on-policy": targets(pol.space, pol.logits, pol.ref_logits, pol.logits),
          "off-policy": targets(pol.space, pol.logits, pol.ref_logits, pol.behaviour_logits)}
    return pol, tg


def test_space_has_ragged_lengths():
    space = sequence_space(3, 4)
    lengths = set(space.mask.sum(-1).tolist())
    assert lengths == {1, 2, 3, 4}
    probs = token_logps(space, torch.zeros(len(space.nodes), 3, dtype=torch.float64)).sum(-1).exp()
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-12)  # the enumeration is a complete distribution


def test_targets_are_distinct(problem):
    """The targets differ from each other on these problems, so matching one is a real statement."""
    _, tg = problem
    on = tg["on-policy"]
    for a, b in [("kl_seq", "partial_reverse"), ("kl_seq", "partial_forward"), ("partial_reverse", "partial_forward")]:
        assert relative_error(on[a], on[b]) > 1e-2


def _documented_target(name, regime):
    spec = SAMPLED_TOKEN_PRESETS[name]
    return spec.target_on_policy if regime == "on-policy" else spec.target_off_policy


@pytest.mark.parametrize(("name", "regime"), [(n, r) for n in SAMPLED_TOKEN_PRESETS for r in REGIMES if _documented_target(n, r)])
def test_expected_gradient_matches_documented_target(problem, name, regime):
    pol, tg = problem
    spec = SAMPLED_TOKEN_PRESETS[name]
    target = _documented_target(name, regime)
    mom = preset_moments(pol.space, pol.logits, pol.ref_logits, name,
                         behaviour_logits=pol.behaviour_logits if regime == "off-policy" else None)
    assert relative_error(mom.mean, tg[regime][target]) < 1e-6
    unbiased = spec.unbiased_on_policy if regime == "on-policy" else spec.unbiased_off_policy
    assert (relative_error(mom.mean, tg[regime]["kl_seq"]) < 1e-6) == unbiased


@pytest.mark.parametrize("name", [n for n, p in SAMPLED_TOKEN_PRESETS.items() if not p.unbiased_off_policy])
def test_presets_documented_biased_off_policy_are_biased(problem, name):
    pol, tg = problem
    mom = preset_moments(pol.space, pol.logits, pol.ref_logits, name, behaviour_logits=pol.behaviour_logits)
    assert relative_error(mom.mean, tg["off-policy"]["kl_seq"]) > 1e-3


@pytest.mark.parametrize("regime", REGIMES)
def test_value_is_unbiased_for_sequence_kl(problem, regime):
    """E_q[value] = beta * KL_seq: sum_t w_{1:t} k3_t with per-decision weights (w = 1 on-policy)."""
    pol, _ = problem
    beta = 0.3
    mom = preset_moments(pol.space, pol.logits, pol.ref_logits, "sequence", beta=beta,
                         behaviour_logits=pol.behaviour_logits if regime == "off-policy" else None)
    exact = beta * float(kl_seq(pol.space, pol.logits, pol.ref_logits))
    assert mom.value_mean == pytest.approx(exact, rel=1e-9)


def test_beta_scales_the_gradient(problem):
    pol, tg = problem
    mom = preset_moments(pol.space, pol.logits, pol.ref_logits, "sequence", beta=0.05,
                         behaviour_logits=pol.behaviour_logits)
    assert relative_error(mom.mean, 0.05 * tg["off-policy"]["kl_seq"]) < 1e-6


def test_is_clip_trades_bias_for_variance(problem):
    """Capping the per-decision weights is biased (documented) and never increases the variance here."""
    pol, tg = problem
    exact = preset_moments(pol.space, pol.logits, pol.ref_logits, "sequence", behaviour_logits=pol.behaviour_logits)
    capped = preset_moments(pol.space, pol.logits, pol.ref_logits, "sequence", behaviour_logits=pol.behaviour_logits,
                            is_clip=1.0)
    assert relative_error(capped.mean, tg["off-policy"]["kl_seq"]) > 1e-4
    assert capped.variance <= exact.variance


# --- legacy presets reproduce the literal framework losses, sample by sample --------------------------------------

def _literal_losses(lp, ref, old):
    """Per-sequence losses as frameworks write them, differentiated by autograd (no kl_adapters code)."""
    k1 = lp - ref
    u = torch.exp(ref - lp)
    rho = torch.exp(lp - old)
    rcum = lambda x: x.flip(-1).cumsum(-1).flip(-1)  # noqa: E731
    return {
        "k1-loss": k1.sum(-1),
        "k2-loss": (0.5 * k1 ** 2).sum(-1),
        "k3-loss": (u - 1 - torch.log(u)).sum(-1),
        "token": (rho * (u - 1 - torch.log(u))).sum(-1),  # TRL use_bias_correction_kl: k3 * pi/pi_old, rho attached
        "k3-reward": (lp * rcum((u - 1 - torch.log(u)).detach())).sum(-1),
        "reward-plain": (rho * rcum(k1.detach())).sum(-1),  # PPO surrogate rho_t * A_t with A_t = sum_{s>=t} k1_s
        "reward-sum": (rho * k1.detach().sum(-1, keepdim=True)).sum(-1),
    }


def _enumerated(seed):
    """theta (leaf), and [N, T] log-probs of every sequence under pi (differentiable), pi_ref and mu, with the mask."""
    pol = random_policies(4, 4, seed, off_policy=0.5)
    theta = pol.logits.clone().requires_grad_(True)
    lp = token_logps(pol.space, theta)
    ref = token_logps(pol.space, pol.ref_logits).detach()
    old = token_logps(pol.space, pol.behaviour_logits).detach()
    return theta, lp, ref, old, pol.space.mask


LITERAL = ["k1-loss", "k2-loss", "k3-loss", "token", "k3-reward", "reward-plain", "reward-sum"]


@pytest.mark.parametrize("name", LITERAL)
def test_per_sample_gradient_equals_literal_framework_loss(name):
    theta, lp, ref, old, m = _enumerated(7)
    zero = torch.zeros((), dtype=lp.dtype)
    off = SAMPLED_TOKEN_PRESETS[name].uses_importance_weights
    for i in [0, 5, 17, 60, 120]:
        row = slice(i, i + 1)
        lit = _literal_losses(lp[row], torch.where(m[row], ref[row], zero), torch.where(m[row], old[row], zero))[name]
        g_lit = torch.autograd.grad(lit.sum(), theta, retain_graph=True)[0]
        ours = kl_surrogate(lp[row], ref[row], m[row], preset=name, old_logp=old[row] if off else None)
        g_ours = torch.autograd.grad(ours, theta, retain_graph=True)[0]
        assert torch.allclose(g_ours, g_lit, rtol=1e-10, atol=1e-12), (name, i)


def test_literal_losses_cover_every_plain_preset():
    assert set(LITERAL) | {"sequence-plain"} == {n for n, p in SAMPLED_TOKEN_PRESETS.items() if not p.uses_batch_statistics}


def test_sequence_off_policy_equals_theory_form():
    """sequence-plain == sg(w_{1:t-1}) rho_t k3_t + log pi_t sg(sum_{s>t} w_{1:s} k1_s), sample by sample."""
    theta, lp, ref, old, m = _enumerated(8)
    log_rho = (lp.detach() - old) * m
    w = torch.exp(log_rho.cumsum(-1))
    w_prev = torch.exp(log_rho.cumsum(-1) - log_rho)
    rho = torch.exp(lp - old)
    wk1 = w * (lp.detach() - ref) * m
    future = wk1.flip(-1).cumsum(-1).flip(-1) - wk1
    lit = ((w_prev * rho * k3(lp - ref) + lp * future) * m).sum(-1)
    for i in [0, 9, 33, 100]:
        g_lit = torch.autograd.grad(lit[i], theta, retain_graph=True)[0]
        ours = kl_surrogate(lp[i:i + 1], ref[i:i + 1], m[i:i + 1], preset="sequence-plain", old_logp=old[i:i + 1])
        g_ours = torch.autograd.grad(ours, theta, retain_graph=True)[0]
        assert torch.allclose(g_ours, g_lit, rtol=1e-10, atol=1e-12)


def test_audit_rows_meet_the_done_criteria():
    rows = {(r.preset, r.regime, r.is_clip): r for r in audit(4, 4, 0)}
    assert rows[("sequence", "on-policy", None)].relative_bias < 1e-6
    assert rows[("sequence", "off-policy", None)].relative_bias < 1e-6
    assert rows[("reward", "on-policy", None)].relative_bias < 1e-6
    assert rows[("k1-loss", "on-policy", None)].relative_bias == pytest.approx(1.0, abs=1e-9)
    for r in rows.values():
        if r.target_error is not None:
            assert r.target_error < 1e-6, r
        if r.is_clip is None:
            assert r.value_bias < 1e-9
