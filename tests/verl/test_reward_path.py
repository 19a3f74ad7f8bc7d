"""verl's KL-in-reward path (apply_kl_penalty -> advantage estimator) under the `reward` preset, with verl's own
functions as each trainer binds them (v0 ray_trainer, v1 trainer_base, experimental separation).

Identity checked: advantages = estimator(KL-free scores) - beta * c_t, c_t the on-policy weight of the preset on the
whole batch (reward: leave-one-out statistics within each GRPO group, verl's uid, fitted to the task + KL gradient with
task=TaskAdvantages(estimator(scores), beta, normalized: False for rloo and grpo without std, else True); reward-plain:
sum_{s>=t} k1_s), i.e. the KL reward-to-go is added after any normalisation, so GRPO's per-group std never rescales
it; through verl's PG loss on-policy this is exactly the gradient of kl_surrogate(preset, beta=per_sequence_beta(beta,
mask, "token-mean"), group=uid, task=...).
"""

import importlib
import importlib.util

import numpy as np
import pytest
import torch
from verl_cases import Case, actor_config

from kl_adapters import TaskAdvantages, activation, kl_coefficients, kl_reward, per_sequence_beta
from kl_adapters.adapters import verl as verl_adapter
from kl_adapters.adapters.verl import reward as verl_reward

BETA = 0.1
G = 4  # responses per prompt


def reward_batch(case: Case):
    """A DataProto as the trainers hold it before apply_kl_penalty: outcome scores at each response's last token."""
    from verl import DataProto

    mask = case.tokens["response_mask"]
    gen = torch.Generator().manual_seed(7)
    last = mask.cumsum(-1) == mask.sum(-1, keepdim=True)
    scores = (torch.rand(mask.shape[0], 1, generator=gen) * mask * last).float()
    uids = np.array([f"prompt{i // G}" for i in range(mask.shape[0])], dtype=object)
    return DataProto.from_dict(
        tensors={"response_mask": mask, "token_level_scores": scores, "old_log_probs": case.old.clone(),
                 "ref_log_prob": case.ref.clone(), "responses": case.tokens["responses"],
                 "attention_mask": case.tokens["attention_mask"]},
        non_tensors={"uid": uids})


SITES = {  # trainer module -> the advantage function its fit loop calls after apply_kl_penalty
    "v0": ("verl.trainer.ppo.ray_trainer", "compute_advantage"),
    # verl 0.9.x: the v1 (TransferQueue) trainer; verl 0.8.0 has no v1 package: its TransferQueue trainer main_ppo_sync
    "v1": ("verl.trainer.ppo.v1.trainer_base" if importlib.util.find_spec("verl.trainer.ppo.v1")
           else "verl.trainer.main_ppo_sync", "compute_advantage_for_multi_trajectories"),
    "separation": ("verl.experimental.separation.ray_trainer", "compute_advantage"),
}
GROUPS = torch.arange(8) // G  # the uid of reward_batch's rows as integer ids


def run(site: str, kl_penalty: str | None, estimator: str, case: Case, *, kl_ctrl=None, norm: bool = True):
    """What a trainer's step does: KL in reward (kl_penalty None: use_kl_in_reward=False), then the advantages."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import FixedKLController

    module = importlib.import_module(SITES[site][0])
    advantage = getattr(module, SITES[site][1])
    data, metrics = reward_batch(case), {}
    if kl_penalty is None:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    else:
        data, metrics = module.apply_kl_penalty(data, kl_ctrl=kl_ctrl or FixedKLController(BETA), kl_penalty=kl_penalty)
    kwargs = dict(adv_estimator=estimator, gamma=1.0, lam=1.0, num_repeat=G, norm_adv_by_std_in_grpo=norm,
                  config=AlgoConfig(adv_estimator=estimator, norm_adv_by_std_in_grpo=norm))
    if site == "v1":
        kwargs["batch_keys"] = [f"{uid}_{row}_0" for row, uid in enumerate(data.non_tensor_batch["uid"])]
    return advantage(data, **kwargs), metrics


@pytest.fixture(scope="module")
def case():
    return Case(seed=2, on_policy=True)


def kl_to_go(case, scores_only=None, normalized=True, preset="reward"):
    """What the adapter adds to the advantages: -beta * the preset's on-policy weight; `reward`: statistics within each
    group, fitted with the task advantages of `scores_only` (the estimator's result on the KL-free scores)."""
    reduced = {} if preset != "reward" else {"group": GROUPS, "task": TaskAdvantages(
        scores_only.batch["advantages"], BETA, normalized)}
    return -BETA * kl_coefficients(case.old, case.ref, case.tokens["response_mask"], preset=preset, **reduced)


def test_reward_plain_adds_the_k1_reward_to_go(case):
    """`reward-plain`: the unreduced k1 reward-to-go, -beta * sum_{s>=t} k1_s."""
    ours, _ = run("v0", "kl_adapters:reward-plain", "grpo", case)
    scores_only, _ = run("v0", None, "grpo", case)
    plain = kl_reward(case.old, case.ref, case.tokens["response_mask"], beta=BETA, to_go=True)
    torch.testing.assert_close(ours.batch["advantages"], scores_only.batch["advantages"] + plain, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kl_to_go(case, preset="reward-plain"), plain)


@pytest.mark.compat
@pytest.mark.parametrize("site, estimator, norm, normalized", [
    ("v0", "grpo", True, True), ("v0", "grpo", False, False), ("v0", "rloo", True, False),
    ("v0", "reinforce_plus_plus", True, True), ("v1", "grpo", True, True), ("v1", "grpo", False, False),
    ("separation", "grpo", True, True)])
def test_reward_kl_added_after_grpo_normalisation(case, site, estimator, norm, normalized, monkeypatch):
    """normalized: how the adapter tells the core the estimator's advantages were scaled (TaskAdvantages.normalized:
    by a std over rows including the row, or only shifted), read from the estimator's own arguments. On this small
    batch both flags can give the same coefficients, so the flag the core receives is also checked directly."""
    handed = []
    core = verl_reward.kl_coefficients
    monkeypatch.setattr(verl_reward, "kl_coefficients", lambda *a, **kw: handed.append(kw["task"]) or core(*a, **kw))
    ours, metrics = run(site, "kl_adapters:reward", estimator, case, norm=norm)
    scores_only, _ = run(site, None, estimator, case, norm=norm)
    expected = scores_only.batch["advantages"] + kl_to_go(case, scores_only, normalized)
    torch.testing.assert_close(ours.batch["advantages"], expected, rtol=1e-6, atol=1e-7)
    assert [t.normalized for t in handed] == [normalized] and handed[0].beta == BETA
    assert "kl_adapters/reward_beta" not in ours.meta_info
    assert {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "kl_adapters/seq_kl"} <= set(metrics)


def test_verls_reward_metrics_rewards_and_controller_are_its_k1_ones(case):
    """apply_kl_penalty runs verl's own code with its k1 estimator: same rewards, metrics and adaptive-beta update."""
    from verl.trainer.ppo import core_algos, ray_trainer

    ctrl_ours = core_algos.AdaptiveKLController(init_kl_coef=BETA, target_kl=0.01, horizon=100)
    ctrl_verl = core_algos.AdaptiveKLController(init_kl_coef=BETA, target_kl=0.01, horizon=100)
    data, ours = ray_trainer.apply_kl_penalty(reward_batch(case), kl_ctrl=ctrl_ours, kl_penalty="kl_adapters:reward")
    upstream = ray_trainer.apply_kl_penalty.__kl_adapters_original__
    verl_data, theirs = upstream(reward_batch(case), kl_ctrl=ctrl_verl, kl_penalty="kl")
    assert ours["actor/reward_kl_penalty"] == theirs["actor/reward_kl_penalty"]
    assert ctrl_ours.value == ctrl_verl.value != BETA
    assert torch.equal(data.batch["token_level_rewards"], verl_data.batch["token_level_rewards"])
    assert data.meta_info["kl_adapters/reward_beta"] == BETA  # the beta of this step, before the controller update


@pytest.mark.compat
def test_policy_gradient_equals_kl_surrogate_reward_preset(case):
    """Through verl's PG loss (vanilla, on-policy: ratio 1), the added advantages give grad kl_surrogate("reward") with
    the leave-one-out statistics of each GRPO group (group=uid): the whole rollout batch, not a micro-batch."""
    ours, _ = run("v0", "kl_adapters:reward", "grpo", case)
    scores_only, _ = run("v0", None, "grpo", case)
    config = actor_config(use_kl_loss=False)
    flagged, _, _ = case.ppo_grad(config, advantages=ours.batch["advantages"])
    task, _, _ = case.ppo_grad(config, advantages=scores_only.batch["advantages"])
    mask = case.tokens["response_mask"]
    kl = case.surrogate_grad(preset="reward", beta=per_sequence_beta(BETA, mask, "token-mean"), group=GROUPS,
                             task=TaskAdvantages(scores_only.batch["advantages"], BETA, normalized=True))
    err = ((flagged - task - kl).norm() / kl.norm()).item()
    assert err < 1e-4, err


@pytest.mark.compat
@pytest.mark.parametrize("kl_penalty", ["kl", "low_var_kl"])
@pytest.mark.parametrize("site", sorted(SITES))
def test_flag_off_is_bit_identical_to_upstream(case, site, kl_penalty):
    ours, metrics = run(site, kl_penalty, "grpo", case)
    verl_adapter.unpatch()
    upstream, upstream_metrics = run(site, kl_penalty, "grpo", case)
    for key in ("advantages", "returns", "token_level_rewards"):
        assert torch.equal(ours.batch[key], upstream.batch[key]), key
    assert metrics == upstream_metrics


def test_environment_flag_selects_the_reward_path(case):
    activation.enable("reward")
    by_env, _ = run("v0", "kl", "grpo", case)
    activation.disable()
    scores_only, _ = run("v0", None, "grpo", case)
    torch.testing.assert_close(by_env.batch["advantages"], scores_only.batch["advantages"] + kl_to_go(case, scores_only))


@pytest.mark.parametrize("kl_penalty, env, error", [
    ("kl_adapters:sequence", None, "implements only the 'reward' and 'reward-plain' presets"),
    ("kl", "sequence", "implements only the 'reward' and 'reward-plain' presets"),
    ("kl_adapters:reward:is_clip=2", None, "is_clip"),
    ("full", "reward", "'full'"),
])
def test_reward_path_refusals(case, kl_penalty, env, error):
    if env:
        activation.enable(env)
    with pytest.raises(ValueError, match=error):
        run("v0", kl_penalty, "grpo", case)
