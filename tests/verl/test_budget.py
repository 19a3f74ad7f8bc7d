"""KL budget in verl: the value syntax kl_adapters:<preset>:kl_target=<nats> (loss and reward path), checked in the
driver by verl's validate_config; on the loss path the driver's _update_actor (verl's own, v0 RayPPOTrainer and v1
PPOTrainer, with a stub actor worker group) ships the budget's beta with the update batch and updates it once per
rollout from the actors' kl_adapters/seq_kl, and ppo_loss in the workers applies exactly that beta; on the reward path
apply_kl_penalty takes it from the budget; the state is saved and restored by verl's own _save_checkpoint /
_load_checkpoint (their worker-group calls stubbed: FSDP checkpoints of actor workers are verl's and need Ray)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_config import BASE, compose
from verl_cases import B, Case, actor_config, make_tokens

from kl_adapters.adapters import verl as verl_adapter
from kl_adapters.adapters.verl import kl_budget as verl_budget
from kl_adapters.adapters._guard import UnsupportedFrameworkError
from kl_adapters.budget import KLBudget

TARGET = 0.5
LOSS = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.2",
        f"actor_rollout_ref.actor.kl_loss_type='kl_adapters:sequence:kl_target={TARGET}'"]
REWARD = ["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.2",
          f"algorithm.kl_penalty='kl_adapters:reward:kl_target={TARGET}'"]


#: a run verl's own validation accepts (the example's batch sizes on one GPU)
RUN = ["algorithm.adv_estimator=grpo", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=1"]


def test_budget_config_passes_verls_validation():
    from verl.trainer import main_ppo

    for overrides in (LOSS, REWARD):
        main_ppo.validate_config(compose(RUN + overrides), use_reference_policy=True, use_critic=False)


@pytest.mark.parametrize("overrides, error", [
    (LOSS + ["actor_rollout_ref.actor.kl_loss_coef=0"], "starts from actor_rollout_ref.actor.kl_loss_coef"),
    (REWARD + ["algorithm.kl_ctrl.type=adaptive"], "would both set the reward's KL coefficient"),
    (REWARD + ["algorithm.kl_ctrl.kl_coef=0"], "starts from algorithm.kl_ctrl.kl_coef"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.ppo_epochs=2",
      "actor_rollout_ref.actor.kl_loss_type='kl_adapters:reward:kl_target=0.5'"], "off-policy"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type='kl_adapters:token:kl_target=1'"],
     "does not follow its gradient"),
    (["actor_rollout_ref.actor.use_kl_loss=True",
      "actor_rollout_ref.actor.kl_loss_type='kl_adapters:sequence:kl_target=-1'"], "kl_target must be a finite number"),
    ([f"actor_rollout_ref.actor.kl_loss_type='kl_adapters:sequence:kl_target={TARGET}'"], "has no effect"),
])
def test_bad_budgets_are_refused_by_verls_validate_config(overrides, error):
    from verl.trainer import main_ppo

    with pytest.raises(ValueError, match=error):
        main_ppo.validate_config(compose(BASE + overrides), use_reference_policy=True, use_critic=False)


@pytest.fixture(scope="module")
def case():
    return Case(seed=0)


def ppo(case, config, beta=None):
    """Gradient and metrics of verl's ppo_loss, with the driver's beta in the batch's non-tensor data when given."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses
    from verl_cases import flat_grad

    data = case.data()
    if beta is not None:
        tu.assign_non_tensor(data, **{verl_adapter.BETA_KEY: beta})
    loss, metrics = losses.ppo_loss(config, {"log_probs": case.log_probs()}, data)
    return flat_grad(loss, case.model), metrics


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "sequence-plain"])
def test_ppo_loss_applies_the_shipped_beta(case, preset):
    """Under a budget ppo_loss's KL weight is the shipped beta, not kl_loss_coef: the same gradient as the preset with
    kl_loss_coef = beta (the reduced presets' statistics are fitted with that beta too)."""
    budget, metrics = ppo(case, actor_config(kl_loss_type=f"kl_adapters:{preset}:kl_target={TARGET}", kl_loss_coef=0.3),
                          beta=0.7)
    fixed, _ = ppo(case, actor_config(kl_loss_type=f"kl_adapters:{preset}", kl_loss_coef=0.7))
    assert ((budget - fixed).norm() / fixed.norm()).item() < 1e-6
    assert metrics["kl_adapters/beta"].aggregate() == 0.7 and metrics["kl_adapters/kl_target"].aggregate() == TARGET


def test_ppo_loss_without_a_shipped_beta_is_refused(case):
    with pytest.raises(UnsupportedFrameworkError, match="no kl_adapters_beta"):
        ppo(case, actor_config(kl_loss_type=f"kl_adapters:sequence:kl_target={TARGET}"))


@pytest.mark.compat
def test_without_a_target_nothing_changes(case):
    """No kl_target: a shipped value is not read, no kl_adapters/beta metric."""
    plain, metrics = ppo(case, actor_config(kl_loss_type="kl_adapters:sequence"))
    shipped, _ = ppo(case, actor_config(kl_loss_type="kl_adapters:sequence"), beta=5.0)
    assert torch.equal(plain, shipped) and "kl_adapters/beta" not in metrics


class WorkerGroup:
    """Stand-in for the actor RayWorkerGroup: update_actor records the beta its batch carries and returns the metrics
    an actor update returns (kl_adapters/seq_kl of two mini-batches); save/load_checkpoint record their paths."""

    def __init__(self, estimates, v1: bool):
        self.estimates, self.v1, self.shipped, self.paths = list(estimates), v1, [], []

    def update_actor(self, batch):
        from verl.utils import tensordict_utils as tu

        info = batch.extra_info if self.v1 else batch
        self.shipped.append(info[verl_adapter.BETA_KEY] if self.v1 else tu.get_non_tensor_data(
            info, verl_adapter.BETA_KEY, None))
        kl = self.estimates.pop(0)
        metrics = {"kl_adapters/seq_kl": [kl - 0.05, kl + 0.05], "mfu": [0.1]}
        return {"metrics": metrics} if self.v1 else tu.get_tensordict({}, non_tensor_dict={"metrics": metrics})

    def save_checkpoint(self, *args, **kwargs):
        self.paths.append(("save", args[0]))

    def load_checkpoint(self, *args, **kwargs):
        self.paths.append(("load", kwargs.get("local_path", args[0] if args else None)))


class Loader:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def __len__(self):
        return 10


def trainer_of(v1: bool, config, estimates):
    """verl's trainer class (v1 PPOTrainerSync or v0 RayPPOTrainer) without __init__ (which builds Ray worker groups),
    with the attributes its _update_actor / _save_checkpoint / _load_checkpoint read."""
    if v1:
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync as cls  # trainer.v1.trainer_mode=sync
    else:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer as cls
    trainer = object.__new__(cls)
    callback = type("Callback", (), {"on_save": lambda self, **kw: None})()
    trainer.__dict__.update(config=config, actor_rollout_wg=WorkerGroup(estimates, v1), use_critic=False,
                            train_dataloader=Loader(), global_steps=0, trainer_mode="sync",
                            checkpoint_callback=callback, distillation_config=None)
    return trainer


def update_batch(v1: bool):
    if v1:
        return type("KVBatchMeta", (), {"extra_info": {}})()
    from verl import DataProto

    t = make_tokens(seed=0)
    mask = t["response_mask"]
    return DataProto.from_dict(tensors={
        "prompts": t["prompts"], "responses": t["responses"], "response_mask": mask,
        "input_ids": torch.cat([t["prompts"], t["responses"]], 1), "attention_mask": t["attention_mask"],
        "position_ids": (t["attention_mask"].cumsum(1) - 1).clamp(min=0), "old_log_probs": torch.zeros(mask.shape),
        "ref_log_prob": torch.zeros(mask.shape), "advantages": torch.zeros(mask.shape)},
        non_tensors={"uid": np.array([str(i) for i in range(B)], dtype=object)})


@pytest.mark.parametrize("v1", [True, False], ids=["v1 PPOTrainer", "v0 RayPPOTrainer"])
def test_driver_ships_beta_updates_it_and_checkpoints_it(v1, tmp_path):
    config = compose(BASE + LOSS + [f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=auto"])
    estimates = [0.1, 0.9, 0.6]
    trainer = trainer_of(v1, config, estimates)
    for step in range(3):
        trainer.global_steps = step + 1
        metrics = {}
        trainer._update_actor(update_batch(v1), metrics) if v1 else trainer._update_actor(update_batch(v1))
    replay = KLBudget(TARGET, 0.2)
    for kl, beta in zip(estimates, trainer.actor_rollout_wg.shipped):
        assert beta == pytest.approx(replay.beta, rel=1e-12)  # each update carried the budget's beta
        replay.observe(kl, 1)  # the mean over the update's mini-batches
        replay.update()
    budget = verl_budget._loss_budget(trainer)
    assert budget.steps == 3 and budget.beta == pytest.approx(replay.beta)

    trainer._save_checkpoint()
    folder = tmp_path / "global_step_3"
    assert json.loads((folder / verl_adapter.BUDGET_FILE).read_text())["loss"] == budget.state_dict()
    resumed = trainer_of(v1, config, [])
    resumed._load_checkpoint()  # resume_mode=auto: verl finds global_step_3 from latest_checkpointed_iteration.txt
    assert resumed.global_steps == 3 and ("load", os.path.join(folder, "actor")) in resumed.actor_rollout_wg.paths
    assert verl_budget._loss_budget(resumed).state_dict() == budget.state_dict()


def test_reward_path_beta_follows_the_budget():
    """apply_kl_penalty under kl_adapters:reward:kl_target: the KL coefficient verl applies is the budget's, updated
    after each rollout from its sequence-KL estimate; verl's fixed controller holds the current value."""
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.core_algos import FixedKLController

    kl_ctrl = FixedKLController(kl_coef=0.2)
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(B, 6, dtype=torch.long)
    betas, estimates = [], []
    for _ in range(3):
        ref = -torch.rand(B, 6, generator=gen)
        data = DataProto.from_dict(tensors={"response_mask": mask, "old_log_probs": ref - 0.3 * torch.rand(
            B, 6, generator=gen), "ref_log_prob": ref, "token_level_scores": torch.zeros(B, 6)})
        _, metrics = ray_trainer.apply_kl_penalty(data, kl_ctrl, f"kl_adapters:reward:kl_target={TARGET}")
        betas.append(metrics["kl_adapters/beta"])
        estimates.append(metrics["kl_adapters/seq_kl"])
        assert metrics["actor/reward_kl_penalty_coeff"] == betas[-1]  # what verl applied
    replay = KLBudget(TARGET, 0.2)
    for beta, kl in zip(betas, estimates):
        assert beta == pytest.approx(replay.beta)
        replay.observe(kl, 1)
        replay.update()
    assert kl_ctrl.value == pytest.approx(replay.beta)
