"""Variance reductions of the `sequence`, `reward` and `full` presets, fitted to the gradient the trainer takes.

Notation per sequence (presets.py): k1_t = log pi/pi_ref, xi_t = r_t - 1 = pi_ref/pi - 1 at the sampled token,
rho_t = pi/mu, w_{1:t} = prod_{s<=t} rho_s (1 on-policy), g_t = grad log pi(y_t | y_<t), Pi_t = sum_{s<t} k1_s (the
KL of the prefix). With the end-of-sequence probabilities (`EndOfSequence`): p_t = pi(EOS | y_<t), e_t = 1[y_t is an
EOS token], n_t = horizon - 1 - t (positions a stop at t gives up), nu_t = (1 - (1 - p_t)^n_t) / p_t (the expected
number of them under a constant stop hazard p_t; n_t as p_t -> 0) and eta_t = nu_t (p_t - e_t). Only p_t must be the
current policy's: nu_t may be any function of y_<t, and precomputed statistics carry the rollout policy's
(`KLStatistics.eos_count`), so the loss spends no transcendental function on it.

The trainer's gradient is task + KL: per token, up to a positive factor, (A_{b,t} - beta c_{b,t}) g_{b,t} with A the
task advantage (`TaskAdvantages`) and c the KL term's weight. The plain `sequence` weight is
c_t = sum_{s>=t} w_{1:s} k1_s; the reduced one (presets.py) is

    c_t = sum_{s>=t} w_{1:s} k1_s + sum_{s>t} w_{1:s} (a_b xi_s + h_b eta_s) + w_{1:t} (lambda_b Pi_t - m_{b,t})

(`full`: the future-KL return is exact, sum_{s>t} w_{1:s-1} KL_s, and a_b multiplies the resampling control variate
w_{1:s} k1_s - w_{1:s-1} KL_s instead; full_vocab.py). Every added term has zero expectation, so the expected gradient
is unchanged for any coefficients that are functions of the OTHER rows only (pinned by
tests/core/test_batch_exactness.py, every ordered batch of G = 1, 2, 3, on- and off-policy, with task advantages):
  * control variates: for s > t, g_t and w_{1:s-1} are functions of y_<s and E_mu[rho_s X_s | y_<s] = E_pi[X_s | y_<s]
    = 0 for X = xi (sum_v pi_ref(v) - 1), eta (nu_s (p_s - pi(EOS | y_<s))) and k1 - KL (E_pi[k1_s | y_<s] = KL_s);
  * baseline: lambda_b Pi_t - m_{b,t} does not depend on y_t given y_<t, and E_mu[w_{1:t} g_t b | y_<t] =
    w_{1:t-1} b E_pi[g_t | y_<t] = 0.

Why the past term. At the regularized optimum pi* = pi_ref exp(R / beta) / Z, R(y) / beta - sum_s k1_s = log Z for
every y, so the combined weight A / beta - c_t of the plain estimator differs from a constant only by Pi_t: the task's
noise and the KL's cancel except for the prefix, which the admissible baseline lambda Pi_t (lambda = 1) removes. The
control variates remove KL noise that the task does not cancel far from pi*, and would add noise near pi*, where it is
cancelled; so the coefficients are fitted to the combined weight, not to the KL part alone.

How they are fitted (`batch_statistics`), for row b from the other rows b' of its group (leave-one-out):
  1. KL-only coefficients, precise because they are token-level: a~_b = clamp(-sum k1 xi / sum xi^2, 0, 1) (the
     regression of k1 on xi, with `cv_prior_tokens` of prior weight on 0, and the upper tail of xi that E[xi] = 0 says
     the other rows did not draw counted in: `unseen_tail`) and kappa_b = the mean k1 per token (the KL a
     stop gives up per lost position). a~_b Q and -kappa_b H are the KL-optimal control variates of the return after
     t (a fitted termination coefficient would be noisy: a stop is a rare, row-level event).
  2. The joint fit: with the other rows' returns from t given they reached t (P: the preset's, Q = sum_{s>t} xi_s,
     H = sum_{s>t} eta_s, importance-weighted relative to t where the preset's return is) and the task in KL units,
     y = P - alpha~ (alpha~ = A / beta, its shift over the other rows removed; with TaskAdvantages.normalized also its
     scale, see there; with importance-weighted returns each row's alpha~ weighted by `off_policy_task_weight`),
     (rho_xi, rho_eos, delta, lambda) minimise sum over the other rows' tokens of
     omega (y + rho_xi a~ Q - rho_eos kappa H + delta D + lambda Pi - m_t)^2 with a free mean m_t per position (least
     squares, clamped to [0, 1]: each rho scales a KL-optimal control variate down to what the task leaves
     uncancelled); omega = (1 - pi(y_t))^2 is the squared norm of the token's logit score e_y - pi without the rest of
     the distribution (the gradient's variance weighs each token's weight by it). a_b = rho_xi a~_b,
     h_b = -rho_eos kappa_b. The unseen tail M of step 1 enters here too, as the variance one token with xi = M would
     add to a~ Q, and without a task its covariance with the KL return (`UnseenTail`, `_add_unseen_tail`).
  3. m_{b,t} = the omega-weighted mean over the other rows alive at t of y + (the fitted terms), shrunk toward 0 by a
     positive-part James-Stein factor (a mean of few returns adds its own noise).
  4. Every statistic of row b is multiplied by dof / (dof + `fit_prior_dof`), dof = sum_t (n_{b,t} - 1) the other rows'
     tokens beyond the per-position means (`fit_shrinkage`): a row with fewer than two other rows with tokens gets 0,
     the plain form, and a tiny group only a fraction of its fit (measured on groups of 3-4 three-token completions:
     docs/variance.md, exact tiny batches).
The priors and a switch for each part, with their defaults (the above) and each switch's benefit pin:
`ReductionConfig` (reduction_settings.py, imported here as well); `reduction_config` sets one for a block (ablations:
bench/reduction_components.py, docs/variance.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from .estimators import as_float, capped, reverse_cumsum
from .reduction_settings import ReductionConfig, active_reduction_config
from .reduction_settings import reduction_config  # noqa: F401 - kl_adapters.reductions.reduction_config, as documented

@dataclass(frozen=True)
class TaskAdvantages:
    """The trainer's task term beside the KL term, which the reduced presets' statistics are fitted with.

    The trainer's gradient (ascent) is proportional to sum_{b,t} (advantages_{b,t} - beta c_{b,t}) grad log pi_{b,t}
    where c is the KL term's per-token weight: `beta` is the KL coefficient on the advantages' scale (TRL: the
    GRPOConfig `beta`; verl: `kl_loss_coef`; OpenRLHF: `init_coef`), not necessarily the per-sequence beta of
    `kl_surrogate`; a float, or a [B] tensor whose row-b value is row b's ratio and a function of the OTHER rows only
    (e.g. of their lengths, where the trainer's normaliser counts tokens). advantages: [B] (one per sequence, GRPO /
    RLOO) or [B, T] (per token, GAE).

    Row b's statistics use the other rows' advantages only after removing their common shift (their mean over the
    other rows of b's group), so advantages may be centred by a group mean that includes row b (GRPO, RLOO).
    normalized=True: they were also divided by a standard deviation over rows that include b (GRPO's group std,
    whitening); the other rows' advantages are then standardised among themselves and taken at unit scale, and left
    out where they all tie (`_task_scale`). Either way the statistics are invariant to the shift and scale of the
    normalisation, so they stay functions of the other rows: the expected gradient is exact
    (tests/core/test_batch_exactness.py, tests/core/test_normalized_advantages_exactness.py).
    Within a `group`, the rows must share the advantages' normalisation (pass GRPO prompt ids as `group`).
    """

    advantages: Tensor
    beta: float | Tensor
    normalized: bool = False


@dataclass(frozen=True)
class EndOfSequence:
    """Where completions may stop, for the termination control variate.

    prob    [B, T] pi(EOS | y_<t): the current policy's probability of ending at t (summed over the end-of-sequence
            ids, at the trainer's temperature), detached
    is_eos  [B, T] bool: y_t is an end-of-sequence token
    horizon the maximum completion length (positions a stop at t gives up: horizon - 1 - t); None = the batch width T
    """

    prob: Tensor
    is_eos: Tensor
    horizon: int | None = None


@dataclass(frozen=True)
class KLStatistics:
    """Per-row statistics of the reduced presets (detached): the fitted ones computed from the OTHER rows of the row's
    group, and the termination counts of the row's own prefix.

    cv_coef    [B]    a_b: coefficient of the future control variate (xi; `full`: k1 - KL)
    eos_coef   [B]    h_b: coefficient of the termination control variate (0 without EndOfSequence)
    past_coef  [B]    lambda_b: coefficient of the prefix KL Pi_t in the baseline
    baseline   [B, T] m_{b,t}
    eos_count  [B, T] nu_t (`termination_counts`) of the end-of-sequence probabilities the statistics were computed
                      with (zero without them): a function of the row's own prefix y_<t, which may be any, so the loss
                      forms eta_t = nu_t (p_t - e_t) with the current policy's p_t and no transcendental function
                      (off-policy, nu from the rollout policy's probabilities: the same expected gradient)
    Slice them along the batch dimension together with the batch they belong to (e.g. into micro-batches).
    """

    cv_coef: Tensor
    eos_coef: Tensor
    past_coef: Tensor
    baseline: Tensor
    eos_count: Tensor

    def __getitem__(self, rows) -> KLStatistics:
        """The statistics of a subset of rows (a slice, index tensor or bool mask over the batch dimension)."""
        return KLStatistics(*(getattr(self, f.name)[rows] for f in fields(self)))

    def with_width(self, width: int) -> KLStatistics:
        """The same statistics with the [B, T] ones cut or zero-padded to `width` positions (a micro-batch's padding)."""
        def fit(x: Tensor) -> Tensor:
            if x.dim() == 1:
                return x
            x = x[:, :width]
            return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x
        return KLStatistics(*(fit(getattr(self, f.name)) for f in fields(self)))

    def to(self, *args, **kwargs) -> KLStatistics:
        """Every tensor moved / cast with Tensor.to."""
        return KLStatistics(*(getattr(self, f.name).to(*args, **kwargs) for f in fields(self)))

    def as_dict(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def control_variate(k1: Tensor, mask: Tensor) -> Tensor:
    """xi_t = r_t - 1 = pi_ref/pi - 1 = expm1(-k1_t) at real tokens, 0 at padding: zero mean under pi given the prefix
    (-k1 `estimators.capped` where r would overflow the working dtype)."""
    return torch.expm1(capped(-k1)) * mask


def termination_counts(eos: EndOfSequence, mask: Tensor, dtype: torch.dtype, discount: float = 1.0) -> Tensor:
    """nu_t = sum_{k=1}^{n_t} gamma^(k-1) ... at real tokens, 0 at padding (mask: bool, or 0/1): the (discounted)
    expected count of the positions a stop at t gives up under a constant stop hazard p_t = eos.prob,
    nu_t = gamma (1 - q^n_t) / (1 - q), q = gamma (1 - p_t) (gamma = `discount`; 1: (1 - (1 - p_t)^n_t) / p_t). It is
    evaluated at p_t clamped to [tiny, 1 - eps] of the working dtype (tiny, eps: its smallest normal number and machine
    epsilon), which gives the limits gamma n_t at p_t = 0 (gamma = 1) and gamma (1 - (gamma eps)^n_t) / (1 - gamma eps),
    within eps of the exact value, at p_t = 1. A function of y_<t: any such nu keeps the control variate's mean at 0
    (`termination_increments`). tests/core/test_termination.py."""
    width = mask.shape[-1]
    horizon = width if eos.horizon is None else eos.horizon
    real = mask if mask.dtype == torch.bool else mask != 0
    p = torch.where(real, eos.prob.detach().to(dtype), 0.0)  # in [0, 1] at real tokens (check_eos)
    after = (horizon - 1 - torch.arange(width, dtype=dtype, device=mask.device)).clamp(min=0)
    info = torch.finfo(dtype)
    inside = p.clamp(info.tiny, 1 - info.eps)
    log_q = torch.log1p(-inside)
    gap = inside  # 1 - q
    if discount != 1.0:
        log_q = log_q + math.log(discount)
        gap = (1 - discount) + discount * inside
    nu = torch.expm1(after * log_q).div_(gap).mul_(-discount)  # gamma (1 - q^n) / (1 - q)
    return nu.mul_(as_float(real, dtype))


def termination_increments(eos: EndOfSequence, mask: Tensor, dtype: torch.dtype, discount: float = 1.0,
                           counts: Tensor | None = None) -> Tensor:
    """eta_t = nu_t (p_t - e_t) at real tokens (mask: bool, or 0/1), 0 at padding (module docstring): zero mean under
    pi given y_<t for any nu_t that is a function of y_<t. counts: nu [B, T] (zero at padding), e.g. `KLStatistics.
    eos_count` computed at rollout time; None = `termination_counts` of these probabilities. p_t - e_t uses the
    current p_t itself. tests/core/test_termination.py."""
    real = mask if mask.dtype == torch.bool else mask != 0
    nu = termination_counts(eos, real, dtype, discount) if counts is None else counts
    return increments_from_counts(nu, torch.where(real, eos.prob.detach().to(dtype), 0.0), eos.is_eos)


def increments_from_counts(counts: Tensor, prob: Tensor, is_eos: Tensor) -> Tensor:
    """eta_t = nu_t (p_t - e_t) from counts nu (zero at padding), p_t (finite everywhere, in the working dtype) and
    is_eos: zero at padding whatever p and e hold there. The loss's form (surrogate._terms) and
    `termination_increments`'."""
    return counts * (prob - as_float(is_eos, counts.dtype))


def past_kl(k1: Tensor, mask: Tensor) -> Tensor:
    """Pi_t = sum_{s<t} k1_s at real tokens (a function of the prefix), 0 at padding."""
    return (k1.cumsum(-1) - k1) * mask


def same_group(group: Tensor | None) -> Tensor | None:
    """Group ids as 0..n_groups-1 without a host synchronisation (None = one group: the whole batch)."""
    if group is None:
        return None
    ids, order = torch.sort(group, stable=True)
    new = torch.ones_like(ids, dtype=torch.long)
    new[1:] = (ids[1:] != ids[:-1]).long()
    dense = torch.empty_like(new)
    dense[order] = new.cumsum(0) - 1
    return dense


def others_sum_(x: Tensor, same: Tensor | None) -> Tensor:
    """Sum over the other rows of the same group (dim 0): group sum minus the row's own value, written over x (which
    it returns; pass a temporary). One group: column sums, no second tensor of x's size; several: sums per dense group
    id (memory O(x), no [B, B] matrix)."""
    totals = x.sum(0, keepdim=True) if same is None else torch.zeros_like(x).index_add_(0, same, x)[same]
    return torch.sub(totals, x, out=x)


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """[B] sum_t x_{b,t} y_{b,t} without a [B, T] product."""
    return torch.bmm(x[:, None], y[:, :, None])[:, 0, 0]


def relative_returns(x: Tensor, mask: Tensor, log_rho: Tensor | None, discount: float = 1.0) -> Tensor:
    """R_t = sum_{s>=t} discount^(s-t) w_{t+1:s} x_s per channel of x [B, k, T] (zero at padding): a row's return from t given it
    reached t. w_{t+1:s} = w_{1:s} / w_{1:t} is computed relative to the row's largest prefix weight, held at
    exp(`log_relative_weight_floor`) where it is smaller (so neither underflows to 0 / 0 nor overflows in float32: only
    other rows' statistics read these returns, and any function of the other rows keeps the gradient exact, so the
    floor changes variance only, for rows whose weights have degenerated). log_rho None: on-policy (every w = 1)."""
    if log_rho is None:
        return reverse_cumsum(x, discount) * mask[:, None]
    log_w = log_rho.cumsum(-1)
    floor = active_reduction_config().log_relative_weight_floor
    rel = torch.exp((log_w - log_w.max(-1, keepdim=True).values).clamp(min=floor))[:, None]
    return reverse_cumsum(rel * x, discount) / rel * mask[:, None]


def _regression(num: Tensor, den: Tensor, tokens: Tensor) -> Tensor:
    """clamp(num / den, 0, 1) * tokens / (tokens + `cv_prior_tokens`) for num = -sum k1 xi, den = sum xi^2; 0 where
    den = 0. -k1 xi >= 0 always (k1 and xi have opposite signs), so the ratio is >= 0; it tends to 1 as k1 -> 0
    (xi = -k1 + O(k1^2)). An overflowed xi (inf / inf) gives 0, the plain k1 return."""
    prior = active_reduction_config().cv_prior_tokens
    ratio = torch.nan_to_num(num / den, nan=0.0).clamp(0.0, 1.0) * tokens / (tokens + prior)
    return torch.where(den > 0, ratio, torch.zeros_like(ratio))


@dataclass(frozen=True)
class Returns:
    """The other rows' per-position quantities that `batch_statistics` fits to, each [B, T] and zero at padding.

    ret     P_t, the preset's own return from t (given t was reached)
    cv      Q_t, its future control variate's return (sum_{s>t} xi_s; `full`: the resampling one, 0 for `sequence`)
    past    Pi_t
    eos     H_t = sum_{s>t} eta_s (None without EndOfSequence)
    resample  D_t for `full` (its second control variate; None for the sampled-token presets)
    """

    ret: Tensor
    cv: Tensor
    past: Tensor
    eos: Tensor | None = None
    resample: Tensor | None = None


def batch_statistics(r: Returns, cv_scale: Tensor, kappa: Tensor, task: TaskAdvantages | None, omega: Tensor,
                     mask: Tensor, same: Tensor | None, tail: UnseenTail | None = None,
                     counts: Tensor | None = None, task_weight: Tensor | None = None) -> KLStatistics:
    """Leave-one-out statistics of every row (module docstring, steps 2 and 3) from the batch's `Returns`.

    cv_scale [B] a~_b and kappa [B] kappa_b: the KL-only coefficients of row b (functions of the other rows), so that
    Z = a~_b Q - kappa_b H; task: the trainer's advantages ([B, T], zero at padding; None: no task term), alpha =
    A / beta in KL units; omega [B, T] the score weights (zero at padding); mask [B, T] 0/1 in the working dtype; same:
    dense group ids or None; tail: xi's unseen tail, counted in the joint fit (`_add_unseen_tail`; None: not counted,
    as for `full`, whose future control variate is the resampling one); counts: the rows' own `termination_counts`
    (the H channel's nu; None: no EndOfSequence), returned as eos_count; task_weight [B, T]: the weight at which each
    row's shift-free advantages enter the fit (a function of that row alone, zero at padding; None: 1,
    `off_policy_task_weight`). Off-policy the returns are already relative to t (`relative_returns`) and the tokens
    are not reweighted: weighting the fit by the importance weight the preset puts on a row (w_{1:t}^2), with the task as A / w, was
    tried and dropped: it extrapolates the other rows' baselines to row b's weight (measured: docs/history.md). Computed in
    float64 whatever the working dtype (the leave-one-out sums are group totals minus the row's own terms, whose
    rounding must not reach a fitted coefficient), returned in the working dtype. Every statistic is shrunk toward 0
    (the plain form) by `fit_shrinkage` of the other rows' per-position token counts: 0 with fewer than two other rows
    with tokens, 3 / 11 for two other rows of 3 tokens, > 0.99 from ~800 tokens beyond the per-position means.
    """
    out_dtype, dtype = mask.dtype, torch.float64
    batch, width = mask.shape
    config = active_reduction_config()
    if not config.fit:
        zero = torch.zeros(batch, dtype=out_dtype, device=mask.device)
        counts = torch.zeros_like(mask) if counts is None else counts
        return KLStatistics(zero, zero, zero, torch.zeros_like(mask), counts)
    if not config.task:
        task = None
    alpha = None if task is None else task.advantages
    faded = alpha is not None and task_weight is not None
    # the channels present in this batch: P, the task (times its weight f, and f itself: y's shift term scale mu f),
    # then the fit's features (absent ones are left out, not zeros)
    channels = {"ret": r.ret, "task": alpha * task_weight if faded else alpha, "task_weight": task_weight if faded else
                None, "xi": None if r.resample is not None else r.cv, "eos": r.eos, "resample": r.resample,
                "past": r.past}
    names = [n for n, x in channels.items() if x is not None]
    # one [B, 2 + k, T] float64 buffer of (omega, mask, omega x channels) and one [B, k, T] of the channels, written in
    # place (each input cast once, on its copy)
    per_token = torch.empty(batch, 2 + len(names), width, dtype=dtype, device=mask.device)
    feats = torch.empty(batch, len(names), width, dtype=dtype, device=mask.device)  # zero at padding
    om = per_token[:, 0].copy_(omega)
    per_token[:, 1].copy_(mask)
    for i, n in enumerate(names):
        feats[:, i].copy_(channels[n])
    weighted = torch.mul(om[:, None], feats, out=per_token[:, 2:])
    gram = others_sum_(torch.bmm(weighted, feats.transpose(1, 2)), same)
    if alpha is not None:
        alpha = alpha.to(dtype) if faded else feats[:, names.index("task")]
    scale, mu = _task_scale(task, alpha, mask, same)
    sums = others_sum_(per_token, same)  # per_token now holds the other rows' per-position sums
    weight, count, s_f = sums[:, 0], sums[:, 1], sums[:, 2:]
    inv_w = torch.where(weight > 0, weight.reciprocal(), 0.0)
    root = inv_w.sqrt()
    s_f.mul_(root[:, None])  # s_f / sqrt(W_t), so that sum_t s_f s_f^T / W_t is one bmm
    centred = gram - torch.bmm(s_f, s_f.transpose(1, 2))  # per-position centred, summed over t
    # y = P - scale f (alpha - mu) and the fit's features (a~ Q, -kappa H, D, Pi) as linear maps of the channels, per row
    features = [n for n in ("xi", "eos", "resample", "past") if n in names]
    zero, one = torch.zeros_like(scale), torch.ones_like(scale)
    factor = {"xi": cv_scale.to(dtype), "eos": -kappa.to(dtype), "resample": one, "past": one}
    y = {"ret": one} | ({} if alpha is None else {"task": -scale}) | ({"task_weight": scale * mu} if faded else {})
    rows = [y] + [{n: factor[n]} for n in features]  # the rows of lin as {channel: [B] coefficient}
    lin = torch.stack([row.get(n, zero) for row in rows for n in names], 1).view(batch, len(rows), len(names))
    moments = torch.bmm(torch.bmm(lin, centred), lin.transpose(1, 2))
    raw = (torch.bmm(lin, gram) * lin).sum(-1)[:, 1:]  # the features' raw second moments
    if tail is not None and "xi" in features and config.unseen_tail:
        _add_unseen_tail(moments, raw, 1 + features.index("xi"), cv_scale.to(dtype), tail, alpha is not None)
    tokens = count.sum(-1)
    dof = tokens - (count > 0).sum(-1)  # sum_t max(n_{b,t} - 1, 0): the counts are whole numbers
    theta = _joint_fit(moments, raw, tokens, config)
    coef = lin[:, 0] + (theta[:, :, None] * lin[:, 1:]).sum(1)  # z = coef . channels (+ scale mu, unless faded)
    mean = torch.bmm(coef[:, None], s_f)[:, 0].mul_(root)
    if not faded:
        mean.add_((weight * inv_w).mul_((scale * mu)[:, None]))
    var_z = (torch.bmm(coef[:, None], centred)[:, 0] * coef).sum(-1)
    baseline = _james_stein(mean, var_z, weight, count, tokens, dof) if config.james_stein else mean
    fitted = dict(zip(features, theta.unbind(-1)))
    cv_coef = fitted["resample"] if "resample" in fitted else fitted.get("xi", zero) * cv_scale.to(dtype)
    eos_coef = -fitted["eos"] * kappa.to(dtype) if "eos" in fitted else zero
    coefficients = torch.stack([x if on else zero for x, on in (
        (cv_coef, config.control_variate), (eos_coef, config.termination), (fitted["past"], config.past_kl))])
    # every statistic is scaled by dof / (dof + `fit_prior_dof`), dof = sum_t (n_{b,t} - 1) the other rows' tokens left
    # after the per-position means (0 with fewer than two other rows with tokens: the plain form): a fit to a handful of
    # tokens adds more noise than it removes (`fit_shrinkage`); far off-policy (weights past float64's range) a fit can
    # overflow: its statistics are then 0, the plain form, and the baseline is held within +-(working dtype max)^(1/4)
    # so that the row's own capped w_{1:t} times it stays finite
    # (tests/trl/test_faults.py::test_overflowing_importance_weights_stay_finite); all functions of the other rows
    shrink = _shrinkage(dof, config.fit_prior_dof)
    bound = torch.finfo(out_dtype).max ** 0.25
    coefficients, baseline = ((x * factor).nan_to_num_(0.0, 0.0, 0.0).clamp_(-bound, bound).to(out_dtype) for x, factor in
                              ((coefficients, shrink), (baseline if config.baseline else torch.zeros_like(baseline),
                                                        shrink[:, None])))
    return KLStatistics(*coefficients.unbind(), baseline, torch.zeros_like(mask) if counts is None else counts)


def _add_unseen_tail(moments: Tensor, raw: Tensor, row: int, cv_scale: Tensor, tail: UnseenTail, task: bool) -> None:
    """Count xi's unseen tail in the joint fit's moments (in place), as `token_coefficients` counts it in a~: one more
    token with xi = M and k1 = -log(1 + M) at a random position s of the other rows adds a~ M to the feature a~ Q_t
    for each t < s of its row, so reach x (a~ M)^2 to the feature's variance. Without a task term y is the KL return,
    to which the token adds its k1: reach x a~ M (-log(1 + M)) to the covariance and reach x log(1 + M)^2 to y's
    variance (the regression a~ already makes). With one (`task`), the tail's covariance with y is unknown and counted
    as none: near the regularized optimum the task cancels the KL of such a completion (r / beta - sum_t k1_t = log Z
    for every y), which is where the control variate costs variance (`bench/reduction_components.py`,
    docs/variance.md). The other rows' sample of xi lacks exactly the rare large values that make the control variate
    expensive for the row that draws one; counted in, they pull rho_xi toward log(1 + M) / (a~ M) without a task and
    toward 0 with one. A function of the other rows: the gradient stays exact (tests/core/test_batch_exactness.py)."""
    feature = cv_scale * tail.mass
    variance = tail.reach * feature.square()
    moments[:, row, row] += variance
    raw[:, row - 1] += variance
    if not task:
        k1 = -torch.log1p(tail.mass)
        covariance = tail.reach * feature * k1
        moments[:, 0, row] += covariance
        moments[:, row, 0] += covariance
        moments[:, 0, 0] += tail.reach * k1.square()


def fit_shrinkage(count: Tensor) -> Tensor:
    """[B] the factor dof / (dof + `fit_prior_dof`) on every fitted statistic of row b, dof = sum_t max(n_{b,t} - 1, 0)
    from count [B, T] = n_{b,t}, the other rows' tokens at position t (0 with fewer than two other rows with tokens).
    Adding f x (a fitted reduction) changes the variance by 2 f Cov + f^2 Var: with few tokens the fit's own noise
    (Var) outweighs what it removes, and a small f keeps the first-order gain (measured: docs/variance.md). Pinned by
    tests/core/test_statistics.py::test_small_fits_are_shrunk_toward_the_plain_form."""
    return _shrinkage((count - 1).clamp(min=0).sum(-1), active_reduction_config().fit_prior_dof)


def _shrinkage(dof: Tensor, prior: float) -> Tensor:
    """`fit_shrinkage` from dof [B] and the prior (`ReductionConfig.fit_prior_dof`)."""
    return torch.where(dof > 0, dof / (dof + prior), 0.0)


def _task_scale(task: TaskAdvantages | None, advantages: Tensor | None, mask: Tensor, same: Tensor | None
                ) -> tuple[Tensor, Tensor]:
    """(scale_b, mu_b) [B]: the other rows' advantages A enter the fit in KL units as scale_b (A - mu_b), mu_b their
    mean over the other rows' tokens (a shift common to the group cancels exactly); scale_b = 1 / beta_b, or with
    `normalized` 1 / (beta_b sigma_b), sigma_b their standard deviation over the other rows' tokens (a scale common to
    the group cancels too: unit-scale advantages). (1, 0) without a task. In float64 (advantages: float64, zero at
    padding; mask: 0/1 in any floating dtype).

    Condition of exactness with `normalized`: GRPO's A_j = (r_j - mean r) / (std r + eps) over a group that includes
    row b is a positive affine map of the other rows' rewards whose shift and scale depend on row b's reward, so row
    b's statistics must be invariant to that map, including the decision to drop the task. scale_b (A - mu_b) is
    invariant; the only degenerate case, the other rows' advantages all equal (sigma_b = 0, scale 0: no task), is
    decided by exact comparison (`_others_tied`), never by comparing sigma_b^2 to a threshold: any threshold relative to
    the mean square of A (the former `variance_floor` test) moves with the shift, i.e. with row b's reward, and biased
    the gradient where the other rows' rewards nearly tie (tests/core/test_normalized_advantages_exactness.py)."""
    ones = torch.ones(mask.shape[0], dtype=torch.float64, device=mask.device)
    if task is None:
        return ones, torch.zeros_like(ones)
    beta = torch.as_tensor(task.beta, dtype=torch.float64, device=mask.device).expand_as(ones)
    tot = others_sum_(torch.stack((advantages.sum(-1), torch.linalg.vector_norm(advantages, dim=-1).square(),
                                   mask.sum(-1).to(torch.float64)), 1), same)
    tokens = tot[:, 2].clamp(min=1.0)
    mu = tot[:, 0] / tokens
    if not task.normalized:
        return beta.reciprocal(), mu
    var = (tot[:, 1] / tokens - mu.square()).clamp(min=0.0)
    tiny = torch.finfo(torch.float64).tiny
    spread = ~_others_tied(advantages, mask, same) & (var > 0)  # (var rounded to 0 without a tie: no usable scale)
    return torch.where(spread, (beta * var.sqrt()).clamp(min=tiny).reciprocal(), 0.0), mu


def _others_tied(values: Tensor, mask: Tensor, same: Tensor | None) -> Tensor:
    """[B] bool: the other rows of row b's group hold one value at all their real tokens (or have none), by exact
    comparison of their largest and smallest values: a function of the other rows' values alone, not of sums that
    include row b's (values [B, T], mask 0/1, same: dense group ids or None)."""
    extremes = torch.stack((values, -values), 1).masked_fill_((mask == 0)[:, None], -torch.inf).amax(-1)
    largest, minus_smallest = _others_max(extremes, same).unbind(1)
    return largest <= -minus_smallest


def _others_max(x: Tensor, same: Tensor | None) -> Tensor:
    """[B, k] the largest x over the other rows of row b's group, per column (-inf if none), from the group's largest
    and second largest values (x [B, k], -inf for rows without tokens; no host synchronisation)."""
    ids = torch.zeros(x.shape[0], dtype=torch.long, device=x.device) if same is None else same
    spread = ids[:, None].expand_as(x)
    floor = torch.full_like(x, -torch.inf)
    first = floor.scatter_reduce(0, spread, x, "amax")[ids]
    top = x == first
    unique = torch.zeros_like(x).index_add_(0, ids, as_float(top, x.dtype))[ids] == 1
    second = floor.scatter_reduce(0, spread, x.masked_fill(top, -torch.inf), "amax")[ids]
    return torch.where(top & unique, second, first)


def _joint_fit(moments: Tensor, raw: Tensor, tokens: Tensor, config: ReductionConfig) -> Tensor:
    """[B, k] coefficients minimising y + theta . x in the omega-weighted, per-position centred least squares given
    by moments [B, k + 1, k + 1] of (y, x); a ridge of `joint_prior_tokens` / tokens times each feature's variance, and
    every coefficient clamped to [0, 1] (0: the plain form's choice). A feature whose centred variance is below
    `variance_floor` times its raw second moment `raw` [B, k] gets 0. Condition of exactness: the leave-one-out sums
    are group totals minus the row's own terms, so where the other rows' variance is 0 (their feature equal, e.g.
    the same prefix) the computed one is the rounding of row b's own terms, and a coefficient fitted to it depends on
    row b; the floor must lie above that rounding (a floor of 0 biases the gradient:
    tests/core/test_reduction_config.py::test_the_variance_floor_lies_above_the_rounding_of_the_leave_one_out_sums;
    the margin: docs/variance.md)."""
    xx, xy = moments[:, 1:, 1:], moments[:, 1:, 0]
    diag = torch.diagonal(xx, dim1=-2, dim2=-1)
    floor = config.variance_floor * raw + torch.finfo(xx.dtype).tiny
    ridge = diag * config.joint_prior_tokens / tokens.clamp(min=1.0)[:, None] + floor
    theta = -torch.linalg.solve_ex(xx + torch.diag_embed(ridge), xy[..., None]).result[..., 0]  # no host sync
    return torch.where(diag > floor, torch.nan_to_num(theta, nan=0.0), 0.0).clamp(0.0, 1.0)


def _james_stein(mean: Tensor, var_sum: Tensor, weight: Tensor, count: Tensor, tokens: Tensor, dof: Tensor) -> Tensor:
    """lambda_b m_{b,t}: the per-position means shrunk by max(0, 1 - sum_t V_b / n_{b,t} / sum_t m_{b,t}^2), V_b the
    per-token variance pooled over positions (var_sum / total weight, corrected to count - 1 degrees of freedom).
    tokens [B] = sum_t n_{b,t}, dof [B] = sum_t max(n_{b,t} - 1, 0)."""
    tiny = torch.finfo(mean.dtype).tiny
    # (var_sum.clamp: a rounding-level negative sum is 0; 1 / count: inf where no other row reached t, counted as 0)
    per_token = var_sum.clamp(min=0.0) / weight.sum(-1).clamp(min=tiny) * tokens / dof.clamp(min=1)
    noise = per_token * count.reciprocal().nan_to_num_(0.0, 0.0, 0.0).sum(-1)
    signal = torch.linalg.vector_norm(mean, dim=-1).square()
    shrink = torch.where((signal > 0) & (dof > 0), 1 - noise / signal.clamp(min=tiny), 0.0)
    return mean.mul_(shrink.clamp_(min=0.0)[:, None])


class TokenCoefficients(NamedTuple):
    """`token_coefficients` of each row [B], functions of the other rows."""

    cv_scale: Tensor  # a~_b, the regression of k1 on xi (with the unseen tail counted in)
    kappa: Tensor  # kappa_b, the mean k1 per token
    tail: Tensor  # M_b, the mass of xi's upper tail the other rows did not draw (`unseen_tail`), float64


def token_coefficients(k1: Tensor, cv: Tensor, mask: Tensor, same: Tensor | None) -> TokenCoefficients:
    """(a~_b, kappa_b, M_b) from the other rows' tokens: the regression of k1 on xi, guarded against xi's unseen upper
    tail M (`unseen_tail`), the mean k1 per token, and M. Each row's sums in the working dtype (functions of the row
    alone), their leave-one-out combination (totals minus the row's own) in float64."""
    x = torch.stack((_dot(k1, cv), _dot(cv, cv), k1.sum(-1), mask.sum(-1), cv.sum(-1)), 1).to(torch.float64)
    o = others_sum_(x, same)
    missing = unseen_tail(o[:, 4], o[:, 1]) if active_reduction_config().unseen_tail else torch.zeros_like(o[:, 4])
    a = _regression(-o[:, 0] + missing * torch.log1p(missing), o[:, 1] + missing.square(), o[:, 3])
    kappa = torch.where(o[:, 3] > 0, o[:, 2] / o[:, 3].clamp(min=1.0), 0.0)
    return TokenCoefficients(a.to(k1.dtype), kappa.to(k1.dtype), missing)


def unseen_tail(sum_xi: Tensor, sum_xi_sq: Tensor) -> Tensor:
    """M = max(0, -sum xi - `tail_z` sqrt(sum xi^2)): the positive mass of xi = pi_ref/pi - 1 that the other rows' tokens
    are missing. E_pi[xi | y_<t] = 0 exactly and xi >= -1, so where pi has suppressed a token that pi_ref allows, the
    rare samples of it (xi large) are what balance many small negative xi; a sum of xi far below 0 (beyond `tail_z` of
    its own standard error, ~sqrt(sum xi^2) without a tail) says they were not drawn. The regression of k1 on xi then
    counts M as one more token with xi = M and k1 = -log(1 + M) (the most conservative: the largest xi^2 for that mass),
    which pulls a~ toward 0 where the control variate's variance is dominated by a tail the fit cannot see (the
    long-horizon problem near pi*, `bench/reduction_components.py`; docs/variance.md). A function of the other rows:
    the gradient stays exact (tests/core/test_batch_exactness.py). Pinned by
    tests/core/test_statistics.py::test_an_unseen_upper_tail_of_xi_pulls_the_control_variate_toward_zero."""
    return (-sum_xi - active_reduction_config().tail_z * sum_xi_sq.clamp(min=0.0).sqrt()).clamp(min=0.0)


class UnseenTail(NamedTuple):
    """xi's upper tail that the other rows of row b did not draw, for the joint fit (`batch_statistics`), [B] float64.

    mass   M_b (`unseen_tail`): counted as one more token with xi = M and k1 = -log(1 + M), as in a~_b
    reach  the omega-weighted number of positions whose future return Q_t such a token would enter: sum_{t<s} omega_t
           for a token at a random real position s of the other rows (`tail_reach`)
    """

    mass: Tensor
    reach: Tensor


def tail_reach(omega: Tensor, mask: Tensor, same: Tensor | None) -> Tensor:
    """[B] sum_{b' != b} sum_t omega_{b',t} L_{b',t} / sum_{b' != b} n_{b'}, with L_{b',t} the real tokens after t in
    row b' and n_{b'} the row's real tokens: the mean over the other rows' real tokens s of sum_{t<s} omega_t (the
    weight of the positions before s in its row). Float64, a function of the other rows."""
    later = reverse_cumsum(mask) - mask
    sums = others_sum_(torch.stack((_dot(omega, later), mask.sum(-1)), 1).to(torch.float64), same)
    return sums[:, 0] / sums[:, 1].clamp(min=1.0)


def score_weight(logp: Tensor, mask: Tensor) -> Tensor:
    """omega_t = (1 - pi(y_t))^2 at real tokens: the squared norm of the logit score e_y - pi, less sum_{v != y} pi_v^2."""
    return torch.expm1(logp).square_() * mask


def sampled_token_statistics(k1: Tensor, cv: Tensor, eta: Tensor | None, logp: Tensor, log_rho: Tensor | None,
                             mask: Tensor, task: TaskAdvantages | None, group: Tensor | None,
                             discount: float = 1.0, counts: Tensor | None = None) -> KLStatistics:
    """The statistics of `sequence` / `reward` from a [B, T] batch's detached terms (zero at padding; cv = xi,
    eta = `termination_increments` or None, counts = its nu, task advantages already [B, T]); log_rho None:
    unweighted returns (the on-policy batch, or `reward`, whose return is unweighted); the returns discounted like the
    preset's."""
    same = same_group(group)
    channels = (k1, cv) if eta is None else (k1, cv, eta)
    ret = relative_returns(torch.stack(channels, 1), mask, log_rho, discount)
    returns = Returns(ret=ret[:, 0], cv=ret[:, 1] - cv, past=past_kl(k1, mask),
                      eos=None if eta is None else ret[:, 2] - eta)
    coefficients = token_coefficients(k1, cv, mask, same)
    omega = score_weight(logp, mask)
    weighted_task = log_rho is not None and task is not None and active_reduction_config().off_policy_task_weight
    return batch_statistics(returns, coefficients.cv_scale, coefficients.kappa, task, omega, mask, same,
                            UnseenTail(coefficients.tail, tail_reach(omega, mask, same)), counts,
                            off_policy_task_weight(log_rho, mask) if weighted_task else None)


def off_policy_task_weight(log_rho: Tensor, mask: Tensor) -> Tensor:
    """f_t = exp(-|log w_{1:t-1}|) (`weight_fade` with c = 0) at real tokens, 0 at padding: the weight at which a
    row's task advantages enter the joint fit when the returns are importance-weighted (switch:
    `ReductionConfig.off_policy_task_weight`). The trainer's task term weighs token t by rho_t and the KL
    return by w_{1:t} = w_{1:t-1} rho_t, so the task's noise cancels the KL return's (what the joint fit exploits near
    the regularized optimum) only where w_{1:t-1} is near 1; f is 1 there (on-policy: every f = 1) and falls to 0 as
    the prefix weight leaves 1 in either direction. Counting the advantages at full weight, leaving them out and the
    exact frame change (A / w_{1:t-1}) were each measured worse (bench/variance.py off-policy grids: docs/history.md;
    what this weight does: docs/variance.md). A function of the row alone: other rows' statistics stay exact
    (tests/core/test_batch_exactness.py)."""
    log_prefix = log_rho.cumsum(-1) - log_rho
    return torch.exp(-log_prefix.abs()) * mask  # weight_fade(exp(log_prefix), 0) up to rounding, from the log it has


def fade_baseline_(minus_baseline: Tensor, weights: Tensor) -> Tensor:
    """In place, and returned: minus_baseline_t *= u_t = `weight_fade`(W, c) = exp(-max(0, |log W| - c)),
    c = `ReductionConfig.baseline_free_log_weight` (4; switch: `ReductionConfig.baseline_fade`), with
    W = w_{1:t-1} = weights_{t-1} (u_1 = 1), for [B, T] `weights` the running prefix
    weights w_{1:t} at every position (a masked position carries the weight before it; capped and clipped as the preset
    applies them): the fade of the row's own baseline term w_{1:t} (lambda_b Pi_t - m_{b,t}) in the presets with
    importance-weighted returns (`sequence`, `full`) off-policy; 1 while the prefix weight is within e^(+-4) of 1
    (on-policy: always). A function of y_<t: the baseline stays admissible, E_mu[w_{1:t} g_t u_t b | y_<t] =
    u_t w_{1:t-1} b E_pi[g_t | y_<t] = 0, so the expected gradient is unchanged (tests/core/test_batch_exactness.py,
    tests/core/test_full_vocab.py). Four elementwise passes over [B, T - 1] and one product, no exp or log (cost:
    bench/kl_term_cost.py).
    Why: the baseline is fitted to the other rows' returns relative to t, unweighted, while a row's gradient weighs it
    by w_{1:t}; far off-policy the variance is carried by the rare rows whose prefix weight has left 1 by orders of
    magnitude, and for them the fitted baseline (lambda Pi_t - m_t together: either alone is worse) added variance
    (`sequence`'s KL term at T = 4096, G = 4, drift 1.0 off-policy, bench/variance.py). Fading every row
    (exp(-r |log w_{1:t-1}|)) or from e^(+-2) on cost variance in other cells of the off-policy grid; from e^(+-4) on,
    T <= 1024 is unchanged within its standard errors (measured: docs/variance.md; the variants: docs/history.md)."""
    config = active_reduction_config()
    if config.baseline_fade:
        minus_baseline[..., 1:].mul_(weight_fade(weights[..., :-1], config.baseline_free_log_weight))
    return minus_baseline


def weight_fade(weight: Tensor, free_log_weight: float) -> Tensor:
    """u = min(1, e^c min(W, 1 / W)) = exp(-max(0, |log W| - c)) elementwise, c = free_log_weight: 1 while the
    weight W is within e^(+-c) of 1, then falling as W leaves it in either direction (W = inf or 0: u = 0). The one
    fade of both heuristics that weigh a row by how far its prefix weight w_{1:t-1} has left 1: the task weight of the
    joint fit (`off_policy_task_weight`, c = 0) and the fade of the row's own baseline term (`fade_baseline_`,
    c = `ReductionConfig.baseline_free_log_weight`). Four elementwise passes, no exp or log."""
    fade = torch.reciprocal(weight)
    return torch.minimum(fade, weight, out=fade).mul_(math.exp(free_log_weight)).clamp_(max=1.0)
