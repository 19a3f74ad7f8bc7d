"""KL budget: the user states how far the policy may move, KL(pi || pi_ref) per sequence in nats, and beta follows.

Problem. max_pi E_pi[R] subject to KL_seq(pi) <= target, KL_seq = KL(pi(.|x) || pi_ref(.|x)) over whole sequences.
Its Lagrangian L(pi, beta) = E_pi[R] - beta (KL_seq(pi) - target), beta >= 0, is what a trainer with an exact-gradient
preset already ascends in pi at a given beta (its objective E[R] - beta KL_seq); the budget takes the dual step in beta,
once per optimizer step (or per rollout: each adapter says which), from an unbiased estimate KL_k of KL_seq on the
step's batch. A fixed point has KL_seq = target (or beta -> 0 when the constraint is slack: the unregularised optimum
already spends less than the budget).

Update rules (`RULES`), all in u = log beta (beta stays > 0 without projection) and on the relative error
e_k = KL_k / target - 1 (scale-free: the same gains work for any units of beta -- TRL's per-token beta, verl's
kl_loss_coef, OpenRLHF's init_coef -- and any target):
    "pi" (default)  u <- u + k_i e_k + k_p (e_k - e_{k-1})      dual ascent (k_i) plus a proportional term (k_p), i.e. a
                    PI controller on the multiplier, as in Stooke, Achiam & Abbeel 2020 ("Responsive Safety in RL by
                    PID Lagrangian Methods"); defaults k_i = 0.02, k_p = 0.5 (the first step has no e_{k-1}: e_0 is
                    used, so the proportional term starts at 0). The proportional term relies on the policy following
                    beta over several steps, as a gradient step moves it by one learning-rate step: for a policy
                    whose log KL answered a change of log beta within one step with slope -s, the loop would need
                    k_p s < 1 (the demo problem has s ~ 3.8, and a lag of tens of steps).
    "dual"          u <- u + k_i e_k                             dual ascent on log beta alone (mirror descent).
    "ziegler"       beta <- beta (1 + k clip(e_k, -0.2, 0.2))    Ziegler et al. 2019 (what verl's and OpenRLHF's
                    AdaptiveKLController compute with k = n_steps / horizon, on the sequence KL here); k = 0.1.
Why "pi": the policy follows a change of beta with a lag of tens of steps, and KL_seq(pi*(beta)) can be very steep in
beta (on the demo problem d log KL / d log beta ~ -3.8 at beta* = 0.2). An integral-only rule ("dual", and "ziegler",
which is one with its step clipped) keeps moving beta until the lagging KL crosses the target, so it overshoots;
overshooting beta upwards also inflates Adam's second-moment estimates with large KL gradients, which then slows the
policy for hundreds of steps. The proportional term reacts to the KL's movement itself and damps that. Measured on the
demo problem (bench/kl_budget.py, docs/kl_budget.md).

The estimate KL_k is the step's mean of `KLTerm.sequence_kl` = sum_t w_{1:t} k3_t over its sequences (all data-parallel
ranks and micro-batches): unbiased for KL_seq on- and off-policy without is_clip (pinned by
tests/core/test_exactness.py::test_value_is_unbiased_for_sequence_kl), and k3 = k1 + (pi_ref/pi - 1) subtracts from
k1 a term of mean zero under pi, the usual lower-variance form. Adapters feed it as (sum, count) pairs through
`observe` from numbers they already bring to the host for their metrics, so the budget adds no host synchronisation
per micro-batch; `update` runs once per step.

Pinned by tests/core/test_budget.py. Pure Python (no torch): the activation path validates targets without importing
torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .presets import Preset

#: update rule -> its default gains (see the module docstring)
RULES: dict[str, dict[str, float]] = {"pi": {"k_i": 0.02, "k_p": 0.5}, "dual": {"k_i": 0.02}, "ziegler": {"k": 0.1}}
DEFAULT_RULE = "pi"
#: Ziegler et al.'s clip of the relative error
ZIEGLER_CLIP = 0.2
#: version of the `state_dict` layout
STATE_VERSION = 1


def check_target(target: object, name: str = "kl_target") -> float:
    """A KL budget must be a finite number > 0 (nats per sequence); returns it as a float."""
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not math.isfinite(target) or target <= 0:
        raise ValueError(f"{name} must be a finite number > 0 (the KL(pi || pi_ref) budget per sequence, in nats), "
                         f"got {target!r}")
    return float(target)


def check_budget_preset(preset: str | Preset, is_clip: float | None, *, off_policy: bool = False,
                        name: str = "kl_target") -> None:
    """A budget needs a preset whose gradient is that of the sequence KL it budgets (unbiased for grad KL_seq; off-policy
    too when the trainer's batches are off-policy) and an unbiased KL estimate (no is_clip). ValueError otherwise.
    preset: the resolved `Preset` (`Settings.spec`, what activation and the adapters pass), or its name."""
    from .presets import RECOMMENDED, get_preset

    spec = get_preset(preset)
    if not spec.unbiased_on_policy:
        raise ValueError(f"{name} budgets the sequence KL, but preset {spec.name!r} does not follow its gradient: beta "
                         f"would weigh another objective. Use one of {', '.join(RECOMMENDED)}")
    if off_policy and not spec.unbiased_off_policy:
        raise ValueError(f"{name} budgets the sequence KL, but preset {spec.name!r} does not follow its gradient "
                         "off-policy, as this trainer's batches are: use 'sequence' (unbiased on- and off-policy)")
    if is_clip is not None:
        raise ValueError(f"{name} with is_clip={is_clip}: capped importance weights make the KL estimate the budget "
                         "tracks biased; drop is_clip")


@dataclass
class KLBudget:
    """The controller: target (nats per sequence), beta (current coefficient, initially the user's), rule and gains.

    observe(total, count) any number of times per step, then update() once: beta_{k+1} from beta_k and the step's
    mean estimate KL_k = sum of totals / sum of counts. A step with count 0 leaves beta unchanged.
    state_dict() / load_state_dict() carry the state through a trainer checkpoint (JSON-serialisable).
    """

    target: float
    beta: float
    rule: str = DEFAULT_RULE
    gains: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # updates applied
    kl: float | None = None  # the last step's estimate KL_k
    error: float | None = None  # its relative error e_k (the "pi" rule's e_{k-1} at the next update)
    _total: float = field(default=0.0, repr=False)
    _count: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self.target = check_target(self.target)
        if isinstance(self.beta, bool) or not isinstance(self.beta, numbers.Real) or not (
                math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"a KL budget starts from the configured beta, which must be a finite number > 0 (the "
                             f"controller works on log beta), got {self.beta!r}")
        self.beta = float(self.beta)
        if self.rule not in RULES:
            raise ValueError(f"unknown KL budget rule {self.rule!r}; valid: {', '.join(RULES)}")
        unknown = set(self.gains) - set(RULES[self.rule])
        if unknown:
            raise ValueError(f"rule {self.rule!r} has no gain(s) {sorted(unknown)}; its gains: {sorted(RULES[self.rule])}")
        self.gains = {**RULES[self.rule], **self.gains}
        for key, value in self.gains.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"KL budget gain {key} must be a finite number >= 0, got {value!r}")

    def observe(self, total: float, count: float) -> None:
        """Add `count` sequences whose KL estimates (KLTerm.sequence_kl) sum to `total` to this step's estimate."""
        if not (math.isfinite(total) and math.isfinite(count) and count >= 0):
            raise ValueError(f"KL budget: non-finite or negative KL estimate observed (sum {total}, count {count})")
        self._total += float(total)
        self._count += float(count)

    def update(self) -> float:
        """Apply the step: beta from the observed estimate (unchanged without observations); returns the new beta."""
        total, count, self._total, self._count = self._total, self._count, 0.0, 0.0
        if count <= 0:
            return self.beta
        self.kl = total / count
        error = self.kl / self.target - 1.0
        g = self.gains
        if self.rule == "ziegler":
            self.beta *= 1.0 + g["k"] * min(max(error, -ZIEGLER_CLIP), ZIEGLER_CLIP)
        else:
            step = g["k_i"] * error
            if self.rule == "pi":
                step += g["k_p"] * (error - (error if self.error is None else self.error))
            self.beta *= math.exp(step)
        self.error, self.steps = error, self.steps + 1
        return self.beta

    def state_dict(self) -> dict:
        """The controller state to store with a checkpoint (pending observations of an unfinished step excluded)."""
        return {"version": STATE_VERSION, "target": self.target, "beta": self.beta, "rule": self.rule,
                "gains": dict(self.gains), "steps": self.steps, "kl": self.kl, "error": self.error}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: beta, step count and the last estimate; the target, rule and gains stay the
        configured ones (a resumed run may change its budget; the rule's memory e_{k-1} is kept only for the same rule)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"KL budget state of version {state.get('version')!r}; this kl-adapters reads version "
                             f"{STATE_VERSION}")
        beta = float(state["beta"])
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"KL budget state holds beta={beta!r}: not a finite number > 0")
        self.beta, self.steps, self.kl = beta, int(state["steps"]), state.get("kl")
        self.error = state.get("error") if state.get("rule") == self.rule else None
        self._total = self._count = 0.0

    def metrics(self) -> dict[str, float]:
        """`kl_adapters/beta` and `kl_adapters/kl_target`, the values a trainer logs beside its own."""
        return {BETA_METRIC: self.beta, TARGET_METRIC: self.target}


#: metric names the adapters log beside the framework's own (the sequence-KL estimate is kl_adapters/seq_kl)
BETA_METRIC, TARGET_METRIC = "kl_adapters/beta", "kl_adapters/kl_target"
