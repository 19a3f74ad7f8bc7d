"""verl adapter, KL budget (``kl_adapters:<preset>:kl_target=<nats>``, kl_adapters.budget, wired as
`budget_wiring` does for every adapter): one controller in the driver, its beta shipped with each actor update
(`_ship_beta`), the workers' KL term rescaled to it (`_budget_scaled`), its state beside verl's checkpoint
(`_save_budgets`, `_load_budgets`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from torch import Tensor

from ...activation import Settings
from ...budget import KLBudget
from .._guard import UnsupportedFrameworkError
from ..budget_wiring import kept_budget, restore, take_step
from ..metrics import BETA, KL_TARGET, SEQ_KL
from .flags import _loss_settings, _reward_settings
from .state import LOSS_CALL

#: non-tensor key of the actor's update batch (DataProto.meta_info in verl's v0 trainer, KVBatchMeta.extra_info in v1,
#: both non-tensor data of the TensorDict every actor worker trains on): the budget's beta for this update
BETA_KEY = "kl_adapters_beta"
#: the budgets' state in each checkpoint folder (global_step_<n>/, beside verl's data.pt)
BUDGET_FILE = "kl_adapters_budget.json"
#: the driver's metric of the update's sequence-KL estimate (the workers' kl_adapters/seq_kl, as verl collects it)
_SEQ_KL = f"actor/{SEQ_KL}"


def _shipped_budget(config, data) -> tuple[float, float, float] | None:
    """(beta, kl_loss_coef, target) of this ppo_loss call when its actor config sets a kl_target: beta is what the
    driver shipped with the update batch (BETA_KEY), None without a target. UnsupportedFrameworkError when the batch
    carries none (an update that did not go through verl's trainer: nothing would adjust beta)."""
    settings = _loss_settings(config)
    if settings is None or settings.kl_target is None:
        return None
    from verl.utils import tensordict_utils as tu

    beta = tu.get_non_tensor_data(data=data, key=BETA_KEY, default=None)
    if beta is None:
        raise UnsupportedFrameworkError(
            f"kl_loss_type={config.kl_loss_type}: ppo_loss received no {BETA_KEY} with its batch; the KL budget's beta "
            "is set by verl's trainer (RayPPOTrainer / v1 PPOTrainer._update_actor) and shipped with each update")
    return float(beta), float(config.kl_loss_coef), settings.kl_target


def _kl_coef(config) -> float:
    """The KL coefficient this ppo_loss call applies: the shipped budget beta, else kl_loss_coef."""
    call = LOSS_CALL.get()
    budget = None if call is None else call.budget
    return budget[0] if budget is not None else float(config.kl_loss_coef)


def _budget_scaled(term: Tensor, metrics: dict) -> Tensor:
    """ppo_loss multiplies the KL term by kl_loss_coef; under a budget the term is rescaled so that the product is the
    shipped beta times it, and kl_adapters/beta, kl_adapters/kl_target join the metrics."""
    budget = LOSS_CALL.get().budget
    if budget is None:
        return term
    from verl.utils.metric import AggregationType, Metric

    beta, coef, target = budget
    metrics.update({BETA: Metric(AggregationType.MEAN, beta), KL_TARGET: Metric(AggregationType.MEAN, target)})
    return term * (beta / coef)


def _loss_budget(trainer) -> KLBudget | None:
    """A verl trainer's loss-path budget (driver side), made at first use from its actor config: target = the
    kl_loss_type value's kl_target, initial beta = kl_loss_coef; None without a target."""
    actor = trainer.config.actor_rollout_ref.actor
    settings = _loss_settings(actor)
    if settings is None:
        return None
    return kept_budget(trainer, settings.kl_target, lambda: float(actor.kl_loss_coef))


def _reward_budget(kl_ctrl, settings: Settings | None) -> KLBudget | None:
    """The reward-path budget, kept on verl's KL controller object (initial beta = its value); None without a target."""
    return None if settings is None else kept_budget(kl_ctrl, settings.kl_target, lambda: float(kl_ctrl.value))


def _trainer_budgets(trainer) -> dict[str, KLBudget]:
    """The trainer's budgets by path ("loss", "reward"), as checkpoints store them."""
    budgets = {"loss": _loss_budget(trainer)}
    algo, kl_ctrl = trainer.config.algorithm, getattr(trainer, "kl_ctrl_in_reward", None)
    if algo.get("use_kl_in_reward", False) and kl_ctrl is not None:
        budgets["reward"] = _reward_budget(kl_ctrl, _reward_settings(algo.kl_penalty))
    return {path: budget for path, budget in budgets.items() if budget is not None}


def _ship_beta(update_actor: Callable) -> Callable:
    """Wrap a trainer's _update_actor (driver, once per rollout): with a loss-path budget, ship its beta in the batch's
    non-tensor info (BETA_KEY) to every actor worker, then update it from the update's sequence-KL estimate: the mean
    over mini-batches of verl's data-parallel mean of the workers' kl_adapters/seq_kl (each micro-batch's mean of
    `KLTerm.sequence_kl`, importance-weighted after the first mini-batch). v0 (RayPPOTrainer) returns the metrics in
    its output's meta_info, v1 (PPOTrainer) writes them into its `metrics` argument.

    KL budget (``kl_adapters:<preset>:kl_target=<nats>``, kl_adapters.budget; refused at configuration by
    `check_budget_config`): one controller in the driver, updated once per rollout. Loss path: the trainer's
    _update_actor (v0 RayPPOTrainer, v1 PPOTrainer; this wrapper) ships its beta with the update batch (BETA_KEY, so
    every actor worker and data-parallel rank applies the same value) and ppo_loss's KL term is rescaled by
    beta / kl_loss_coef (`_budget_scaled`); afterwards the controller takes the update's kl_adapters/seq_kl, which
    verl already reduces across ranks (no added synchronisation). Reward path: apply_kl_penalty applies the
    controller's beta through verl's fixed kl_ctrl and updates it from the rollout's sequence-KL estimate
    (`_kl_in_reward`). State: global_step_<n>/BUDGET_FILE beside verl's checkpoint, written by _save_checkpoint and
    read by _load_checkpoint (`_save_budgets`, `_load_budgets`). Metrics ``kl_adapters/beta``,
    ``kl_adapters/kl_target``. Pinned by tests/verl/test_budget.py."""

    def patched(self, batch, *args, **kwargs):
        budget = _loss_budget(self)
        if budget is None:
            return update_actor(self, batch, *args, **kwargs)
        (batch.extra_info if hasattr(batch, "extra_info") else batch.meta_info)[BETA_KEY] = budget.beta
        output = update_actor(self, batch, *args, **kwargs)
        metrics = (args[0] if args else kwargs["metrics"]) if hasattr(batch, "extra_info") else output.meta_info["metrics"]
        value = metrics.get(_SEQ_KL)
        if value is None:
            raise UnsupportedFrameworkError(f"verl's actor update returned no {_SEQ_KL} metric for the KL budget: this "
                                            "verl code path is not the tested one")
        values = value if isinstance(value, list) else [value]
        take_step(budget, sum(values) / len(values))
        return output

    return patched


def _checkpoint_folder(trainer) -> str:
    """global_step_<n>/ of the trainer's current step under trainer.default_local_dir (absolute, as verl resolves it),
    or trainer.resume_from_path with resume_mode=resume_path."""
    trainer_config = trainer.config.trainer
    if trainer_config.resume_mode == "resume_path":
        return os.path.abspath(trainer_config.resume_from_path)
    return os.path.join(os.path.abspath(trainer_config.default_local_dir), f"global_step_{trainer.global_steps}")


def _save_budgets(save_checkpoint: Callable) -> Callable:
    """Wrap a trainer's _save_checkpoint: also write the budgets' state to global_step_<n>/BUDGET_FILE."""

    def patched(self, *args, **kwargs):
        output = save_checkpoint(self, *args, **kwargs)
        budgets = _trainer_budgets(self)
        if budgets:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, BUDGET_FILE), "w") as f:
                json.dump({path: budget.state_dict() for path, budget in budgets.items()}, f)
        return output

    return patched


def _load_budgets(load_checkpoint: Callable) -> Callable:
    """Wrap a trainer's _load_checkpoint: after verl resumed (global_steps > 0), restore the budgets saved in that
    checkpoint folder; one saved without a budget leaves the configured beta (logged)."""

    def patched(self, *args, **kwargs):
        output = load_checkpoint(self, *args, **kwargs)
        budgets = _trainer_budgets(self)
        if budgets and self.global_steps:
            path = os.path.join(_checkpoint_folder(self), BUDGET_FILE)
            stored = {}
            if os.path.exists(path):
                with open(path) as f:
                    stored = json.load(f)
            restore(budgets, stored, path)
        return output

    return patched
