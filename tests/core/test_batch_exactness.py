"""Batch estimators are exact: every ordered batch of G = 1, 2, 3 sequences enumerated (tabular policies, float64).

The reduced presets use leave-one-out statistics of the batch's other rows (kl_adapters/reductions.py):
    E_{y_1..y_G ~ q}[(1/G) sum_b g_b(y_b; stats from y_{-b})] = grad KL_seq     (q = pi, or mu with old_logp)
because row b's control-variate coefficient and baseline are functions of the other rows only, and
    E_mu[g_t w_{1:s} (r_s - 1)] = 0 (s > t),   E_mu[w_{1:t} g_t b_t] = 0 (b_t independent of y_t given y_<t).
Pinned here for the batch's own statistics, with group ids (leave-one-out within each group), and with statistics
precomputed by kl_statistics on the same rows (the rollout-time path), also as adapters take them off-policy: from the
behaviour policy's log-probs and end-of-sequence probabilities (the loss then uses mu's termination counts nu_t with
pi's p_t).
"""

import pytest
import torch

from kl_adapters import SAMPLED_TOKEN_PRESETS, kl_coefficients, kl_statistics
from kl_adapters.audit import batch_moments, preset_moments, random_policies, relative_error, targets, token_logps

#: (vocab incl. EOS, horizon, seed, drift, behaviour's gap per logit): ragged lengths; the last with prefix weights far
#: outside e^(+-4) (to e^7), where the off-policy baseline fade (reductions.fade_baseline_) is below 1
PROBLEMS = [(3, 3, 0, 1.0, 0.6), (3, 3, 1, 0.2, 0.6), (4, 2, 2, 0.6, 0.6), (3, 3, 3, 0.6, 2.0)]
REDUCED = [n for n, p in SAMPLED_TOKEN_PRESETS.items() if p.uses_batch_statistics]


@pytest.fixture(scope="module", params=PROBLEMS, ids=lambda p: f"V{p[0]}T{p[1]}s{p[2]}d{p[3]}o{p[4]}")
def problem(request):
    vocab, horizon, seed, drift, off_policy = request.param
    pol = random_policies(vocab, horizon, seed, drift=drift, off_policy=off_policy)
    tg = {"on-policy": targets(pol.space, pol.logits, pol.ref_logits, pol.logits)["kl_seq"],
          "off-policy": targets(pol.space, pol.logits, pol.ref_logits, pol.behaviour_logits)["kl_seq"]}
    return pol, tg


def _cases():
    for name in REDUCED:
        for regime in ("on-policy", "off-policy"):
            if regime == "off-policy" and not SAMPLED_TOKEN_PRESETS[name].unbiased_off_policy:
                continue
            for g in (1, 2, 3):
                yield name, regime, g, None, False, None
                yield name, regime, g, None, True, None
            for task in ("advantages", "normalized advantages", "advantages and eos", "advantages, per-row beta"):
                yield name, regime, 3, None, False, task
                yield name, regime, 3, (4, 7, 4), True, task
            yield name, regime, 2, None, True, "advantages and eos"
            if regime == "off-policy":  # statistics from mu's log-probs and EOS probabilities, as adapters take them
                yield name, regime, 3, None, "rollout", "advantages and eos"
                yield name, regime, 3, (4, 7, 4), "rollout", "advantages and eos"
            yield name, regime, 3, (0, 0, 1), False, None
            yield name, regime, 3, (4, 7, 4), True, None


def _rewards(pol):
    """A task reward per sequence: uniform on [0, 1], fixed."""
    return torch.rand(pol.space.num_sequences, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


@pytest.mark.parametrize(("name", "regime", "size", "groups", "precomputed", "task"), list(_cases()))
def test_reduced_presets_are_exact_over_every_batch(problem, name, regime, size, groups, precomputed, task):
    """E[g] = grad KL_seq over every ordered batch, with statistics fitted to GRPO advantages of the batch (r minus
    the group mean, over the group std when normalized: both depend on every row, which the statistics must undo)
    and with the termination control variate (eos)."""
    pol, tg = problem
    behaviour = pol.behaviour_logits if regime == "off-policy" else None
    extra = {} if task is None else {"rewards": _rewards(pol), "normalized": task.startswith("normalized"),
                                     "eos": task.endswith("eos"), "row_beta": task.endswith("per-row beta")}
    mean, _ = batch_moments(pol.space, pol.logits, pol.ref_logits, name, size, behaviour_logits=behaviour,
                            groups=groups, precomputed=bool(precomputed), rollout=precomputed == "rollout", **extra)
    assert relative_error(mean, tg[regime]) < 1e-10


@pytest.mark.parametrize("name", ["reward", "reward-plain"])
def test_reward_presets_are_biased_off_policy_at_every_batch_size(problem, name):
    pol, tg = problem
    mean, _ = batch_moments(pol.space, pol.logits, pol.ref_logits, name, 2, behaviour_logits=pol.behaviour_logits)
    assert relative_error(mean, tg["off-policy"]) > 1e-3


@pytest.mark.parametrize("name", list(SAMPLED_TOKEN_PRESETS))
def test_one_sequence_batches_agree_with_the_autograd_audit(name):
    """batch_moments (closed-form scores) at G = 1 equals preset_moments (autograd through kl_surrogate)."""
    pol = random_policies(3, 3, 5, drift=0.7, off_policy=0.5)
    behaviour = pol.behaviour_logits if SAMPLED_TOKEN_PRESETS[name].uses_importance_weights else None
    mean, var = batch_moments(pol.space, pol.logits, pol.ref_logits, name, 1, behaviour_logits=behaviour)
    ref = preset_moments(pol.space, pol.logits, pol.ref_logits, name, behaviour_logits=behaviour)
    assert float((mean - ref.mean).norm()) < 1e-12 * max(1.0, float(ref.mean.norm()))  # k1-loss: E[g] = 0
    assert var == pytest.approx(ref.variance, rel=1e-10)


def test_plain_presets_variance_scales_as_one_over_g():
    pol = random_policies(3, 3, 0)
    _, v1 = batch_moments(pol.space, pol.logits, pol.ref_logits, "sequence-plain", 1)
    _, v3 = batch_moments(pol.space, pol.logits, pol.ref_logits, "sequence-plain", 3)
    assert v3 == pytest.approx(v1 / 3, rel=1e-10)


def _every_pair():
    pol = random_policies(3, 3, 3, off_policy=0.5)
    n = pol.space.num_sequences
    rows = torch.cartesian_prod(torch.arange(n), torch.arange(n)).flatten()
    lp, ref, old = (token_logps(pol.space, x) for x in (pol.logits, pol.ref_logits, pol.behaviour_logits))
    return lp[rows], ref[rows], pol.space.mask[rows], old[rows], torch.arange(n * n).repeat_interleave(2)


@pytest.mark.parametrize("name", REDUCED)
def test_group_ids_equal_separate_batches(name):
    """One call with a group id per batch gives, row for row, the weights of separate calls on each batch."""
    lp, ref, mask, old, group = _every_pair()
    together = kl_coefficients(lp, ref, mask, preset=name, old_logp=old, group=group)
    stats = kl_statistics(lp, ref, mask, old_logp=old, group=group, preset=name)
    for b in range(0, lp.shape[0], 2 * 17):  # a spread of pairs
        rows = slice(b, b + 2)
        alone = kl_coefficients(lp[rows], ref[rows], mask[rows], preset=name, old_logp=old[rows])
        assert torch.allclose(together[rows], alone, rtol=1e-12, atol=1e-14)
        given = kl_coefficients(lp[rows], ref[rows], mask[rows], preset=name, old_logp=old[rows], statistics=stats[rows])
        assert torch.allclose(given, alone, rtol=1e-12, atol=1e-14)
