"""verl adapter, flag resolution: what a verl config's estimator names and KL_ADAPTERS select, and the refusals at
configuration (the driver's validate_config, before Ray starts; the workers' ppo_loss for the loss path)."""

from __future__ import annotations

import os

from ... import activation, native
from ...activation import ENV_VAR, Settings, parse
from ...budget import check_budget_preset

#: verl estimator names starting with this select a preset: "kl_adapters:<KL_ADAPTERS value>"
PREFIX = "kl_adapters:"
#: presets the reward path implements (a detached KL reward-to-go in the advantages)
_REWARD_PRESETS = ("reward", "reward-plain")
_FULL = ("verl's kl estimator 'full' (analytic KL) raises NotImplementedError in verl 0.9.1, and kl-adapters does not "
         "offer it (ppo_loss never receives the full-vocabulary logits). Use kl_adapters:sequence, the exact "
         "sequence-level estimator, or one of verl's sampled estimators.")
_FULL_PRESET = ("preset 'full' needs the full next-token distributions of the policy and the reference in the loss; "
                "verl's actor receives only the reference's sampled-token log-probs (ref_log_prob from the ref worker) "
                "and ppo_loss never sees full-vocabulary logits, so kl-adapters cannot compute it in verl. Use "
                "kl_adapters:sequence (the exact sequence-level gradient from sampled tokens), or TRL's GRPOTrainer "
                "with kl_preset='full'.")
_LENGTH_NORMALISED = ("loss_agg_mode=seq-mean-token-mean divides each sequence's KL by its own length: that optimizes "
                      "a length-normalized KL, not the sequence KL. Use token-mean, seq-mean-token-sum or "
                      "seq-mean-token-sum-norm with kl-adapters.")
#: the config keys whose value may be a ``kl_adapters:`` name: the actor's KL loss and the KL in the reward
LOSS_KEY, REWARD_KEY = "actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_penalty"
#: where a verl config can carry KL_ADAPTERS to the Ray job
RUNTIME_ENV_KEY = f"ray_kwargs.ray_init.runtime_env.env_vars.{ENV_VAR}"


def flag_settings(name: str, default: Settings | None, key: str = LOSS_KEY) -> Settings | None:
    """The settings a verl estimator name (the value of `key`) selects: ``kl_adapters:<value>`` parses <value>
    (SettingError naming `key` when refused); verl's own names defer to `default` (the KL_ADAPTERS / enable()
    setting). None means verl's own code runs.

    Flag, verl's idiom (the estimator-name fields verl already has; Hydra accepts the new names as plain strings):
        actor_rollout_ref.actor.kl_loss_type=kl_adapters:<preset>  actor KL loss (with actor.use_kl_loss=True)
        algorithm.kl_penalty=kl_adapters:reward   KL in the reward (with algorithm.use_kl_in_reward=True)
    or, for whichever of the two paths is on, the environment variable ``KL_ADAPTERS=<preset>`` (exported before
    ``python -m verl.trainer.main_ppo``, or ``+ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS=<preset>``). The
    value after ``kl_adapters:`` uses the KL_ADAPTERS syntax ``<preset>[:is_clip=<c>]`` (quote it for Hydra when it
    holds ``=``); a config name wins over the environment variable. With neither, every wrapper runs verl's own
    function unchanged."""
    if isinstance(name, str) and name.startswith(PREFIX):
        settings = parse(name[len(PREFIX):], setting=key, written=name)
        if settings is None:
            raise ValueError(f"{name!r} selects no preset: name one ({PREFIX}sequence, ...) or use verl's estimator")
        return settings
    if default is not None and name == "full":
        raise ValueError(f"{key}=full with {ENV_VAR}={str(default)!r}: {_FULL}")
    return default


def check_loss_settings(settings: Settings, loss_agg_mode: str) -> None:
    """Refuse loss-path settings whose gradient would not be the documented one.

    verl's ``full`` estimator raises NotImplementedError upstream; the adapter does not offer an analytic KL (ppo_loss
    never receives the full-vocabulary logits) and refuses ``full`` when a flag would replace it (preset ``full``
    here, verl's name ``full`` under KL_ADAPTERS in `flag_settings`). ``seq-mean-token-mean`` is refused: it optimizes
    a length-normalized KL."""
    if settings.spec.needs_full_logits:
        raise ValueError(_FULL_PRESET)
    if loss_agg_mode == "seq-mean-token-mean":
        raise ValueError(_LENGTH_NORMALISED)


def check_reward_settings(settings: Settings) -> None:
    """The reward path implements the `reward` presets only (a detached KL reward cannot carry another gradient)."""
    if settings.preset not in _REWARD_PRESETS:
        raise ValueError(f"verl's KL-in-reward path (algorithm.use_kl_in_reward=True) implements only the 'reward' "
                         f"and 'reward-plain' presets, got {settings.preset!r}: use kl_adapters:reward there, or put "
                         f"preset "
                         f"{settings.preset!r} in the actor loss (actor_rollout_ref.actor.use_kl_loss=True, "
                         f"kl_loss_type=kl_adapters:{settings.preset}, algorithm.use_kl_in_reward=False)")
    if settings.is_clip is not None:
        raise ValueError("is_clip caps importance weights, which the reward path does not apply (PPO's ratio does)")


def check_config(config) -> tuple[str, Settings] | None:
    """Refuse flag combinations that would be silent no-ops, count the KL twice, or optimize another objective; return
    the KL path ("loss" or "reward") and the settings kl-adapters applies there (None: verl's own KL).

    `config` is verl's full Hydra config (run in the driver by the patched ``validate_config``, before Ray starts).
    The environment setting is KL_ADAPTERS of this process or of ``ray_kwargs.ray_init.runtime_env.env_vars``.
    Pinned by tests/verl/test_config.py and tests/verl/test_activation.py::test_table_on_every_verl_path.
    """
    actor, algo = config.actor_rollout_ref.actor, config.algorithm
    default, source = _environment_settings(config)
    use_loss, use_reward = bool(actor.use_kl_loss), bool(algo.get("use_kl_in_reward", False))
    for key, name, switch, used in (
        (LOSS_KEY, actor.kl_loss_type, "actor_rollout_ref.actor.use_kl_loss", use_loss),
        (REWARD_KEY, algo.kl_penalty, "algorithm.use_kl_in_reward", use_reward),
    ):
        if not used and flag_settings(name, None, key) is not None:
            raise ValueError(f"{key}={name} has no effect while {switch}=False: set {switch}=True")
    if default is not None and not (use_loss or use_reward):
        raise ValueError(f"{source}={default} has no effect: verl has no KL term (set "
                         "actor_rollout_ref.actor.use_kl_loss=True or algorithm.use_kl_in_reward=True)")
    loss = flag_settings(actor.kl_loss_type, default, LOSS_KEY) if use_loss else None
    reward = flag_settings(algo.kl_penalty, default, REWARD_KEY) if use_reward else None
    if (loss or reward) and use_loss and use_reward:
        raise ValueError("the KL is both in the reward (algorithm.use_kl_in_reward) and in the loss "
                         "(actor.use_kl_loss): with kl-adapters each path is exact on its own, so enabling both "
                         "regularizes twice (with two betas). Enable exactly one.")
    try:
        if loss:
            check_loss_settings(loss, actor.loss_agg_mode)
        if reward:
            check_reward_settings(reward)
            if actor.loss_agg_mode == "seq-mean-token-mean":
                raise ValueError(_LENGTH_NORMALISED)
    except ValueError as err:
        name, key = (actor.kl_loss_type, LOSS_KEY) if loss else (algo.kl_penalty, REWARD_KEY)
        raise ValueError(f"{f'{key}={name!r}' if name.startswith(PREFIX) else f'{source}={str(default)!r}'}: "
                         f"{err}") from None
    check_budget_config(config, loss, reward)
    return ("loss", loss) if loss else ("reward", reward) if reward else None


def check_budget_config(config, loss: Settings | None, reward: Settings | None) -> None:
    """Refuse a kl_target that cannot do what it says (driver, before Ray starts): a starting beta that is not > 0
    (kl_loss_coef / kl_ctrl.kl_coef), verl's adaptive controller on the same path (two controllers of one beta), or
    a preset whose gradient is not the sequence KL's for these batches (`budget.check_budget_preset`; the loss path
    is off-policy with several mini-batches or ppo_epochs > 1). Pinned by tests/verl/test_budget.py."""
    actor, algo = config.actor_rollout_ref.actor, config.algorithm
    if loss is not None and loss.kl_target is not None:
        if not float(actor.kl_loss_coef) > 0:
            raise ValueError(f"kl_target={loss.kl_target} starts from actor_rollout_ref.actor.kl_loss_coef, which is "
                             f"{actor.kl_loss_coef}: set it > 0")
        off_policy = actor.ppo_epochs > 1 or actor.ppo_mini_batch_size < config.data.train_batch_size
        check_budget_preset(loss.spec, loss.is_clip, off_policy=off_policy)
    if reward is not None and reward.kl_target is not None:
        if algo.kl_ctrl.type != "fixed":
            raise ValueError(f"kl_target={reward.kl_target} and algorithm.kl_ctrl.type={algo.kl_ctrl.type} would both "
                             "set the reward's KL coefficient: use algorithm.kl_ctrl.type=fixed with a kl_target")
        if not float(algo.kl_ctrl.kl_coef) > 0:
            raise ValueError(f"kl_target={reward.kl_target} starts from algorithm.kl_ctrl.kl_coef, which is "
                             f"{algo.kl_ctrl.kl_coef}: set it > 0")


def _environment_settings(config) -> tuple[Settings | None, str]:
    """The KL_ADAPTERS setting a verl run gets -- active in this process, or in its environment, or in the config's
    ``ray_kwargs.ray_init.runtime_env.env_vars`` -- and where it was set (for messages)."""
    from omegaconf import OmegaConf

    in_process = activation.active() or parse(os.environ.get(ENV_VAR))
    if in_process is not None:
        return in_process, ENV_VAR
    return parse(OmegaConf.select(config, RUNTIME_ENV_KEY, default=None), setting=RUNTIME_ENV_KEY), RUNTIME_ENV_KEY


def _loss_settings(config) -> Settings | None:
    if not config.use_kl_loss:
        return None
    settings = flag_settings(config.kl_loss_type, activation.active(), LOSS_KEY)
    if settings is not None:
        check_loss_settings(settings, config.loss_agg_mode)
        activation.announce("verl", "loss", settings)
    return settings


def _reward_settings(kl_penalty: str) -> Settings | None:
    settings = flag_settings(kl_penalty, activation.active(), REWARD_KEY)
    if settings is not None:
        check_reward_settings(settings)
        activation.announce("verl", "reward", settings)
    return settings


def _native_preset(kl_loss_type: str) -> str | None:
    """The preset with the gradient of verl's own estimator (`native.verl_loss`; low_var_kl for kl_adapters: names)."""
    return native.verl_loss("low_var_kl" if kl_loss_type.startswith(PREFIX) else kl_loss_type).preset
