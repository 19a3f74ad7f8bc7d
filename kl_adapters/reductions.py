"""Variance reductions that the `sequence` and `reward` presets compose, each with its unbiasedness argument.

Notation per sequence (presets.py): k1_t = log pi/pi_ref, r_t = pi_ref/pi = exp(-k1_t) at the sampled token,
rho_t = pi/mu, w_{1:t} = prod_{s<=t} rho_s (1 on-policy), g_t = grad log pi(y_t | y_<t). The plain estimator's
per-token weight is c_t = sum_{s>=t} w_{1:s} k1_s.

Two reductions, both exact in expectation (pinned by tests/core/test_batch_exactness.py, every ordered batch of
G = 1, 2, 3 sequences enumerated, on- and off-policy):

1. Future control variate (`control_variate`). For s > t replace k1_s by X_s = k1_s + a (r_s - 1). Given y_<s,
   g_t and w_{1:s-1} are fixed and E_mu[rho_s (r_s - 1) | y_<s] = E_pi[r_s - 1 | y_<s] = sum_v pi_ref(v) - 1 = 0, so
   E_mu[g_t w_{1:s} (r_s - 1)] = 0 for any coefficient a that does not depend on the sequence's own tokens
   (a = 1 turns k1_s into k3_s). At s = t the weight stays k1_t: E[g_t k3_t] is not the reverse-KL gradient.
2. Baseline (`leave_one_out_baseline`). Subtracting w_{1:t} b_t is exact for any b_t that does not depend on y_t
   given y_<t: E_mu[w_{1:t} g_t b_t | y_<t] = w_{1:t-1} b_t E_pi[g_t | y_<t] = 0.

Where a and b come from (`batch_statistics`): leave-one-out over the OTHER sequences of the batch (or of the same
group), which are independent of the sequence they are used for. Per row b:
    a_b = clamp(-sum_{b'!=b, t} k1 (r - 1) / sum_{b'!=b, t} (r - 1)^2, 0, 1)      (regression of k1 on r - 1)
    b_{b,t} = lambda_b * LOO-mean over the other rows alive at t of P_{b',t} + a_b Q_{b',t}   (0 if none is alive)
with P_t = k1_t + sum_{s>t} w_{t+1:s} k1_s and Q_t = sum_{s>t} w_{t+1:s} (r_s - 1), i.e. the other rows' return
from t given they reached t, computed with row b's OWN coefficient a_b (a_{b'} depends on row b's tokens, so using
it would make b's baseline depend on b); lambda_b in [0, 1] shrinks a noisy mean of few returns toward 0
(`leave_one_out_baseline`). A row with no other tokens to fit on (B = 1, or alone in its group) gets the
single-sample form (`causal_cv_coef`): b = 0 and, per future position s, the same regression fitted on the row's
OWN tokens before s (a function of y_<s, which the argument of 1. allows), SINGLE_SAMPLE_CV_COEF before any token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .estimators import reverse_cumsum

#: control-variate coefficient of a row with no other sequence, at positions with no earlier token of its own.
SINGLE_SAMPLE_CV_COEF = 0.0
#: prior weight, in tokens, of a = 0 (the plain k1 return) against the fitted coefficient: a = n / (n + this) * fit
CV_PRIOR_TOKENS = 4.0
#: smallest prefix weight, relative to the row's largest, that `conditional_returns` divides by (log scale)
LOG_RELATIVE_WEIGHT_FLOOR = -60.0


@dataclass(frozen=True)
class KLStatistics:
    """Per-row statistics of the reduced presets, each computed from the OTHER rows only (detached).

    cv_coef   [B]    a_b, the control-variate coefficient of the future terms of row b
    baseline  [B, T] b_{b,t}, the baseline subtracted (times w_{1:t}) from row b's return at position t
    alone     [B]    bool, rows with no other sample: their coefficient is fitted on their own earlier tokens
                     (`causal_cv_coef`) and cv_coef is unused; None = no such row
    Slice them along the batch dimension together with the batch they belong to (e.g. into micro-batches).
    """

    cv_coef: Tensor
    baseline: Tensor
    alone: Tensor | None = None

    def __getitem__(self, rows) -> KLStatistics:
        """The statistics of a subset of rows (a slice, index tensor or bool mask over the batch dimension)."""
        return KLStatistics(cv_coef=self.cv_coef[rows], baseline=self.baseline[rows],
                            alone=None if self.alone is None else self.alone[rows])

    def coefficient(self, k1: Tensor, cv: Tensor, mask: Tensor) -> Tensor:
        """[B, T] control-variate coefficient a_{b,s} of each future term: a_b, or the causal fit for alone rows."""
        coef = self.cv_coef[:, None].expand_as(k1)
        if self.alone is None or not bool(self.alone.any()):  # one host sync: skips the causal fit in the usual case
            return coef
        return torch.where(self.alone[:, None], causal_cv_coef(k1, cv, mask), coef)


def control_variate(k1: Tensor, mask: Tensor) -> Tensor:
    """r_t - 1 = pi_ref/pi - 1 = expm1(-k1_t) at real tokens, 0 at padding: zero mean under pi given the prefix."""
    return torch.expm1(-k1) * mask


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


def _others_sum(x: Tensor, same: Tensor | None) -> Tensor:
    """Sum over the other rows of the same group (dim 0): group sum minus the row's own value.
    One group: column sums; several: sums per dense group id (memory O(x), no [B, B] matrix)."""
    totals = x.sum(0, keepdim=True) if same is None else torch.zeros_like(x).index_add_(0, same, x)[same]
    return totals - x


def _regression(num: Tensor, den: Tensor, tokens: Tensor) -> Tensor:
    """clamp(num / den, 0, 1) for num = -sum k1 (r - 1), den = sum (r - 1)^2; SINGLE_SAMPLE_CV_COEF where den = 0.

    -k1 (r - 1) >= 0 always (k1 and r - 1 have opposite signs), so the ratio is >= 0; it tends to 1 as k1 -> 0
    (r - 1 = -k1 + O(k1^2)). An overflowed r (inf / inf) gives a = 0, the plain k1 return.
    """
    ratio = torch.nan_to_num(num / den, nan=0.0).clamp(0.0, 1.0) * tokens / (tokens + CV_PRIOR_TOKENS)
    return torch.where(den > 0, ratio, torch.full_like(ratio, SINGLE_SAMPLE_CV_COEF))


def causal_cv_coef(k1: Tensor, cv: Tensor, mask: Tensor) -> Tensor:
    """[B, T] a_{b,s} = clamp(-sum_{u<s} k1_u (r_u - 1) / sum_{u<s} (r_u - 1)^2, 0, 1) over the row's own earlier
    tokens: a function of y_<s, so E[g_t w_{1:s} a_{b,s} (r_s - 1)] = 0 for t < s still holds (module docstring, 1.)."""
    prod, square = k1 * cv, cv.square()  # zero at padding
    return _regression(prod - prod.cumsum(-1), square.cumsum(-1) - square, mask.cumsum(-1) - mask)


def other_moments(k1: Tensor, cv: Tensor, mask: Tensor, same: Tensor | None) -> Tensor:
    """[B, 3, 3] sums over the real tokens of the OTHER rows of each row's group of x_i x_j, x = (k1, r - 1, 1)
    (k1 and cv are 0 at padding): [:, 0, 1] = sum k1 (r - 1), [:, 1, 1] = sum (r - 1)^2, [:, 0, 2] = sum k1,
    [:, 0, 0] = sum k1^2, [:, 1, 2] = sum (r - 1), [:, 2, 2] = number of tokens."""
    x = torch.stack((k1, cv, mask), 1)
    return _others_sum((x[:, :, None] * x[:, None, :]).sum(-1), same)


def conditional_returns(k1: Tensor, cv: Tensor, mask: Tensor, log_rho: Tensor | None) -> tuple[Tensor, Tensor]:
    """P_t = k1_t + sum_{s>t} w_{t+1:s} k1_s and Q_t = sum_{s>t} w_{t+1:s} (r_s - 1), zero at padding: a row's return
    from t given it reached t. w_{t+1:s} = w_{1:s} / w_{1:t} is computed relative to the row's largest prefix weight,
    held at exp(LOG_RELATIVE_WEIGHT_FLOOR) where it is smaller (so neither underflows to 0 / 0 nor overflows in
    float32: only other rows' baselines read P and Q, and any function of the other rows is an exact baseline, so the
    floor changes variance only, for rows whose weights have degenerated). log_rho None: on-policy (every w = 1)."""
    both = torch.stack((k1, cv), 1)
    if log_rho is None:
        both = reverse_cumsum(both)
    else:
        log_w = log_rho.cumsum(-1)
        rel = torch.exp((log_w - log_w.max(-1, keepdim=True).values).clamp(min=LOG_RELATIVE_WEIGHT_FLOOR))[:, None]
        both = reverse_cumsum(rel * both) / rel
    both = both * mask[:, None]
    return both[:, 0], both[:, 1] - cv


def leave_one_out_baseline(p: Tensor, q: Tensor, cv: Tensor, mask: Tensor, moments: Tensor, cv_coef: Tensor,
                           same: Tensor | None) -> Tensor:
    """b_{b,t} = lambda_b * m_{b,t}: the leave-one-out mean m_{b,t} of P_{b',t} + a_b Q_{b',t}
    over the other rows of b's group alive at t (0 where none is), shrunk toward 0 by a positive-part James-Stein
    factor pooled over positions,

        lambda_b = max(0, 1 - sum_t V_{b,t} / n_{b,t} / sum_t m_{b,t}^2)    (sums over t with n_{b,t} > 0)

    n_{b,t} = number of other rows alive at t, V_{b,t} = var(k1) + L_{b,t} var(k1 + a_b (r - 1)) the variance of one
    return from t (per-token variances pooled over the other rows' tokens from `moments` = `other_moments`,
    L = their mean number of tokens after t). A mean of few returns is noisy: subtracting it adds V / n to the variance
    and removes m^2, so lambda keeps it where it pays. Exact as a baseline: every quantity is a function of the other
    rows and a_b only. Every [B, T] sum over the other rows is taken in one pass (stacked).
    """
    after = (mask.sum(-1, keepdim=True) - mask.cumsum(-1)) * mask  # each row's number of tokens after t
    others = _others_sum(torch.stack((mask, p, q, after), 1), same)
    count, per_count = others[:, 0], others[:, 0].clamp(min=1)
    inv = per_count.reciprocal()
    # the other rows' P and Q are zero at their padding, so the mean is 0 where no other row is alive
    mean = (others[:, 1] + cv_coef[:, None] * others[:, 2]) * inv
    # sum_t alive / n and sum_t L / n, with L = (sum of the others' tokens after t) / n
    noise_sums = (torch.stack((count, others[:, 3]), 1) * inv.square()[:, None]).sum(-1)
    tokens = moments[:, 2, 2].clamp(min=1)
    k1, k1k1, cvs, k1cv, cvcv = (moments[:, i, j] / tokens for i, j in ((0, 2), (0, 0), (1, 2), (0, 1), (1, 1)))
    a = cv_coef
    var_k1 = k1k1 - k1.square()
    var_x = k1k1 + 2 * a * k1cv + a.square() * cvcv - (k1 + a * cvs).square()
    noise = var_k1 * noise_sums[:, 0] + var_x * noise_sums[:, 1]
    signal = mean.square().sum(-1)
    shrink = torch.where(signal > 0, 1 - noise / signal.clamp(min=torch.finfo(mean.dtype).tiny), 0.0)
    return shrink.clamp(min=0.0)[:, None] * mean


def batch_statistics(k1: Tensor, cv: Tensor, log_rho: Tensor | None, mask: Tensor, group: Tensor | None
                     ) -> KLStatistics:
    """Leave-one-out a_b and b_{b,t} of every row from detached [B, T] terms (zero at padding, float mask;
    cv = `control_variate(k1, mask)`); log_rho None = on-policy (every importance weight 1)."""
    same = same_group(group)
    moments = other_moments(k1, cv, mask, same)
    cv_coef = _regression(-moments[:, 0, 1], moments[:, 1, 1], moments[:, 2, 2])
    p, q = conditional_returns(k1, cv, mask, log_rho)
    baseline = leave_one_out_baseline(p, q, cv, mask, moments, cv_coef, same)
    return KLStatistics(cv_coef=cv_coef, baseline=baseline, alone=moments[:, 2, 2] == 0)
