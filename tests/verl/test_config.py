"""The flag in verl's own Hydra config: the example's overrides compose with verl's ppo_trainer.yaml and pass verl's
validation; conflicting or no-op settings are refused in the driver (verl's validate_config, before Ray starts)."""

import os
import subprocess
from pathlib import Path

import pytest

from kl_adapters import activation
from kl_adapters.activation import Settings
from kl_adapters.adapters import verl as verl_adapter

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_grpo.sh"


def compose(overrides):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


def example_overrides(**env):
    out = subprocess.run(["bash", str(EXAMPLE), "--print-overrides"], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("env, path, expected", [
    ({}, "actor_rollout_ref.actor.kl_loss_type", Settings("sequence")),
    ({"PRESET": "sequence:is_clip=2"}, "actor_rollout_ref.actor.kl_loss_type", Settings("sequence", 2.0)),
    ({"KL_PATH": "reward"}, "algorithm.kl_penalty", Settings("reward")),
])
def test_example_overrides_pass_verls_and_our_validation(env, path, expected):
    from omegaconf import OmegaConf
    from verl.trainer import main_ppo

    config = compose(example_overrides(**env))
    assert verl_adapter.flag_settings(OmegaConf.select(config, path), None) == expected
    main_ppo.validate_config(config, use_reference_policy=True, use_critic=False)  # ours, then verl's own


BASE = ["algorithm.adv_estimator=grpo"]


@pytest.mark.parametrize("overrides, error", [
    (["actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"], "has no effect while .*use_kl_loss=False"),
    (["algorithm.kl_penalty=kl_adapters:reward"], "has no effect while algorithm.use_kl_in_reward=False"),
    (["+ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS=sequence"], "KL_ADAPTERS=sequence has no effect"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True",
      "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"], "both in the reward .* and in the loss"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl_adapters:sequence"],
     "only the 'reward' and 'reward-plain' presets"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence",
      "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], "length-normalized KL"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl_adapters:reward",
      "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], "length-normalized KL"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=full",
      "+ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS=sequence"], "'full'"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=kl_adapters:full"],
     "kl_loss_type=.kl_adapters:full.: preset .full. needs the full next-token distributions"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=kl_adapters:nope"],
     "unknown KL preset 'nope'"),
])
def test_conflicting_settings_are_refused_by_verls_validate_config(overrides, error):
    from verl.trainer import main_ppo

    config = compose(BASE + overrides)
    with pytest.raises(ValueError, match=error):
        main_ppo.validate_config(config, use_reference_policy=True, use_critic=False)


def test_environment_variable_of_the_driver_counts():
    config = compose(BASE)  # no KL term at all
    activation.enable("sequence")
    with pytest.raises(ValueError, match="has no effect"):
        verl_adapter.check_config(config)
    activation.disable()
    verl_adapter.check_config(config)  # flag off: nothing to refuse


def test_driver_forwards_the_active_setting_to_every_ray_worker():
    """get_ppo_ray_runtime_env (main_ppo's binding) builds the job runtime_env: KL_ADAPTERS is added when active."""
    from verl.trainer import constants_ppo, main_ppo

    upstream = constants_ppo.get_ppo_ray_runtime_env.__kl_adapters_original__
    assert main_ppo.get_ppo_ray_runtime_env is constants_ppo.get_ppo_ray_runtime_env
    assert main_ppo.get_ppo_ray_runtime_env() == upstream()  # flag off: verl's runtime_env unchanged
    activation.enable("sequence", is_clip=3.0)
    env = main_ppo.get_ppo_ray_runtime_env()
    assert env["env_vars"][activation.ENV_VAR] == "sequence:is_clip=3.0"
    assert {k: v for k, v in env["env_vars"].items() if k != activation.ENV_VAR} == upstream()["env_vars"]


@pytest.mark.parametrize("overrides, scaling", [
    (["algorithm.adv_estimator=grpo"], "normalized"),
    (["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False"], "shifted"),
    (["algorithm.adv_estimator=rloo"], "shifted"),
    (["algorithm.adv_estimator=gae"], "normalized"),
    (["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False",
      "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence-plain"], None),  # no statistics to fit
    (["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False",
      "actor_rollout_ref.actor.kl_loss_type=low_var_kl"], None),  # flag off
])
def test_runtime_env_tells_the_workers_how_advantages_are_scaled(overrides, scaling):
    """The actor workers receive only actor_rollout_ref, so the driver's runtime_env says how the algorithm scaled the
    advantages the reduced presets fit to (kl_adapters' TaskAdvantages.normalized); nothing is added otherwise."""
    from verl.trainer import constants_ppo, main_ppo

    config = compose(["actor_rollout_ref.actor.use_kl_loss=True",
                      "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence", *overrides])
    upstream = constants_ppo.get_ppo_ray_runtime_env.__kl_adapters_original__(config)
    env = main_ppo.get_ppo_ray_runtime_env(config)
    assert env["env_vars"].get(verl_adapter.ADVANTAGES_ENV) == scaling
    assert {k: v for k, v in env["env_vars"].items() if k != verl_adapter.ADVANTAGES_ENV} == upstream["env_vars"]
