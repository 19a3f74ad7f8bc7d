"""Preset registry: each KL configuration as the per-token gradient weight it applies, with its metadata.

Every per-sample KL term a trainer can differentiate -- an estimator used as a loss, an estimator put (detached) in the
reward, importance-weighted or not -- has a per-sample gradient of the form

    g(y) = sum_t c_t(y) * grad log pi_theta(y_t | y_<t)

with a detached per-token weight c_t (autodiff of f(log pi_1..T) gives c_t = df/dlog pi_t). A preset is exactly that
weight. `kl_surrogate` turns it into a loss whose gradient is beta * mean_b g(y_b); the exact audit (`audit.py`) checks
E[g] against the exact gradients named in `target_on_policy` / `target_off_policy`
(tests/core/test_exactness.py::test_expected_gradient_matches_documented_target).

Notation: k1_t = log pi/pi_ref (current theta), k3_t = expm1(-k1_t) + k1_t, rho_t = pi(y_t)/mu(y_t) with mu the
behaviour policy that sampled the batch (rho = 1 on-policy), w_{1:t} = prod_{s<=t} rho_s. Rows refer to the
configuration table of the project's theory notes (Tang & Munos 2025; Shah et al. 2025).

`sequence` and `reward` are variance-reduced: control variates on the future terms (a xi_s, xi = pi_ref/pi - 1, and
the termination control variate h eta_s) and a baseline lambda Pi_t - m_t, with leave-one-out statistics from the other
rows of the batch fitted to the trainer's task + KL gradient (`reductions.py` states them and why they are exact).
`sequence-plain` and `reward-plain` are the same estimators without the reductions.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor

from .estimators import capped, reverse_cumsum
from .reductions import KLStatistics, TaskAdvantages, control_variate, fade_baseline_

#: Exact expected-gradient targets the audit can compute (see audit.TARGETS for their definitions).
TARGET_NAMES = ("kl_seq", "partial_reverse", "partial_forward", "zero", "kl_seq_minus_partial_forward")


@dataclass(frozen=True)
class Terms:
    """Detached per-token quantities of one [B, T] batch, in the working dtype, zero at padding."""

    k1: Tensor
    log_rho: Tensor
    mask: Tensor
    is_clip: float | None
    #: leave-one-out statistics of the batch; set for (and only read by) presets with uses_batch_statistics
    statistics: KLStatistics | None = None
    #: log_rho is zero (no old_logp): every importance weight is 1, which the weights below return without arithmetic
    on_policy: bool = False
    #: log pi of the sampled tokens (zero at padding): the statistics' token weights
    logp: Tensor | None = None
    #: termination increments eta_t (reductions.termination_increments), None without EndOfSequence
    eta: Tensor | None = None
    #: their counts nu_t (reductions.termination_counts, or the given statistics' eos_count), None with eta
    eos_count: Tensor | None = None
    #: the trainer's task advantages, [B, T] in the working dtype and zero at padding; None without a task term
    task: TaskAdvantages | None = None
    #: gamma of the future-KL return (1: the exact sequence-level KL gradient; < 1: the biased dial, `Preset.discountable`)
    discount: float = 1.0

    def with_changes(self, **changes) -> Terms:
        """dataclasses.replace, keeping the cached `cv`, `past` and `prefix_weights` whose inputs it does not change
        (kl_term adds the statistics to Terms whose cv the statistics have already read)."""
        new = replace(self, **changes)
        for name, inputs in _CACHED_INPUTS.items():
            if name in self.__dict__ and not inputs & changes.keys():
                new.__dict__[name] = self.__dict__[name]
        return new

    def to_go(self, x: Tensor) -> Tensor:
        """sum_{s>=t} gamma^(s-t) x_s (estimators.reverse_cumsum with this batch's discount)."""
        return reverse_cumsum(x, self.discount)

    def token_ratio(self) -> Tensor:
        """rho_t = pi/mu per token, capped at is_clip when set (1 on-policy)."""
        if self.on_policy:
            return self.mask
        log_rho = self.log_rho if self.is_clip is None else self.log_rho.clamp(max=_log(self.is_clip))
        return torch.exp(capped(log_rho)) * self.mask

    @cached_property
    def cv(self) -> Tensor:
        """r_t - 1 = pi_ref/pi - 1 at real tokens, 0 at padding (`reductions.control_variate`; k3_t = k1_t + cv_t);
        computed once per Terms."""
        return control_variate(self.k1, self.mask)

    @cached_property
    def past(self) -> Tensor:
        """Pi_t = sum_{s<t} k1_s, the prefix's KL, at real tokens; at padding the KL of the real tokens before it, not 0
        (`reductions.past_kl` is the masked one): read only by the presets' weights, which their callers mask."""
        return self.k1.cumsum(-1) - self.k1

    @cached_property
    def prefix_weights(self) -> Tensor:
        """w_{1:t} = prod_{s<=t} rho_s (per-decision importance weight), capped at is_clip when set (1 on-policy), zero
        at padding; computed once per Terms (the value and `sequence`'s weight both read it)."""
        if self.on_policy:
            return self.mask
        return self.running_weights * self.mask

    @cached_property
    def running_weights(self) -> Tensor:
        """w_{1:t} as `prefix_weights` (off-policy) at every position: log_rho is zero at padding, so a masked
        position carries the weight before it (what `reductions.fade_baseline_` reads as w_{1:t-1})."""
        log_w = self.log_rho.cumsum(-1)
        if self.is_clip is not None:
            log_w = log_w.clamp(max=_log(self.is_clip))
        return torch.exp(capped(log_w))


#: the Terms fields each cached property of Terms reads
_CACHED_INPUTS = {"cv": {"k1", "mask"}, "past": {"k1"}, "prefix_weights": {"log_rho", "mask", "is_clip", "on_policy"},
                  "running_weights": {"log_rho", "is_clip"}}


def _log(x: float) -> float:
    return float(torch.log(torch.tensor(x, dtype=torch.float64)))


@dataclass(frozen=True)
class Preset:
    """A KL configuration: the per-token gradient weight c_t it applies and what its expectation is."""

    name: str
    summary: str
    #: per-sample gradient, as the weight c_t in sum_t c_t grad log pi_t
    gradient: str
    #: which importance weights it applies when the batch is off-policy
    importance_weights: str
    #: exact expected gradient (a name in TARGET_NAMES) when sampling from pi; None = no closed form
    target_on_policy: str | None
    #: exact expected gradient when sampling from a behaviour policy mu != pi; None = no closed form (biased)
    target_off_policy: str | None
    unbiased_on_policy: bool
    unbiased_off_policy: bool
    legacy: bool
    theory_row: str
    #: the weight c [B, T] at real tokens; at padding it may hold anything finite (every caller multiplies by the mask)
    coefficients: Callable[[Terms], Tensor]
    #: the weight reads Terms.statistics (leave-one-out over the batch's other rows: a batch estimator)
    uses_batch_statistics: bool = False
    #: its return sum_{s>t} X_s is per-decision importance-weighted (`sequence`), so its baseline statistics are too;
    #: False (`reward`): the return is unweighted, so the statistics are computed from unweighted returns (the baseline
    #: then estimates the return it is subtracted from: less variance off-policy, bench/variance.py; docs/history.md)
    weighted_returns: bool = True
    #: needs both models' full next-token distributions, not sampled-token log-probs (`full`, full_vocab.py)
    needs_full_logits: bool = False
    #: has a future-KL return that a discount < 1 can shorten (the bias-variance dial; exact only at discount 1)
    discountable: bool = False

    @property
    def uses_importance_weights(self) -> bool:
        return self.importance_weights != "none"


def _weighted(t: Terms, x: Tensor) -> Tensor:
    """w_{1:t} x_t at real tokens (zero at padding off-policy; on-policy every w is 1: x itself, whatever it holds at
    padding)."""
    return x if t.on_policy else t.prefix_weights * x


def _sequence_plain(t: Terms) -> Tensor:
    # c_t = sum_{s>=t} w_{1:s} k1_s: pathwise reverse term w_{1:t} k1_t + detached per-decision future-KL return.
    return t.to_go(_weighted(t, t.k1))


def _reward_plain(t: Terms) -> Tensor:
    # c_t = rho_t * sum_{s>=t} k1_s: k1 reward-to-go in the advantage, PPO-style per-token ratio off-policy.
    return t.token_ratio() * t.to_go(t.k1)


def _reductions(t: Terms) -> tuple[Tensor, Tensor]:
    """The reductions' per-token pieces: the control variates' increments a xi_s + h eta_s (zero at padding) and the
    baseline's negative m_t - lambda Pi_t (reductions.py; not zero at padding, where the preset's weight is masked by
    its callers)."""
    if t.statistics is None:
        raise ValueError("this preset needs batch statistics (kl_term computes them); got Terms without statistics")
    st = t.statistics
    cv = st.cv_coef[:, None] * t.cv
    if t.eta is not None:
        cv = torch.addcmul(cv, st.eos_coef[:, None], t.eta)
    return cv, torch.addcmul(st.baseline, st.past_coef[:, None], t.past, value=-1)


def _sequence(t: Terms) -> Tensor:
    # c_t = sum_{s>=t} w_{1:s} k1_s + sum_{s>t} w_{1:s} (a xi_s + h eta_s) + w_{1:t} u_t (lambda Pi_t - m_t): the plain
    # weight with the control variates and the baseline (reductions.py), u_t = `fade_baseline_` (1 on-policy); same
    # expectation, on- and off-policy.
    # (On-policy the second term is not zero at padding: the weight's callers multiply it by the mask.)
    cv, minus_baseline = _reductions(t)
    if not t.on_policy:
        fade_baseline_(minus_baseline, t.running_weights)
    return t.to_go(_weighted(t, t.k1 + cv)) - _weighted(t, cv + minus_baseline)


def _reward(t: Terms) -> Tensor:
    # c_t = rho_t (sum_{s>=t} k1_s + sum_{s>t} (a xi_s + h eta_s) + lambda Pi_t - m_t): reward-plain with the same
    # reductions (exact on-policy).
    cv, minus_baseline = _reductions(t)
    return t.token_ratio() * (t.to_go(t.k1 + cv) - cv - minus_baseline)


def _reward_sum(t: Terms) -> Tensor:
    # c_t = rho_t * sum_s k1_s: k1 summed over the sequence and broadcast (outcome-level advantage).
    return t.token_ratio() * t.k1.sum(-1, keepdim=True)


def _token(t: Terms) -> Tensor:
    # c_t = rho_t k1_t: gradient of rho_t * k3_t (rho attached) == sg(rho_t) * k2_t.
    return t.token_ratio() * t.k1


def _k1_loss(t: Terms) -> Tensor:
    return t.mask.clone()


def _k2_loss(t: Terms) -> Tensor:
    return t.k1


def _k3_loss(t: Terms) -> Tensor:
    # d k3 / d log pi = 1 - pi_ref/pi = -expm1(-k1) = -xi
    return -t.cv


def _k3_reward(t: Terms) -> Tensor:
    return reverse_cumsum((t.k1 + t.cv) * t.mask)  # k3 = k1 + xi


_SEQUENCE = Preset(
    name="sequence",
    summary="Unbiased for the sequence-level reverse KL, on- and off-policy (per-decision importance weights), "
    "variance-reduced for the trainer's task + KL gradient with batch statistics (leave-one-out over the other "
    "sequences).",
    gradient="sum_t grad log pi_t * (sum_{s>=t} w_{1:s} k1_s + sum_{s>t} w_{1:s} (a xi_s + h eta_s) + w_{1:t} "
    "(lambda Pi_t - m_t)), xi = pi_ref/pi - 1, eta the termination control variate, Pi_t the prefix KL; a, h, lambda, "
    "m leave-one-out over the batch's other rows",
    importance_weights="per-decision prefix products w_{1:t} (exact; is_clip caps them, which adds bias)",
    target_on_policy="kl_seq",
    target_off_policy="kl_seq",
    unbiased_on_policy=True,
    unbiased_off_policy=True,
    legacy=False,
    theory_row="#10 on-policy, #20 off-policy, + control variate and baseline",
    coefficients=_sequence,
    uses_batch_statistics=True,
    discountable=True,
)
_REWARD = Preset(
    name="reward",
    summary="k1 (detached) reward-to-go with the control variates and baseline of `sequence`: unbiased on-policy; "
    "PPO-style ratio off-policy.",
    gradient="sum_t rho_t grad log pi_t * (sum_{s>=t} k1_s + sum_{s>t} (a xi_s + h eta_s) + lambda Pi_t - m_t)",
    importance_weights="per-token ratio rho_t (no prefix products: biased off-policy)",
    target_on_policy="kl_seq",
    target_off_policy=None,
    unbiased_on_policy=True,
    unbiased_off_policy=False,
    legacy=False,
    theory_row="#5 on-policy, #21 off-policy, + control variate and baseline",
    coefficients=_reward,
    uses_batch_statistics=True,
    weighted_returns=False,
    discountable=True,
)

_ALL = (
    _SEQUENCE,
    _REWARD,
    replace(
        _SEQUENCE,
        name="sequence-plain",
        summary="`sequence` without its variance reductions (for audits and comparisons): unbiased on- and off-policy.",
        gradient="sum_t grad log pi_t * sum_{s>=t} w_{1:s} k1_s  (reverse pathwise term + detached future-KL return)",
        theory_row="#10 on-policy, #20 off-policy",
        coefficients=_sequence_plain,
        uses_batch_statistics=False,
    ),
    replace(
        _REWARD,
        name="reward-plain",
        summary="`reward` without its variance reductions: k1 reward-to-go, unbiased on-policy; PPO-style ratio off-policy.",
        gradient="sum_t rho_t grad log pi_t * sum_{s>=t} k1_s",
        theory_row="#5 on-policy, #21 off-policy",
        coefficients=_reward_plain,
        uses_batch_statistics=False,
    ),
    Preset(
        name="reward-sum",
        summary="k1 summed over the sequence in an outcome-level reward (GRPO/RLOO style): unbiased on-policy, noisier.",
        gradient="sum_t rho_t grad log pi_t * sum_s k1_s",
        importance_weights="per-token ratio rho_t (biased off-policy)",
        target_on_policy="kl_seq",
        target_off_policy=None,
        unbiased_on_policy=True,
        unbiased_off_policy=False,
        legacy=False,
        theory_row="#4",
        coefficients=_reward_sum,
    ),
    Preset(
        name="token",
        summary="Per-token reverse-KL gradient (k2-equivalent, importance-weighted): partial, no future-KL term. "
        "What verl k3+, TRL use_bias_correction_kl and OpenRLHF unbiased_gradient compute.",
        gradient="sum_t rho_t k1_t grad log pi_t",
        importance_weights="per-token ratio rho_t",
        target_on_policy="partial_reverse",
        target_off_policy="partial_reverse",
        unbiased_on_policy=False,
        unbiased_off_policy=False,
        legacy=False,
        theory_row="#2 on-policy, #16 off-policy",
        coefficients=_token,
    ),
    Preset(
        name="k1-loss",
        summary="Legacy: k1 differentiated as a loss. Zero expected gradient on-policy: no regularization.",
        gradient="sum_t grad log pi_t",
        importance_weights="none",
        target_on_policy="zero",
        target_off_policy=None,
        unbiased_on_policy=False,
        unbiased_off_policy=False,
        legacy=True,
        theory_row="#1",
        coefficients=_k1_loss,
    ),
    Preset(
        name="k2-loss",
        summary="Legacy: k2 differentiated as a loss. Per-token reverse KL on-policy (partial), no importance weight.",
        gradient="sum_t k1_t grad log pi_t",
        importance_weights="none",
        target_on_policy="partial_reverse",
        target_off_policy=None,
        unbiased_on_policy=False,
        unbiased_off_policy=False,
        legacy=True,
        theory_row="#2",
        coefficients=_k2_loss,
    ),
    Preset(
        name="k3-loss",
        summary="Legacy: k3 differentiated as a loss (GRPO default). Follows the partial *forward* KL(pi_ref || pi).",
        gradient="sum_t (1 - pi_ref/pi)_t grad log pi_t",
        importance_weights="none",
        target_on_policy="partial_forward",
        target_off_policy=None,
        unbiased_on_policy=False,
        unbiased_off_policy=False,
        legacy=True,
        theory_row="#3, #15 off-policy",
        coefficients=_k3_loss,
    ),
    Preset(
        name="k3-reward",
        summary="Legacy: k3 (detached) in the reward with reward-to-go. grad KL_seq minus the partial forward-KL gradient.",
        gradient="sum_t grad log pi_t * sum_{s>=t} k3_s",
        importance_weights="none",
        target_on_policy="kl_seq_minus_partial_forward",
        target_off_policy=None,
        unbiased_on_policy=False,
        unbiased_off_policy=False,
        legacy=True,
        theory_row="#7",
        coefficients=_k3_reward,
    ),
)

#: why the sampled-token paths (kl_term, kl_surrogate, kl_coefficients, the audit) refuse `full`
FULL_REFUSAL = ("preset 'full' needs the full next-token distributions of both models (logits, or hidden states and the "
                "output projection), which sampled-token log-probs do not carry: use kl_adapters.full_vocab."
                "full_kl_surrogate / full_kl_surrogate_from_hidden, or an adapter that computes them (TRL GRPOTrainer)")


def _needs_full_logits(t: Terms) -> Tensor:
    raise ValueError(FULL_REFUSAL)


#: The Rao-Blackwellized preset (full_vocab.py states its gradient; tests/core/test_full_vocab.py pins it). In PRESETS,
#: not in SAMPLED_TOKEN_PRESETS: its weight is not a function of sampled-token log-probs.
FULL = Preset(
    name="full",
    summary="Exact per-position KL over the vocabulary (Rao-Blackwellized) plus its future-KL score term with the "
    "control variates and baseline of `sequence`: unbiased for the sequence-level reverse KL on- and off-policy; "
    "needs both models' full logits (TRL adapter; full_kl_surrogate).",
    gradient="sum_t w_{1:t-1} grad KL_t + sum_t grad log pi_t * (sum_{s>t} w_{1:s-1} KL_s + sum_{s>t} (a (w_{1:s} k1_s "
    "- w_{1:s-1} KL_s) + h w_{1:s} eta_s) + w_{1:t} (lambda Pi_t - m_t)), KL_t exact over the vocabulary",
    importance_weights="per-decision prefix products, one ratio fewer than `sequence` (w_{1:t-1} on KL_t; exact)",
    target_on_policy="kl_seq",
    target_off_policy="kl_seq",
    unbiased_on_policy=True,
    unbiased_off_policy=True,
    legacy=False,
    theory_row="#10 on-policy, #20 off-policy, Rao-Blackwellized over y_t (issue 16)",
    coefficients=_needs_full_logits,
    uses_batch_statistics=True,
    needs_full_logits=True,
    discountable=True,
)

#: every preset by name, `full` included: the one registry that the API, the commands, the adapters and the doctor read
PRESETS: dict[str, Preset] = {p.name: p for p in (*_ALL, FULL)}
#: the presets whose weight is a function of sampled-token log-probs: kl_surrogate / kl_term compute them and the exact
#: audit enumerates them (`full` needs both models' full next-token distributions: kl_adapters.full_vocab)
SAMPLED_TOKEN_PRESETS: dict[str, Preset] = {n: p for n, p in PRESETS.items() if not p.needs_full_logits}
#: presets a user should pick: unbiased for the sequence KL (on-policy at least)
RECOMMENDED = ("sequence", "reward")


def get_preset(name: str | Preset) -> Preset:
    """Look a preset up by name in PRESETS; an unknown name raises ValueError listing the valid ones."""
    if isinstance(name, Preset):
        return name
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(name, PRESETS, n=1) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown KL preset {name!r}{hint}; valid presets: {', '.join(PRESETS)}") from None
