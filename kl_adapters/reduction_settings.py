"""The settings of the reduced presets' fit (reductions.py): `ReductionConfig`, its priors and a switch for each of its
parts, each default written once, here; `reduction_config` sets one for a block and `active_reduction_config` is what
the fit reads.

Every setting keeps the expected gradient exact (each acts on functions of the other rows, or, for the fade, on the
row's own prefix) except a `variance_floor` at rounding level; they change the variance only
(tests/core/test_reduction_config.py: every setting wired and exact, the two floors as the conditions they are).
Every switch is on by default. What each one does to the variance of the trained gradient (task + KL, at the batch
size training uses), on the problems where its part acts: its benefit pin, named in its help, and the ablation of
every switch in docs/variance.md (`bench/reduction_components.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


def _setting(default: float | bool, help: str) -> float | bool:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ReductionConfig:
    """The fit's priors and a switch for each of its parts (False: the part is off); the defaults are the presets'
    behaviour. Each field's `metadata["help"]` says what it sets, and for a switch the test that pins its benefit."""

    tail_z: float = _setting(2.0, "standard errors by which the other rows' sum of xi must fall below 0 to count as "
                             "an unseen upper tail (`reductions.unseen_tail`)")
    cv_prior_tokens: float = _setting(4.0, "prior weight, in tokens, of a~ = 0 (the plain k1 return) against the "
                                      "token-level regression of k1 on xi (`reductions.token_coefficients`); it shows "
                                      "only where the joint fit's control-variate coefficient is clamped")
    joint_prior_tokens: float = _setting(4.0, "the joint fit's ridge relative to each feature's variance, in tokens "
                                         "(`reductions._joint_fit`)")
    fit_prior_dof: float = _setting(8.0, "prior weight, in degrees of freedom (the other rows' tokens beyond the "
                                    "per-position means), of the plain form against a row's fitted statistics "
                                    "(`reductions.fit_shrinkage`; 0: no shrinkage where dof > 0)")
    variance_floor: float = _setting(1e-6, "a feature of the joint fit whose centred variance is below this fraction "
                                     "of its raw second moment is left out (`reductions._joint_fit`). Condition of "
                                     "exactness: above the relative rounding of the leave-one-out variance (a group "
                                     "total minus the row's own terms), below the relative variance of a feature "
                                     "worth fitting")
    log_relative_weight_floor: float = _setting(-60.0, "smallest prefix weight, relative to the row's largest, that "
                                                "`reductions.relative_returns` divides by (log scale). Condition of "
                                                "correct returns, not of exactness: exact where the prefix weights "
                                                "lie within e^floor of the row's largest, finite while e^-floor "
                                                "times the returns stays inside float32's range (-88.7 < floor)")
    baseline_free_log_weight: float = _setting(4.0, "|log w_{1:t-1}| up to which a row's own baseline term is kept "
                                               "whole off-policy (`reductions.fade_baseline_`)")
    fit: bool = _setting(True, "every fitted statistic (False: all zero, the plain form exactly; eos_count is kept). "
                         "Pinned: tests/core/test_reduction_benefit.py, test_reduction_benefit_bigram.py, "
                         "tests/trl/test_reduction_benefit_long_horizon.py")
    control_variate: bool = _setting(True, "the coefficient a of the xi control variate (False: zero after the fit, "
                                     "the others as fitted). Pinned: tests/core/test_reduction_switches.py")
    termination: bool = _setting(True, "the coefficient h of the termination control variate (False: zero after "
                                 "the fit). Pinned: tests/core/test_reduction_switches.py (the KL term alone, a group "
                                 "whose rewards tie: 1.1-6.2x lower variance at T = 256-1024); it costs 1-8.5% "
                                 "where a bigram token is rewarded and up to 2.6% on the GPT-2 through TRL "
                                 "(docs/variance.md)")
    past_kl: bool = _setting(True, "the coefficient lambda of the prefix-KL baseline (False: zero after the fit). "
                             "Pinned: tests/core/test_reduction_switches.py")
    baseline: bool = _setting(True, "the per-position baseline m (False: zero after the fit). "
                              "Pinned: tests/core/test_reduction_switches.py")
    task: bool = _setting(True, "fit to the trainer's task + KL gradient (False: to the KL term alone, the task "
                          "ignored). Pinned: tests/core/test_reduction_switches.py")
    unseen_tail: bool = _setting(True, "count xi's unseen upper tail (`reductions.unseen_tail`) in a~ and in the "
                                 "joint fit. Pinned: tests/trl/test_reduction_benefit_long_horizon.py")
    james_stein: bool = _setting(True, "shrink the per-position means m (`reductions._james_stein`; False: the "
                                 "means themselves). Pinned: tests/core/test_reduction_switches.py (a rewarded token); "
                                 "it costs 1-14% where a bigram token is penalized, and lowers the variance on balance "
                                 "over the tabular, bigram and GPT-2 problems (docs/variance.md)")
    off_policy_task_weight: bool = _setting(True, "weigh the advantages by `reductions.off_policy_task_weight` "
                                            "off-policy (False: weight 1). Pinned: "
                                            "tests/core/test_reduction_switches.py")
    baseline_fade: bool = _setting(True, "`reductions.fade_baseline_` off-policy (False: the baseline term whole). "
                                   "Pinned: tests/core/test_reduction_switches.py")


_ACTIVE: ContextVar[ReductionConfig] = ContextVar("kl_adapters_reduction_config", default=ReductionConfig())


def active_reduction_config() -> ReductionConfig:
    """The `ReductionConfig` in effect (the defaults outside any `reduction_config` block)."""
    return _ACTIVE.get()


@contextmanager
def reduction_config(config: ReductionConfig) -> Iterator[ReductionConfig]:
    """Within the block (this thread / task), the fit uses `config`."""
    if not isinstance(config, ReductionConfig):
        raise TypeError(f"reduction_config takes a ReductionConfig, got {type(config).__name__}")
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)
