"""Which kl-adapters preset each framework's own KL setting equals: the one table the adapters and the doctor share.

A framework's KL term has, per sampled sequence, a gradient sum_t c_t grad log pi_t with a per-token weight c_t; the
preset named here has the same c_t (for a loss) or the same expected gradient (for a detached reward: past tokens'
rewards add zero-mean terms, so a sequence sum broadcast to every token and a reward-to-go have the same expectation).
`None` means no preset has that gradient. Each mapping gives its reason and the framework source it was read from
(paths relative to the installed package; trl 1.16.0, verl 0.9.1, OpenRLHF 0.11.2).

Used by the adapters' ``kl_adapters/grad_weight_gap`` metric (their native weight) and by ``kl-adapters doctor``;
tests/core/test_doctor.py::test_native_presets_exist and tests/<framework>/test_doctor.py pin that both agree.
Imports nothing (read by torch-free code).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NativeKL:
    """A framework's KL setting as the preset with its gradient (None: no preset has it), why, and where."""

    preset: str | None
    reason: str
    source: str


#: verl 0.9.1 kl_penalty_forward (trainer/ppo/core_algos.py:2239-2245): k3 = exp(x) - x - 1 with x = ref - logp
#: clamped to [-20, 20], then the value clamped to [-10, 10] (zero gradient wherever a clamp is active)
VERL_K3_LOG_RATIO_CLAMP = 20.0
VERL_K3_VALUE_CLAMP = 10.0
#: OpenRLHF 0.11.2 compute_approx_kl (models/utils.py:108-113): every estimator's value clamped to [-10, 10], k3's log
#: ratio clamped at -10 first; unbiased_gradient's importance weight capped at KL_IS_WEIGHT_CLIP = 10 (:66, :124)
OPENRLHF_VALUE_CLAMP = 10.0
OPENRLHF_IS_WEIGHT_CLIP = 10.0

_K3_LOSS = "the gradient of k3 = r - 1 - log r (r = pi_ref/pi) is (1 - r_t) grad log pi_t: k3-loss's weight"


def trl_grpo_loss(use_bias_correction_kl: bool, importance_sampling_level: str = "token") -> NativeKL:
    """TRL 1.16 GRPOTrainer's KL loss: beta * k3_t, times the differentiable ratio coef_1 when use_bias_correction_kl.

    coef_1 = pi/pi_old per token ("token" level; 1 with gradient on-policy), so grad(coef_1 k3) = rho_t k1_t grad log
    pi_t: the `token` preset. At importance_sampling_level="sequence" coef_1 is the sequence ratio exp(mean_t log
    rho_t) broadcast to every token, whose gradient adds (sum_t k3_t) * mean_s grad log pi_s: no preset has that.
    """
    source = "trl/trainer/grpo_trainer.py:3083-3105"
    if not use_bias_correction_kl:
        return NativeKL("k3-loss", f"use_bias_correction_kl=False: k3 per token in the loss; {_K3_LOSS}", source)
    if importance_sampling_level == "sequence":
        return NativeKL(None, "use_bias_correction_kl=True at importance_sampling_level='sequence': k3_t times the "
                              "sequence-level ratio (with gradient), whose gradient adds sum_t k3_t times the mean "
                              "score of the sequence to the `token` weight", source)
    return NativeKL("token", "use_bias_correction_kl=True: k3_t * pi/pi_old (ratio with gradient) per token; its "
                             "gradient is rho_t k1_t grad log pi_t, the `token` weight", source)


def trl_rloo_reward() -> NativeKL:
    """TRL 1.16 RLOOTrainer: rewards - beta * sum_t (old_logp - ref_logp)_t, before the leave-one-out baseline."""
    return NativeKL("reward-sum", "k1 = old_logp - ref_logp summed over the completion, subtracted from the sequence "
                                  "reward before the leave-one-out baseline (exact on-policy)",
                    "trl/trainer/rloo_trainer.py:1669-1673")


_VERL_LOSS = {
    "kl": ("k1-loss", "k1 = logp - ref_logp differentiated: weight 1 per token (zero expected gradient)"),
    "k1": ("k1-loss", "k1 = logp - ref_logp differentiated: weight 1 per token (zero expected gradient)"),
    "mse": ("k2-loss", "k2 = (logp - ref_logp)^2 / 2 differentiated: weight k1_t"),
    "k2": ("k2-loss", "k2 = (logp - ref_logp)^2 / 2 differentiated: weight k1_t"),
    "low_var_kl": ("k3-loss", _K3_LOSS + " (where verl's clamps are inactive)"),
    "k3": ("k3-loss", _K3_LOSS + " (where verl's clamps are inactive)"),
    "abs": (None, "|logp - ref_logp| differentiated: weight sign(k1_t), which no preset has"),
}
_VERL_SOURCE = "verl/trainer/ppo/core_algos.py:2188-2251"


def verl_loss(kl_loss_type: str) -> NativeKL:
    """verl 0.9.1 actor KL loss (workers/utils/losses.py:131-142): kl_penalty(log_prob, ref_log_prob, kl_loss_type).

    A trailing "+" (e.g. "k3+", "low_var_kl+") returns k2 - sg(k2) + sg(value): k2's gradient, k1_t grad log pi_t,
    with no importance weight, i.e. `k2-loss` (equal to `token` on-policy, where rho = 1). "full" raises
    NotImplementedError in verl; unknown names raise at first use.
    """
    name = kl_loss_type
    if name.endswith("+") and name[:-1] in _VERL_LOSS:
        return NativeKL("k2-loss", f"{name!r}: straight-through k2 gradient (core_algos.py:2201-2213), weight k1_t, "
                                   "no importance weight", _VERL_SOURCE)
    if name in _VERL_LOSS:
        preset, reason = _VERL_LOSS[name]
        return NativeKL(preset, f"{name!r}: {reason}", _VERL_SOURCE)
    return NativeKL(None, f"{name!r} is not an estimator verl 0.9.1 computes ('full' and unknown names raise "
                          "NotImplementedError at the first loss call)", _VERL_SOURCE)


def detached_reward(estimator: str, *, to_go: bool, source: str) -> NativeKL:
    """A detached per-token KL reward -beta * k_t handed to returns (to_go) or summed into the sequence reward.

    Only k1 has E[score * k] equal to the KL's score term: k1 gives `reward-plain` (reward-to-go) or `reward-sum`; k3
    in the reward has `k3-reward`'s expectation either way (past-token rewards add zero-mean terms); k2 / abs have
    no preset.
    """
    if estimator in ("kl", "k1"):
        if to_go:
            return NativeKL("reward-plain", "k1 (detached) per-token reward with undiscounted returns: the KL "
                                            "reward-to-go", source)
        return NativeKL("reward-sum", "k1 (detached) summed into the sequence reward and broadcast to every token",
                        source)
    if estimator in ("low_var_kl", "k3"):
        return NativeKL("k3-reward", "k3 (detached) in the reward: same expected gradient as its reward-to-go, "
                                     "grad KL_seq minus the partial forward-KL gradient", source)
    return NativeKL(None, f"estimator {estimator!r} in the reward: E[score * k] is not the gradient of a KL for "
                          "this estimator, and no preset has it", source)


def verl_reward(kl_penalty: str, *, to_go: bool) -> NativeKL:
    """verl 0.9.1 KL in the reward (trainer/ppo/ray_trainer.py:78-117, apply_kl_penalty): token_level_rewards =
    scores - beta * kl_penalty(old_log_probs, ref_log_prob) (detached, so a trailing "+" changes nothing); outcome
    estimators (grpo, rloo, ...) sum it over the sequence, reinforce_plus_plus / gae keep per-token returns (to_go)."""
    name = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    return detached_reward(name, to_go=to_go, source="verl/trainer/ppo/ray_trainer.py:78-117")


_OPENRLHF_SOURCE = "openrlhf/models/utils.py:64-128"


def openrlhf_loss(estimator: str, unbiased_gradient: bool = False) -> NativeKL:
    """OpenRLHF 0.11.2 KL loss (--algo.kl.use_loss; trainer/ray/ppo_actor.py:318-338): compute_approx_kl(log_probs,
    base, old, --algo.kl.estimator, --algo.kl.unbiased_gradient), differentiated. unbiased_gradient's backward is
    min(pi/pi_old, 10) k1_t grad log pi_t for every estimator: `token` with is_clip=10 (`token` itself when the cap
    is not hit, always on-policy)."""
    if unbiased_gradient:
        return NativeKL("token", "--algo.kl.unbiased_gradient: straight-through w * k1 gradient, w = pi/pi_old "
                                 f"capped at {OPENRLHF_IS_WEIGHT_CLIP:g} (detached), for any estimator",
                        _OPENRLHF_SOURCE)
    presets = {"k1": ("k1-loss", "weight 1 per token"), "k2": ("k2-loss", "weight k1_t"),
               "k3": ("k3-loss", _K3_LOSS)}
    if estimator not in presets:
        return NativeKL(None, f"--algo.kl.estimator {estimator!r} is not one of OpenRLHF's k1/k2/k3", _OPENRLHF_SOURCE)
    preset, reason = presets[estimator]
    return NativeKL(preset, f"--algo.kl.estimator {estimator} differentiated as a loss: {reason}", _OPENRLHF_SOURCE)


def openrlhf_reward(estimator: str) -> NativeKL:
    """OpenRLHF 0.11.2 KL in the reward (default; trainer/ppo_utils/experience_maker.py:205-214, compute_reward
    models/utils.py:131-159): per-token reward -init_coef * k_t, then returns (reward-to-go) or GAE."""
    return detached_reward(estimator, to_go=True, source="openrlhf/trainer/ppo_utils/experience_maker.py:205-290")


#: the native configurations `kl-adapters measure --config` takes by name (besides every preset's own name), each with
#: the setting it stands for; `<framework>:<setting>` forms take any value the framework's function above accepts
NAMED = {
    "trl-default": "TRL 1.16 GRPO at beta > 0: k3 * pi/pi_old per token (use_bias_correction_kl=True)",
    "trl-k3-loss": "TRL GRPO with use_bias_correction_kl=False (legacy GRPO's k3 loss)",
    "trl-rloo": "TRL RLOOTrainer: k1 summed into the sequence reward",
    "verl-default": "verl actor KL loss kl_loss_type=low_var_kl (use_kl_loss=True)",
    "verl:<kl_loss_type>": "verl actor KL loss, e.g. verl:k1, verl:k2, verl:k3+, verl:low_var_kl+",
    "verl-reward:<kl_penalty>": "verl KL in the reward (use_kl_in_reward=True) with an outcome advantage (GRPO)",
    "openrlhf-default-k3": "OpenRLHF --algo.kl.use_loss --algo.kl.estimator k3",
    "openrlhf:<estimator>": "OpenRLHF KL loss (--algo.kl.use_loss), e.g. openrlhf:k1, openrlhf:k2",
    "openrlhf:unbiased_gradient": "OpenRLHF --algo.kl.use_loss --algo.kl.unbiased_gradient",
    "openrlhf-reward:<estimator>": "OpenRLHF KL in the reward (its default), e.g. openrlhf-reward:k1",
}


def by_name(name: str) -> NativeKL | None:
    """The NativeKL of a name of `NAMED` (None for a name it does not know; a preset's own name is not looked up
    here). `<framework>:<setting>` passes the setting to that framework's function above."""
    fixed = {"trl-default": lambda: trl_grpo_loss(True), "trl-k3-loss": lambda: trl_grpo_loss(False),
             "trl-rloo": trl_rloo_reward, "verl-default": lambda: verl_loss("low_var_kl"),
             "openrlhf-default-k3": lambda: openrlhf_loss("k3"),
             "openrlhf:unbiased_gradient": lambda: openrlhf_loss("k3", unbiased_gradient=True)}
    if name in fixed:
        return fixed[name]()
    family, _, setting = name.partition(":")
    forms = {"verl": verl_loss, "verl-reward": lambda s: verl_reward(s, to_go=False), "openrlhf": openrlhf_loss,
             "openrlhf-reward": openrlhf_reward}
    if setting and family in forms:
        return forms[family](setting)
    return None
