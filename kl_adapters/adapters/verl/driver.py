"""verl adapter, driver helpers: the Ray job's runtime_env (KL_ADAPTERS and how the advantages are scaled, for the
workers) and the configuration check before verl's own validate_config."""

from __future__ import annotations

from collections.abc import Callable

from ... import activation
from .flags import _environment_settings, check_config, flag_settings

#: advantage estimators whose advantages are only shifted by a mean over rows that include the row (GRPO without
#: norm_adv_by_std_in_grpo, RLOO): TaskAdvantages(normalized=False); every other one is taken as std-normalized
_SHIFT_ONLY = ("rloo", "rloo_vectorized")
#: set by the driver in the Ray job's env_vars (`_with_advantage_scaling`): "normalized" or "shifted" (`_task`)
ADVANTAGES_ENV = "KL_ADAPTERS_VERL_ADVANTAGES"


def _forward_env(get_ppo_ray_runtime_env: Callable) -> Callable:
    """Add the active KL_ADAPTERS to the Ray job's runtime_env, so every worker on every node activates, and, given
    the config, `ADVANTAGES_ENV` (`_with_advantage_scaling`)."""

    def patched(*args, **kwargs):  # verl 0.8.0: get_ppo_ray_runtime_env(); 0.9.0 added (config=None)
        env = activation.with_kl_adapters_env(get_ppo_ray_runtime_env(*args, **kwargs))
        return _with_advantage_scaling(env, args[0] if args else kwargs.get("config"))

    return patched


def advantage_scaling(adv_estimator, norm_adv_by_std_in_grpo: bool = True) -> str:
    """How verl's advantage estimator scales the advantages: "shifted" for the ones that only subtract a mean over rows
    that include the row (`_SHIFT_ONLY`, and grpo with norm_adv_by_std_in_grpo=False), "normalized" for every other
    (GRPO's group std, GAE / REINFORCE++ whitening, and any estimator not known to be shift-only: normalized keeps the
    gradient exact for any advantages, but fits shift-only ones at unit scale, measured worse than plain on the
    demo: docs/history.md). Pinned by tests/verl/test_reward_path.py::test_reward_kl_added_after_grpo_normalisation."""
    estimator = getattr(adv_estimator, "value", adv_estimator)
    shifted = estimator in _SHIFT_ONLY or (estimator == "grpo" and not norm_adv_by_std_in_grpo)
    return "shifted" if shifted else "normalized"


def _with_advantage_scaling(runtime_env: dict, config) -> dict:
    """runtime_env with ADVANTAGES_ENV = `advantage_scaling`(config.algorithm) in its env_vars when the config puts a
    reduced preset in the actor loss: its workers receive only actor_rollout_ref, not how the TaskRunner made the
    advantages they fit to. Unchanged otherwise (flag off: verl's runtime_env). Pinned by
    tests/verl/test_config.py::test_runtime_env_tells_the_workers_how_advantages_are_scaled."""
    actor = None if config is None else config.actor_rollout_ref.actor
    if actor is None or not actor.use_kl_loss:
        return runtime_env
    settings = flag_settings(actor.kl_loss_type, _environment_settings(config)[0])
    if settings is None or not settings.spec.uses_batch_statistics:
        return runtime_env
    algo = config.algorithm
    scaling = advantage_scaling(algo.adv_estimator, bool(algo.get("norm_adv_by_std_in_grpo", True)))
    return {**runtime_env, "env_vars": {**(runtime_env.get("env_vars") or {}), ADVANTAGES_ENV: scaling}}


def _validate_first(validate_config: Callable) -> Callable:
    """Run `check_config` before verl's own validate_config (in the driver, before Ray starts)."""

    def patched(config, *args, **kwargs):
        applied = check_config(config)
        if applied is not None:
            activation.announce("verl", *applied)
        return validate_config(config, *args, **kwargs)

    return patched
