"""The public KL functions: the loss term (`kl_surrogate`), the reward tensor (`kl_reward`), diagnostics, beta conversion.

Conventions for every function here. Inputs are [B, T] tensors over the response tokens of B sequences:
    logp      log pi_theta(y_t | y_<t) of the sampled tokens, carrying the gradient
    ref_logp  log pi_ref(y_t | y_<t)
    mask      bool or 0/1; ragged lengths and holes (e.g. tool tokens) allowed; padding may hold anything
    old_logp  log mu(y_t | y_<t) under the behaviour policy that sampled the batch; None = on-policy (mu = pi_theta)
Arithmetic runs in float32, or float64 if any input is float64, whatever the input dtype. The sequence-level objective
is KL_seq = KL(pi_theta(.|x) || pi_ref(.|x)) = E_pi[sum_t k1_t]; a batch is averaged over its B sequences with the
constant divisor B (never a per-sequence length, which would optimize a length-normalized KL instead).

Batch statistics. The reduced presets ("sequence", "reward") use per-row statistics computed from the OTHER rows of
the batch (`reductions.py`), fitted to the gradient the trainer takes: pass its task advantages as
`task=TaskAdvantages(advantages, beta)` (without them the statistics are fitted to the KL term alone, which near the
regularized optimum makes the trained gradient noisier), and the policy's end-of-sequence probabilities as
`eos=EndOfSequence(prob, is_eos)` for the termination control variate (long completions). By default `kl_term` /
`kl_surrogate` compute the statistics from the [B, T] batch they are given (leave-one-out over its rows, or within
`group` when [B] group ids are given: GRPO's prompt groups). A trainer whose loss sees small micro-batches computes
them once on the whole rollout batch with `kl_statistics(...)`, slices them with the batch, and passes `statistics=`
to the loss: more independent samples, the same expected gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import (check_beta, check_discount, check_eos, check_group, check_is_clip,
                        check_statistics, check_statistics_options, check_task, checked_batch, eos_rule)
from .estimators import as_float, reverse_cumsum, working_dtype
from .options import KLOptions
from .presets import Preset, Terms, get_preset
from .reductions import (EndOfSequence, KLStatistics, TaskAdvantages, increments_from_counts,
                         sampled_token_statistics, termination_counts)


def _terms(logp: Tensor, ref_logp: Tensor, mask: Tensor, options: KLOptions):
    """Validate, cast to the working dtype, zero the padding before any nonlinearity; return (masked logp, Terms).

    Given statistics, task advantages and end-of-sequence probabilities (`options`; its group is not read here) are
    validated in the same host synchronisation and attached to Terms in the working dtype.
    """
    old_logp, is_clip, statistics, task, eos, discount = (options.old_logp, options.is_clip, options.statistics,
                                                          options.task, options.eos, options.discount)
    finite = {}
    for value, check in ((statistics, check_statistics), (task, check_task), (eos, check_eos)):
        if value is not None:
            finite.update(check(value, logp))
    m, finite_everywhere = checked_batch(logp, ref_logp, mask, old_logp, also_finite=finite,
                                         also_false=eos_rule(statistics, eos))
    check_is_clip(is_clip)
    if is_clip is not None and old_logp is None:
        raise ValueError("is_clip caps importance weights, which only exist off-policy: pass old_logp or drop is_clip")
    dtype = working_dtype(logp, ref_logp, old_logp)
    mf = as_float(m, dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def masked(x: Tensor) -> Tensor:
        """x in the working dtype with its padding zeroed: it may hold anything there, NaN too, unless checked finite
        (and not narrowed to the working dtype, where a finite value could overflow)."""
        if finite_everywhere and x.dtype.itemsize <= dtype.itemsize:
            return x.to(dtype) * mf
        return torch.where(m, x.to(dtype), zero)

    def finite(x: Tensor) -> Tensor:
        """x in the working dtype, finite at padding (where every product it enters is masked): x itself when checked
        finite there and not narrowed, else masked."""
        return x.to(dtype) if finite_everywhere and x.dtype.itemsize <= dtype.itemsize else masked(x)

    lp = masked(logp)
    lp_d = lp.detach()
    k1 = lp_d - masked(ref_logp.detach())
    log_rho = zero.expand_as(lp) if old_logp is None else lp_d - masked(old_logp.detach())
    stats = None if statistics is None else KLStatistics(
        *(x.detach().to(dtype) for x in (statistics.cv_coef, statistics.eos_coef, statistics.past_coef)),
        finite(statistics.baseline.detach()), masked(statistics.eos_count.detach()))
    if task is not None:
        advantages = task.advantages.detach()
        task = TaskAdvantages(masked(advantages if advantages.dim() == 2 else advantages[:, None]), task.beta,
                              task.normalized)
    counts = eta = None
    if eos is not None:  # given statistics carry the counts (computed at rollout time): no transcendental function here
        counts = termination_counts(eos, m, dtype, discount) if stats is None else stats.eos_count
        eta = increments_from_counts(counts, finite(eos.prob.detach()), eos.is_eos)
    return lp, Terms(k1=k1, log_rho=log_rho, mask=mf, is_clip=is_clip, statistics=stats, on_policy=old_logp is None,
                     logp=lp_d, eta=eta, eos_count=counts, task=task, discount=discount)


def _statistics_of(t: Terms, group: Tensor | None, spec: Preset | None = None) -> KLStatistics:
    """Leave-one-out statistics of the batch itself (without is_clip: the same as `kl_statistics` on it), from
    importance-weighted returns unless the preset's own return is unweighted (`Preset.weighted_returns`)."""
    weighted = not t.on_policy and (spec is None or spec.weighted_returns)
    return sampled_token_statistics(t.k1, t.cv, t.eta, t.logp, t.log_rho if weighted else None, t.mask, t.task, group,
                                    t.discount, t.eos_count)


def _check_options(spec: Preset, o: KLOptions, computing: bool = False) -> None:
    """Refuse option combinations that would be silent no-ops (before any tensor is read)."""
    check_discount(o.discount, spec)
    if spec.needs_full_logits:
        return  # refused with its own message by the preset's weight function
    check_is_clip(o.is_clip, spec)
    if not spec.uses_batch_statistics:
        given = [n for n, v in (("statistics", o.statistics), ("group", o.group), ("task", o.task), ("eos", o.eos))
                 if v is not None]
        if given or computing:
            raise ValueError(f"preset {spec.name!r} uses no batch statistics, so {'/'.join(given) or 'kl_statistics'} "
                             "would be a silent no-op")
    check_statistics_options(o.statistics, o.group, o.task)


def _is_ess(t: Terms) -> Tensor:
    """(sum_b W_b)^2 / (B sum_b W_b^2), W_b = w_{1:T_b} the uncapped full-sequence weight: 1 on-policy, -> 1/B as the
    weights degenerate. Computed relative to the largest W (invariant), so it neither overflows nor divides by 0."""
    log_w = t.log_rho.sum(-1)
    if log_w.numel() == 0:  # an empty micro-batch: no weight has degenerated
        return torch.ones((), dtype=log_w.dtype, device=log_w.device)
    w = torch.exp(log_w - log_w.max())
    return w.sum().square() / (w.numel() * w.square().sum())


def _value_per_sequence(t: Terms) -> Tensor:
    """sum_t w_{1:t} k3_t per sequence (k3 = k1 + (r - 1)): E_mu[.] = KL_seq exactly (is_clip=None); non-negative per
    token."""
    return (t.prefix_weights * (t.k1 + t.cv)).sum(-1)


@dataclass(frozen=True)
class KLTerm:
    """One validated pass over a [B, T] batch (`kl_term`): the loss term of a preset and what adapters log beside it.

    Adapters call it once per loss call instead of kl_surrogate + kl_coefficients + sequence_kl, which would each
    validate the batch again (one host synchronisation each) and rebuild the same per-token quantities.
    """

    logp: Tensor  # masked log-probs in the working dtype, carrying the gradient
    terms: Terms  # detached per-token quantities (k1, importance log-ratios, mask, is_clip)
    coefficients: Tensor  # [B, T] the preset's detached per-token gradient weights c, zero at padding
    sequence_kl: Tensor  # [B] sum_t w_{1:t} k3_t per sequence, detached (unbiased for KL_seq when is_clip is None)
    is_ess: Tensor  # 0-dim effective sample size of the full-sequence importance weights (1.0 on-policy), detached

    def surrogate(self, beta: float | Tensor = 1.0) -> Tensor:
        """`kl_surrogate` of this batch: value beta * mean_b sequence_kl_b, gradient beta * (1/B) sum c grad logp."""
        check_beta(beta)
        return _surrogate(self, beta)

    def coefficients_of(self, preset: str | Preset, *, on_policy: bool = False) -> Tensor:
        """Another preset's per-token weights on the same batch, without is_clip or discount (e.g. a framework's native
        KL, for the live bias signal); on_policy=True drops the importance ratios (a native loss that applies none)."""
        spec = get_preset(preset)
        terms = self.terms
        if spec.uses_batch_statistics and terms.statistics is None:
            terms = terms.with_changes(statistics=_statistics_of(terms, None, spec))
        if on_policy:
            terms = terms.with_changes(log_rho=torch.zeros_like(terms.log_rho), on_policy=True)
        terms = terms.with_changes(is_clip=None, discount=1.0)
        return spec.coefficients(terms) * terms.mask

    def weight_gap_parts(self, native: str | Preset, *, on_policy: bool = False) -> Tensor:
        """[2]: (sum |c_native - c|, sum |c|) over the batch's tokens, c_native = `coefficients_of(native,
        on_policy=on_policy)` (a framework's own KL loss); summed over data-parallel ranks before `weight_gap` where
        the batch is split."""
        c = self.coefficients
        return torch.stack(((self.coefficients_of(native, on_policy=on_policy) - c).abs().sum(), c.abs().sum()))

    def grad_weight_gap(self, native: str | Preset, *, on_policy: bool = False) -> Tensor:
        """0-dim `weight_gap` of this batch: how far the gradient of `native`'s per-token weights is from the preset's
        (the adapters' kl_adapters/grad_weight_gap)."""
        return weight_gap(self.weight_gap_parts(native, on_policy=on_policy))


def weight_gap(parts: Tensor) -> Tensor:
    """sum |c_native - c_preset| / sum |c_preset| from [..., 2] `KLTerm.weight_gap_parts` (summed first over whatever
    the batch is split across): 0 when the two weights agree token for token, and 0 when the preset's weights are all
    zero (nothing to compare with). The one formula of the kl_adapters/grad_weight_gap metric (adapters/metrics.py);
    pinned by tests/verl/test_loss_path.py::test_grad_weight_gap_is_the_distance_of_the_weights."""
    gap, size = parts.unbind(-1)
    return torch.where(size > 0, gap / size.clamp(min=torch.finfo(size.dtype).tiny), 0.0)


def _surrogate(term: KLTerm, beta: float | Tensor) -> Tensor:
    """beta (1/B) sum_b (value_b + sum_t c grad logp); an empty batch (B = 0) gives 0 with a graph through logp (a
    data-parallel rank with nothing to contribute still takes part in the backward pass)."""
    grad_part = (term.coefficients * term.logp).sum()
    return beta * (term.sequence_kl.sum() + (grad_part - grad_part.detach())) / max(term.logp.shape[0], 1)


def kl_term(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    preset: str | Preset = "sequence",
    old_logp: Tensor | None = None,
    is_clip: float | None = None,
    statistics: KLStatistics | None = None,
    group: Tensor | None = None,
    task: TaskAdvantages | None = None,
    eos: EndOfSequence | None = None,
    discount: float = 1.0,
) -> KLTerm:
    """Validate the batch once and compute the preset's weights and the per-sequence KL estimate (see `KLTerm`).

    statistics: `kl_statistics` of a larger batch, sliced to these rows (only for presets with uses_batch_statistics);
    None = compute them from this batch, leave-one-out over its rows (within `group`, [B] integer ids, when given),
    fitted with `task` (the trainer's advantages). eos: the batch's end-of-sequence probabilities (the termination
    control variate; needed with statistics computed with them). discount: gamma < 1 shortens the future-KL return of
    a discountable preset (`Preset.discountable`: sequence, reward, their plain forms, full) to sum_{s>t} gamma^(s-t)
    ...: lower variance at long horizons, biased (`kl-adapters audit --discount` measures it); 1 = exact.
    """
    options = KLOptions(old_logp=old_logp, is_clip=is_clip, statistics=statistics, group=group, task=task, eos=eos,
                        discount=discount)
    return _kl_term(logp, ref_logp, mask, get_preset(preset), options)


def _kl_term(logp: Tensor, ref_logp: Tensor, mask: Tensor, spec: Preset, o: KLOptions) -> KLTerm:
    """`kl_term` with the preset resolved and the options gathered."""
    _check_options(spec, o)
    lp, t = _terms(logp, ref_logp, mask, o)
    if spec.uses_batch_statistics and o.statistics is None:
        check_group(o.group, logp)
        t = t.with_changes(statistics=_statistics_of(t, o.group, spec))
    return KLTerm(logp=lp, terms=t, coefficients=spec.coefficients(t) * t.mask, sequence_kl=_value_per_sequence(t),
                  is_ess=_is_ess(t))


def kl_statistics(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    group: Tensor | None = None,
    preset: str | Preset = "sequence",
    task: TaskAdvantages | None = None,
    eos: EndOfSequence | None = None,
    discount: float = 1.0,
) -> KLStatistics:
    """Leave-one-out statistics (`KLStatistics`: coefficients [B], baseline [B, T]; detached, working dtype) of the
    reduced presets, fitted to the trainer's task + KL gradient when `task` gives its advantages.

    Compute them once on the largest batch of independent samples at hand (e.g. the whole rollout batch at experience
    time; `group` = [B] GRPO prompt ids restricts the leave-one-out to each group, which task advantages normalised
    per group need), store them beside the batch, and pass the rows of each micro-batch as `statistics=` to
    `kl_term` / `kl_surrogate` with the same `preset` (its `weighted_returns`: `sequence`'s are importance-weighted,
    `reward`'s are not) and the micro-batch's `eos`. Row b's statistics depend only on the other rows, so the gradient
    stays exact (tests/core/test_batch_exactness.py). Definitions: reductions.py.
    """
    spec = get_preset(preset)
    if spec.needs_full_logits:
        raise ValueError("preset 'full' computes its statistics from both models' full distributions: use "
                         "kl_adapters.full_statistics")
    options = KLOptions(old_logp=old_logp, group=group, task=task, eos=eos, discount=discount)
    _check_options(spec, options, computing=True)
    _, t = _terms(logp, ref_logp, mask, options)
    check_group(group, logp)
    return _statistics_of(t, group, spec)


def kl_surrogate(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    preset: str | Preset = "sequence",
    beta: float | Tensor = 1.0,
    old_logp: Tensor | None = None,
    is_clip: float | None = None,
    statistics: KLStatistics | None = None,
    group: Tensor | None = None,
    task: TaskAdvantages | None = None,
    eos: EndOfSequence | None = None,
    discount: float = 1.0,
) -> Tensor:
    """The KL term to add to a minimized loss: a 0-dim tensor whose gradient is the preset's estimate.

    Gradient: beta * (1/B) * sum_b sum_t c_{b,t} * grad logp_{b,t}, with c the preset's detached per-token weight
    (see `kl_adapters.presets`). For preset "sequence" this is an unbiased estimate of beta * grad KL_seq both
    on-policy and off-policy; "reward" is unbiased on-policy. Both are variance-reduced with statistics from the
    batch's other rows (or `statistics` from `kl_statistics`, or within `group`; see `kl_term`), fitted to the
    trainer's task + KL gradient with `task` (its advantages) and with a termination control variate from `eos`
    (end-of-sequence probabilities); "sequence-plain"
    (c_t = sum_{s>=t} w_{1:s} k1_s) and "reward-plain" are the unreduced forms. Pinned by
    tests/core/test_exactness.py::test_expected_gradient_matches_documented_target and, for batches of 1-3 sequences,
    tests/core/test_batch_exactness.py.

    Value: beta * (1/B) * sum_b sum_t w_{1:t} k3_t -- an unbiased estimate of beta * KL_seq (importance-weighted by the
    per-decision weights w when old_logp is given, w = 1 on-policy), the same for every preset; presets differ only in
    their gradient. Pinned by tests/core/test_exactness.py::test_value_is_unbiased_for_sequence_kl.

    is_clip caps every importance weight the preset uses (w_{1:t} or rho_t) at is_clip: lower variance, but biased
    (measured by `kl-adapters audit`). Off by default. Returned in the working dtype (float32 or float64).
    """
    spec = get_preset(preset)  # an unknown name is reported before anything else
    check_beta(beta)
    options = KLOptions(old_logp=old_logp, is_clip=is_clip, statistics=statistics, group=group, task=task, eos=eos,
                        discount=discount)
    return _surrogate(_kl_term(logp, ref_logp, mask, spec, options), beta)


def kl_coefficients(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    preset: str | Preset = "sequence",
    old_logp: Tensor | None = None,
    is_clip: float | None = None,
    statistics: KLStatistics | None = None,
    group: Tensor | None = None,
    task: TaskAdvantages | None = None,
    eos: EndOfSequence | None = None,
    discount: float = 1.0,
) -> Tensor:
    """The preset's detached per-token gradient weights c [B, T]: grad(per-sequence term) = sum_t c_t grad logp_t.

    Zero at padding. Comparing the weights of two presets on the same batch measures how far one's gradient is from
    the other's, token by token (the live bias signal adapters log). statistics / group: as in `kl_term`.
    """
    return kl_term(logp, ref_logp, mask, preset=preset, old_logp=old_logp, is_clip=is_clip, statistics=statistics,
                   group=group, task=task, eos=eos, discount=discount).coefficients


def kl_reward(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    beta: float | Tensor = 1.0,
    to_go: bool = False,
) -> Tensor:
    """Per-token KL reward for trainers that put the KL in the reward (preset "reward"), detached, zero at padding.

    Returns -beta * k1_t (to_go=False), to be summed by the trainer's own returns with gamma = 1, or the KL
    reward-to-go -beta * sum_{s>=t} k1_s (to_go=True), to be added to a per-token advantage. Either way the policy
    gradient E[sum_t grad log pi_t * (that return)] equals -beta * grad KL_seq on-policy. Pass the log-probs of the
    *current* policy: a penalty computed from stale (rollout-time) log-probs is biased off-policy.
    """
    check_beta(beta)
    _, t = _terms(logp, ref_logp, mask, KLOptions())
    kl = reverse_cumsum(t.k1) if to_go else t.k1
    return -beta * kl * t.mask


def sequence_kl(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    is_clip: float | None = None,
) -> Tensor:
    """Per-sequence estimate [B] of KL_seq: sum_t w_{1:t} k3_t, detached (unbiased when is_clip is None)."""
    _, t = _terms(logp, ref_logp, mask, KLOptions(old_logp=old_logp, is_clip=is_clip))
    return _value_per_sequence(t)


#: loss aggregation modes (verl's names) and the divisor D each applies to sum_{b,t} mask * term
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def per_sequence_beta(
    beta: float,
    mask: Tensor,
    aggregation: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    max_length: int | None = None,
) -> float | Tensor:
    """Convert a framework's per-token KL coefficient to the per-sequence beta of `kl_surrogate`.

    A framework that adds beta * k_t per token and aggregates sum_{b,t} mask * (task_t + beta * k_t) / D applies the
    KL with weight beta / D per token. `kl_surrogate` divides by the B sequences, so the same strength relative to the
    task loss is beta_seq = beta * B / D:
        token-mean              D = number of real tokens (num_tokens, e.g. the global count; default mask.sum())
        seq-mean-token-sum      D = B                  -> beta
        token-sum               D = 1                  -> beta * B
        seq-mean-token-sum-norm D = B * max_length     -> beta / max_length   (Dr. GRPO's constant normaliser)
    seq-mean-token-mean divides each sequence by its own length: that objective is a length-normalized KL, which no
    constant beta_seq reproduces, so it raises ValueError.
    """
    batch = mask.shape[0]
    if aggregation == "token-mean":
        # an integer tensor count would make beta * B / count a float32 tensor (2e-9 off in float64 work): count as a
        # Python int, and widen an integer num_tokens tensor to float64
        tokens = int((mask != 0).sum()) if num_tokens is None else num_tokens
        if isinstance(tokens, Tensor) and not tokens.is_floating_point():
            tokens = tokens.to(torch.float64)
        return beta * batch / tokens
    if aggregation == "seq-mean-token-sum":
        return beta
    if aggregation == "token-sum":
        return beta * batch
    if aggregation == "seq-mean-token-sum-norm":
        if max_length is None:
            raise ValueError("seq-mean-token-sum-norm needs max_length (the constant per-sequence normaliser)")
        return beta / max_length
    if aggregation == "seq-mean-token-mean":
        raise ValueError(
            "seq-mean-token-mean divides each sequence's KL by its own length: that optimizes a length-normalized KL, "
            "not KL_seq, and no per-sequence beta reproduces it; use token-mean or seq-mean-token-sum(-norm)"
        )
    raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
