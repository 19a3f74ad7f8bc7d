"""Batch statistics of the reduced presets: leave-one-out by construction, sliceable, validated; is_ess.

The exactness of the reduced presets rests on one property (kl_adapters/reductions.py): row b's statistics are
functions of the OTHER rows of its group only, besides the row's own termination counts (functions of its prefix).
Pinned directly here (changing row b leaves its statistics unchanged) and through the expectation in
tests/core/test_batch_exactness.py.
"""

from dataclasses import replace

import pytest
import torch
from torch import Tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_adapters import (SAMPLED_TOKEN_PRESETS, EndOfSequence, TaskAdvantages, kl_coefficients,
                         kl_statistics, kl_surrogate, kl_term)
from kl_adapters.presets import Terms, get_preset
from kl_adapters.reductions import termination_counts, termination_increments

REDUCED = [n for n, p in SAMPLED_TOKEN_PRESETS.items() if p.uses_batch_statistics]


def _batch(seed=0, B=5, T=7, lengths=(7, 3, 5, 1, 6), off=0.2):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old = logp + off * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    return logp, ref, mask, old


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    lengths = tuple(draw(st.lists(st.integers(0, t), min_size=b, max_size=b)))
    logp, ref, mask, old = _batch(draw(st.integers(0, 10**6)), b, t, lengths)
    group = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=b, max_size=b)))
    return logp, ref, mask, old if draw(st.booleans()) else None, group if draw(st.booleans()) else None


def _grpo(rewards, group, normalized):
    """GRPO advantages: r minus its group's mean (over the group's std when normalized): every row's depends on all."""
    same = torch.zeros_like(rewards, dtype=torch.long) if group is None else torch.unique(group, return_inverse=True)[1]
    adv = torch.empty_like(rewards)
    for g in same.unique():
        r = rewards[same == g]
        a = r - r.mean()
        adv[same == g] = a / (a.std() + 1e-4) if normalized and len(r) > 1 else a
    return TaskAdvantages(adv, 0.5, normalized)


def _eos(logp, mask, seed):
    gen = torch.Generator().manual_seed(seed)
    prob = torch.rand(logp.shape, generator=gen, dtype=torch.float64) * 0.2
    last = mask & ~torch.roll(mask, -1, 1)  # the last real token of each row: an EOS in a random half of the rows
    return EndOfSequence(prob, last & (torch.rand(logp.shape[0], 1, generator=gen) < 0.5))


@settings(max_examples=60, deadline=None)
@given(batch=batches(), row=st.integers(0, 5), scale=st.floats(0.1, 3.0), task=st.sampled_from([None, False, True]),
       with_eos=st.booleans())
def test_a_rows_statistics_do_not_depend_on_the_row(batch, row, scale, task, with_eos):
    """Row b's fitted statistics are functions of the other rows only, with GRPO advantages that depend on row b's
    reward (through the group mean and std) and with end-of-sequence probabilities (eos_count, the row's own
    termination counts, is not fitted: test_statistics_carry_the_rows_own_termination_counts)."""
    logp, ref, mask, old, group = batch
    row = row % logp.shape[0]
    rewards = torch.rand(logp.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def stats(lp, m, r):
        extra = {} if task is None else {"task": _grpo(r, group, task)}
        if with_eos:
            extra["eos"] = _eos(lp, m, 2)
        return kl_statistics(lp, ref, m, old_logp=old, group=group, **extra)

    before = stats(logp, mask, rewards)
    logp2 = logp.clone()
    logp2[row] = logp[row] * scale - 0.1  # another sample in row b (and another length, another reward)
    mask2 = mask.clone()
    mask2[row] = torch.arange(mask.shape[1]) < (mask.shape[1] - int(mask[row].sum()))
    rewards2 = rewards.clone()
    rewards2[row] = rewards[row] * scale + 0.3
    after = stats(logp2, mask2, rewards2)
    # leave-one-out sums are group totals minus the row's own value: rounding of the changed row's terms in the total
    # moves them by ~1e-12 relative (hypothesis found 0.1996 vs 0.1996 beyond 1e-12); a dependence would be O(1)
    for field in ("cv_coef", "eos_coef", "past_coef"):
        assert torch.allclose(getattr(before, field)[row], getattr(after, field)[row], rtol=1e-9, atol=1e-12), field
    assert torch.allclose(before.baseline[row] * mask2[row], after.baseline[row] * mask2[row], rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(batch=batches(), name=st.sampled_from(REDUCED), cut=st.integers(0, 6), with_eos=st.booleans())
def test_statistics_sliced_into_micro_batches_give_the_whole_batch_weights(batch, name, cut, with_eos):
    """kl_statistics on the whole batch, sliced with it, reproduces the whole-batch weights in every micro-batch (each
    micro-batch passing its own rows' end-of-sequence probabilities, whose termination control variate they apply)."""
    logp, ref, mask, old, group = batch
    eos = _eos(logp, mask, 3) if with_eos else None
    whole = kl_coefficients(logp, ref, mask, preset=name, old_logp=old, group=group, eos=eos)
    stats = kl_statistics(logp, ref, mask, old_logp=old, group=group, preset=name, eos=eos)
    for rows in (slice(0, cut), slice(cut, None)):
        if logp[rows].shape[0] == 0:
            continue
        part_eos = None if eos is None else EndOfSequence(eos.prob[rows], eos.is_eos[rows])
        part = kl_coefficients(logp[rows], ref[rows], mask[rows], preset=name,
                               old_logp=None if old is None else old[rows], statistics=stats[rows], eos=part_eos)
        assert torch.allclose(part, whole[rows], rtol=1e-12, atol=1e-14)


def test_statistics_carry_the_rows_own_termination_counts():
    """eos_count = termination_counts of the probabilities the statistics were computed with (zero without them), and
    a loss given the statistics forms eta = eos_count (p - e) with the probabilities it is given (the current policy's:
    nu from the rollout policy, p_t current)."""
    logp, ref, mask, old = _batch()
    eos = _eos(old, mask, 4)
    stats = kl_statistics(old, ref, mask, eos=eos)  # at rollout time: the behaviour policy's log-probs and EOS probs
    assert torch.equal(stats.eos_count, termination_counts(eos, mask, torch.float64))
    assert torch.all(kl_statistics(old, ref, mask).eos_count == 0)
    current = EndOfSequence(eos.prob * 0.5 + 0.05, eos.is_eos)
    got = kl_coefficients(logp, ref, mask, old_logp=old, statistics=stats, eos=current)
    eta = termination_increments(current, mask, torch.float64, counts=stats.eos_count)
    assert not torch.allclose(eta, termination_increments(current, mask, torch.float64))
    terms = Terms(k1=(logp - ref) * mask, log_rho=(logp - old) * mask, mask=mask.double(), is_clip=None,
                  statistics=stats, eta=eta)
    assert torch.allclose(got, get_preset("sequence").coefficients(terms) * mask, rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_group_ids_are_labels_and_batch_order_does_not_matter(batch):
    logp, ref, mask, old, group = batch
    group = torch.zeros(logp.shape[0], dtype=torch.long) if group is None else group
    perm = torch.randperm(logp.shape[0])
    a = kl_statistics(logp, ref, mask, old_logp=old, group=group)
    relabelled = kl_statistics(logp[perm], ref[perm], mask[perm], old_logp=None if old is None else old[perm],
                               group=group[perm] * 7 + 100)
    # the leave-one-out fits solve small, possibly ill-conditioned systems whose sums run in row order: a permutation
    # moves them by rounding amplified by the condition number (2.5e-12 relative seen on 4 rows), hence 1e-9
    for field in ("cv_coef", "eos_coef", "past_coef"):
        assert torch.allclose(getattr(a, field)[perm], getattr(relabelled, field), rtol=1e-9, atol=1e-14)
    assert torch.allclose(a.baseline[perm], relabelled.baseline, rtol=1e-10, atol=1e-12)


def test_rows_with_fewer_than_two_others_get_the_plain_form():
    """A row alone in its group, or with one other row, gets every statistic 0: the weights of sequence-plain."""
    logp, ref, mask, _ = _batch()
    group = torch.tensor([0, 0, 1, 2, 2])
    stats = kl_statistics(logp, ref, mask, group=group)
    for field in ("cv_coef", "eos_coef", "past_coef"):
        assert torch.all(getattr(stats, field) == 0), field
    assert torch.all(stats.baseline == 0)
    plain = kl_coefficients(logp, ref, mask, preset="sequence-plain")
    assert torch.equal(kl_coefficients(logp, ref, mask, group=group), plain)
    assert torch.equal(kl_coefficients(logp[:1], ref[:1], mask[:1]), plain[:1])


def test_small_fits_are_shrunk_toward_the_plain_form():
    """Every statistic of row b is the fit times dof / (dof + fit_prior_dof), dof = sum_t (n_t - 1) over the other rows'
    tokens n_t at each position: a group of 3 rows of 3 tokens gets 2 / 10 of its fit (the exact audit's tiny groups,
    where the full fit made the trainer's gradient noisier than sequence-plain's), a row with one other row none."""
    from kl_adapters import reductions

    assert reductions.ReductionConfig().fit_prior_dof == 8.0
    count = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 0.0], [3.0, 3.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([3 / 11, 0.0, 4 / 12, 0.0], dtype=torch.float64)
    assert torch.allclose(reductions.fit_shrinkage(count), expected)
    logp, ref, mask, _ = _batch(B=4, T=3, lengths=(3, 3, 3, 2))
    group = torch.tensor([0, 0, 0, 1])
    task = TaskAdvantages(torch.tensor([0.3, -0.5, 0.2, 0.0], dtype=torch.float64), 0.5)
    eos = _eos(logp, mask, 1)
    shrunk = kl_statistics(logp, ref, mask, group=group, task=task, eos=eos)
    with reductions.reduction_config(reductions.ReductionConfig(fit_prior_dof=0.0)):  # unshrunk where dof > 0
        fitted = kl_statistics(logp, ref, mask, group=group, task=task, eos=eos)
    factor = torch.tensor([3 / 11, 3 / 11, 3 / 11, 0.0], dtype=torch.float64)
    assert fitted.baseline[:3].abs().sum() > 0 and torch.all(fitted.baseline[3] == 0)
    for name, value in fitted.as_dict().items():
        scale = 1.0 if name == "eos_count" else factor if value.dim() == 1 else factor[:, None]  # counts: not fitted
        assert torch.allclose(getattr(shrunk, name), value * scale, rtol=1e-12, atol=1e-15), name


def test_an_unseen_upper_tail_of_xi_pulls_the_control_variate_toward_zero():
    """pi has suppressed a token that pi_ref allows (pi 0.01, pi_ref 0.5); the other token (pi 0.99, pi_ref 0.5) gives
    xi = 0.5 / 0.99 - 1 each time. E_pi[xi] = 0, so a sum of xi far below 0 says the rare xi = 49 was not drawn: a~ of
    a row whose other rows never drew it falls from ~0.95 (the regression on the drawn tokens alone) to
    (-sum k1 xi + M log(1 + M)) / (sum xi^2 + M^2), M = -sum xi - tail_z sqrt(sum xi^2) (`reductions.unseen_tail`);
    once another row holds the tail token the sum is balanced and the plain regression is kept (the long-horizon
    problem near pi*: `sequence` 3.97x -> 0.92x `sequence-plain`'s task + KL variance, docs/variance.md)."""
    import math

    from kl_adapters import reductions

    assert reductions.ReductionConfig().tail_z == 2.0
    k1 = torch.full((4, 25), math.log(0.99 / 0.5), dtype=torch.float64)
    mask = torch.ones_like(k1)
    unseen = reductions.token_coefficients(k1, torch.expm1(-k1), mask, None).cv_scale
    xi, n = 0.5 / 0.99 - 1, 75
    tail = -n * xi - 2.0 * math.sqrt(n * xi * xi)
    guarded = (-n * k1[0, 0].item() * xi + tail * math.log1p(tail)) / (n * xi * xi + tail * tail) * n / (n + 4.0)
    assert torch.allclose(unseen, torch.full((4,), guarded, dtype=torch.float64)) and guarded < 0.2
    k1[0, 0] = -math.log(0.5 / 0.01)  # row 0 draws the suppressed token once: xi = 49
    drawn = reductions.token_coefficients(k1, torch.expm1(-k1), mask, None).cv_scale
    assert torch.isclose(drawn[0], unseen[0], rtol=1e-12)  # row 0's own tail is not in its fit (leave-one-out)
    assert drawn[1] < unseen[0] < 2 * drawn[1]  # the guess 0.139 against 0.085 from a fit that drew the tail
    for row in (1, 2, 3):
        rest = torch.cat((k1[:row], k1[row + 1:]))
        x = torch.expm1(-rest)
        assert reductions.unseen_tail(x.sum(), x.square().sum()) == 0
        assert torch.isclose(drawn[row], -(rest * x).sum() / x.square().sum() * 75 / 79)


def test_the_unseen_tail_enters_the_joint_fit_as_variance_of_the_control_variate():
    """The joint fit counts the unseen tail M as reach x (a~ M)^2 more variance of a~ Q (`_add_unseen_tail`), with no
    covariance with the trainer's return when there is a task: rho_xi, so cv_coef, falls as M grows; without a task
    the tail's k1 = -log(1 + M) keeps rho_xi near log(1 + M) / (a~ M), so it falls less; without a tail (M = 0)
    nothing changes. reach = the mean over the other rows' tokens s of the omega-weight before s in its row."""
    from kl_adapters import reductions

    gen = torch.Generator().manual_seed(3)
    logp = -0.3 * torch.rand(6, 10, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(6, 10, generator=gen, dtype=torch.float64)
    mask = torch.ones(6, 10, dtype=torch.float64)
    mask[2, 7:] = 0
    k1 = (logp - ref) * mask
    cv = reductions.control_variate(k1, mask)
    returns = reductions.Returns(ret=reductions.relative_returns(k1[:, None], mask, None)[:, 0],
                                 cv=reductions.relative_returns(cv[:, None], mask, None)[:, 0] - cv,
                                 past=reductions.past_kl(k1, mask))
    omega = reductions.score_weight(logp * mask, mask)
    scale, kappa = torch.full((6,), 0.8, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)

    task = reductions.TaskAdvantages(torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 10) * mask, 100.0)

    def cv_coef(mass: float, task=None) -> Tensor:
        tail = reductions.UnseenTail(torch.full((6,), mass, dtype=torch.float64), reductions.tail_reach(omega, mask, None))
        return reductions.batch_statistics(returns, scale, kappa, task, omega, mask, None, tail).cv_coef

    for given in (None, task):
        untailed = reductions.batch_statistics(returns, scale, kappa, given, omega, mask, None).cv_coef
        assert torch.equal(cv_coef(0.0, given), untailed) and (untailed > 0.01).all()
        assert (cv_coef(1.0, given) <= untailed).all() and (cv_coef(10.0, given) <= cv_coef(1.0, given)).all()
    assert (cv_coef(10.0, task) < cv_coef(1.0, task)).all() and (cv_coef(10.0, task) < cv_coef(10.0)).all()
    later = torch.tensor([float(sum(mask[b, t + 1:])) for b in range(6) for t in range(10)], dtype=torch.float64)
    reach = reductions.tail_reach(omega, mask, None)
    for b in range(6):
        others = [r for r in range(6) if r != b]
        want = sum(float((omega[r] * later.view(6, 10)[r]).sum()) for r in others) / float(mask[others].sum())
        assert reach[b].item() == pytest.approx(want, rel=1e-12)


def test_statistics_are_detached_and_in_the_working_dtype():
    logp, ref, mask, _ = _batch()
    x = logp.float().requires_grad_(True)
    stats = kl_statistics(x, ref.float(), mask, task=TaskAdvantages(torch.randn(5), 0.1))
    for value in stats.as_dict().values():
        assert value.dtype == torch.float32 and not value.requires_grad
    assert stats.cv_coef.shape == (5,) and stats.baseline.shape == (5, 7)


def test_statistics_slice_move_and_resize():
    logp, ref, mask, _ = _batch()
    stats = kl_statistics(logp, ref, mask)
    assert stats[1:3].baseline.shape == (2, 7) and stats[torch.tensor([4, 0])].past_coef.shape == (2,)
    wide, narrow = stats.with_width(9), stats.with_width(4)
    assert torch.equal(wide.baseline[:, :7], stats.baseline) and torch.all(wide.baseline[:, 7:] == 0)
    assert torch.equal(narrow.baseline, stats.baseline[:, :4]) and torch.equal(narrow.cv_coef, stats.cv_coef)
    assert stats.to(torch.float32).eos_coef.dtype == torch.float32


def test_bad_statistics_group_task_and_eos_are_refused():
    logp, ref, mask, old = _batch()
    stats = kl_statistics(logp, ref, mask)
    with pytest.raises(ValueError, match="silent no-op"):
        kl_surrogate(logp, ref, mask, preset="sequence-plain", statistics=stats)
    with pytest.raises(ValueError, match="silent no-op"):
        kl_term(logp, ref, mask, preset="token", group=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="silent no-op"):
        kl_term(logp, ref, mask, preset="k3-loss", task=TaskAdvantages(torch.zeros(5), 0.1))
    with pytest.raises(ValueError, match="not both"):
        kl_surrogate(logp, ref, mask, statistics=stats, group=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="pass it to kl_statistics"):
        kl_surrogate(logp, ref, mask, statistics=stats, task=TaskAdvantages(torch.zeros(5), 0.1))
    with pytest.raises(ValueError, match="slice the statistics"):
        kl_surrogate(logp[:3], ref[:3], mask[:3], statistics=stats)
    with pytest.raises(ValueError, match=r"statistics.baseline has shape \(5, 6\)"):
        kl_surrogate(logp, ref, mask, statistics=stats.with_width(6))
    with pytest.raises(TypeError, match="statistics.cv_coef must be a torch.Tensor"):
        kl_surrogate(logp, ref, mask, statistics=replace(stats, cv_coef=[0.5] * 5))
    nan = stats.baseline.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="statistics.baseline has non-finite"):
        kl_surrogate(logp, ref, mask, statistics=replace(stats, baseline=nan))
    with pytest.raises(ValueError, match="statistics.eos_count has non-finite"):
        kl_surrogate(logp, ref, mask, statistics=replace(stats, eos_count=nan))
    with pytest.raises(ValueError, match=r"statistics.eos_count has shape \(5,\)"):
        kl_surrogate(logp, ref, mask, statistics=replace(stats, eos_count=stats.cv_coef))
    nan[0, 0] = 0.0
    nan[3, 6] = float("nan")  # padding of row 3 (length 1): never read
    x = logp.clone().requires_grad_(True)
    loss = kl_surrogate(x, ref, mask, statistics=replace(stats, baseline=nan, eos_count=nan))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match=r"group has shape \(4,\)"):
        kl_statistics(logp, ref, mask, group=torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer ids"):
        kl_surrogate(logp, ref, mask, group=torch.zeros(5))
    with pytest.raises(TypeError, match="group must be a torch.Tensor"):
        kl_statistics(logp, ref, mask, group=[0, 0, 1, 1, 2])
    # task advantages
    with pytest.raises(ValueError, match=r"task.advantages has shape \(4,\)"):
        kl_statistics(logp, ref, mask, task=TaskAdvantages(torch.zeros(4), 0.1))
    with pytest.raises(ValueError, match="task.beta must be a finite number > 0"):
        kl_statistics(logp, ref, mask, task=TaskAdvantages(torch.zeros(5), 0.0))
    with pytest.raises(ValueError, match="task.advantages has non-finite"):
        kl_statistics(logp, ref, mask, task=TaskAdvantages(torch.full((5,), float("inf")), 0.1))
    with pytest.raises(ValueError, match=r"task.beta \(> 0\) has non-finite"):
        kl_statistics(logp, ref, mask, task=TaskAdvantages(torch.zeros(5), torch.tensor([0.1, 0.1, 0.0, 0.1, 0.1],
                                                                                     dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"task.beta must be a number or a \[B\] tensor"):
        kl_statistics(logp, ref, mask, task=TaskAdvantages(torch.zeros(5), torch.full((4,), 0.1)))
    assert kl_statistics(logp, ref, mask, task=TaskAdvantages(torch.zeros(5), torch.full((5,), 0.1,
                                                                                          dtype=torch.float64)))
    with pytest.raises(TypeError, match="task must be a kl_adapters.TaskAdvantages"):
        kl_statistics(logp, ref, mask, task=torch.zeros(5))
    # end-of-sequence probabilities
    eos = _eos(logp, mask, 0)
    with pytest.raises(ValueError, match="eos.prob has shape"):
        kl_statistics(logp, ref, mask, eos=EndOfSequence(eos.prob[:, :3], eos.is_eos))
    with pytest.raises(TypeError, match="eos.is_eos must be a bool tensor"):
        kl_statistics(logp, ref, mask, eos=EndOfSequence(eos.prob, eos.is_eos.long()))
    with pytest.raises(ValueError, match=r"eos.prob \(a probability in \[0, 1\]\)"):
        kl_statistics(logp, ref, mask, eos=EndOfSequence(eos.prob + 1.5, eos.is_eos))
    with pytest.raises(ValueError, match="eos.horizon must be"):
        kl_statistics(logp, ref, mask, eos=EndOfSequence(eos.prob, eos.is_eos, horizon=3))
    with_eos = replace(stats, eos_coef=torch.full_like(stats.cv_coef, -0.01))
    with pytest.raises(ValueError, match="statistics.eos_coef is nonzero"):
        kl_surrogate(logp, ref, mask, statistics=with_eos)
    with pytest.raises(ValueError, match="use kl_adapters.full_statistics"):
        kl_statistics(logp, ref, mask, preset="full")


def test_given_statistics_equal_the_batch_own():
    logp, ref, mask, old = _batch()
    for name in REDUCED:
        own = kl_term(logp, ref, mask, preset=name, old_logp=old)
        given_ = kl_term(logp, ref, mask, preset=name, old_logp=old, statistics=kl_statistics(logp, ref, mask,
                                                                                             old_logp=old, preset=name))
        assert torch.equal(own.coefficients, given_.coefficients)


def test_is_ess_of_the_full_sequence_weights():
    """is_ess = (sum_b W_b)^2 / (B sum_b W_b^2), W_b = prod_t rho_{b,t}: 1 on-policy, exact for known weights."""
    logp, ref, mask, _ = _batch(B=2, T=3, lengths=(3, 2))
    assert kl_term(logp, ref, mask).is_ess.item() == 1.0
    old = logp.clone()
    old[1, 0] -= torch.log(torch.tensor(3.0, dtype=torch.float64))  # W = (1, 3)
    old[1, 2] = 99.0  # padding: never read
    ess = kl_term(logp, ref, mask, old_logp=old).is_ess
    assert ess.dim() == 0 and not ess.requires_grad
    assert float(ess) == pytest.approx(16 / 20, rel=1e-14)
    huge = logp.clone()
    huge[0] -= 400.0  # W_0 = e^1200: no overflow, the ESS of one dominant weight among 2
    assert float(kl_term(logp, ref, mask, old_logp=huge).is_ess) == pytest.approx(0.5, rel=1e-12)


def test_off_policy_task_weight_is_one_on_policy_and_falls_with_the_prefix_weight():
    """f_t = exp(-|log w_{1:t-1}|) (reductions.off_policy_task_weight): 1 at the first token and on-policy, symmetric in
    log w, zero at padding; a function of the row alone (its exactness: the off-policy task cases of
    tests/core/test_batch_exactness.py)."""
    from kl_adapters.reductions import off_policy_task_weight

    log_rho = torch.tensor([[0.5, -1.0, 0.25, 2.0], [-0.5, 1.0, -0.25, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    f = off_policy_task_weight(log_rho, mask)
    prefix = torch.tensor([[0.0, 0.5, -0.5, -0.25], [0.0, -0.5, 0.5, 0.25]], dtype=torch.float64)
    assert torch.allclose(f, torch.exp(-prefix.abs()) * mask, rtol=0, atol=1e-15)
    assert torch.equal(f[0], torch.exp(-torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64)) * mask[0])
    assert torch.equal(off_policy_task_weight(torch.zeros(2, 4, dtype=torch.float64), mask), mask)


def test_off_policy_baseline_fade_scales_the_rows_own_baseline_term():
    """`sequence` off-policy: c - c_plain = -w_{1:t} u_t m_t with only a baseline m (a, h, lambda = 0) and u_t =
    exp(-max(0, |log w_{1:t-1}| - 4)) (reductions.fade_baseline_); on-policy u = 1. Exactness of the faded
    baseline: the off-policy cases of tests/core/test_batch_exactness.py."""
    from kl_adapters.reductions import KLStatistics, fade_baseline_

    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(2, 6, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(2, 6, generator=gen, dtype=torch.float64)
    old = logp - torch.tensor([[1.0, 2.0, 2.0, 1.5, -8.0, 0.0], [-3.0, -2.0, 0.5, 0.0, 0.0, 0.0]],
                              dtype=torch.float64)
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    m = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    stats = KLStatistics(zero, zero, zero, m, torch.zeros_like(m))
    log_rho = (logp - old) * mask
    running = torch.exp(log_rho.cumsum(-1))
    w = running * mask
    u = fade_baseline_(torch.ones_like(w), running) * mask
    log_prefix = torch.tensor([[0.0, 1.0, 3.0, 5.0, 6.5, -1.5], [0.0, -3.0, -5.0, -4.5, 0.0, 0.0]],
                              dtype=torch.float64)
    torch.testing.assert_close(u, torch.exp(-(log_prefix.abs() - 4).clamp(min=0)) * mask, rtol=1e-13, atol=0)
    assert u[0, 3] < 1 and u[1, 2] < 1 and torch.equal(u[:, :3][0], torch.ones(3, dtype=torch.float64))
    assert torch.equal(fade_baseline_(torch.ones(3), torch.tensor([0.0, 1.0, 2.0])), torch.tensor([1.0, 0.0, 1.0]))
    for old_logp, weight in ((old, w * u), (None, mask)):
        c = kl_coefficients(logp, ref, mask, preset="sequence", old_logp=old_logp, statistics=stats)
        plain = kl_coefficients(logp, ref, mask, preset="sequence-plain", old_logp=old_logp)
        torch.testing.assert_close(c - plain, -weight * m, rtol=1e-12, atol=1e-14)
