"""OpenRLHF adapter, KL budget (``--algo.kl.seq_target <nats>`` or ``--algo.kl.preset <preset>:kl_target=<nats>``,
kl_adapters.budget, wired as `budget_wiring` does for every adapter; refused at parsing by `flags._check_budget`): one
controller in the single controller (BasePPOTrainer / TrainingActor), updated once per rollout. Pinned by
tests/openrlhf/test_budget.py."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...budget import KLBudget
from .._guard import UnsupportedFrameworkError
from ..budget_wiring import kept_budget, restore, take_step
from ..metrics import SEQ_KL
from ..versions import supported_range
from .flags import _settings, check_args


#: client_states key of the budget's state in OpenRLHF's checkpoint (saved with the actor's DeepSpeed checkpoint)
BUDGET_STATE = "kl_adapters_budget"


def _budget(trainer: Any) -> KLBudget | None:
    """The single controller's KL budget (initial beta = --algo.kl.init_coef, OpenRLHF's fixed controller's value),
    made at first use; None without kl_target."""
    settings = _settings(trainer.args)
    if settings is None:
        return None

    def start() -> float:
        check_args(trainer.args, settings)
        return float(trainer.kl_ctl.value)

    return kept_budget(trainer, settings.kl_target, start)


def _wrap_train_step(original: Callable) -> Callable:
    """BasePPOTrainer.train_step (once per rollout) under a budget: OpenRLHF's fixed KL controller, shared with the
    experience maker (reward path) and passed to the actors' fit as kl_ctl (loss path), takes the budget's beta;
    after the step the budget is updated from the step's kl_adapters/seq_kl, which OpenRLHF's ppo_train averaged
    over the step's samples and all-reduced over the data-parallel ranks (loss path: importance-weighted estimates
    at each micro-batch; reward path: the rollout's). Adds kl_adapters/beta and kl_adapters/kl_target to the status.

    KL budget (``--algo.kl.seq_target <nats>`` or ``--algo.kl.preset <preset>:kl_target=<nats>``, kl_adapters.budget;
    refused at parsing by `_check_budget`): one controller in the single controller (BasePPOTrainer), updated once per
    rollout (this wrapper): OpenRLHF's fixed KL controller holds its beta, which train_step passes to every actor's
    fit as kl_ctl (loss path) and the experience maker applies (reward path); afterwards it takes the step's
    kl_adapters/seq_kl, which ppo_train already averaged and all-reduced over the data-parallel ranks (no added
    synchronisation). State: a key of OpenRLHF's checkpoint client_states (`_wrap_save`, restored by
    `_wrap_init_checkpoint_states`). Metrics ``kl_adapters/beta``, ``kl_adapters/kl_target``. Pinned by
    tests/openrlhf/test_budget.py."""

    @functools.wraps(original)
    def train_step(self, rollout_samples, global_step):
        budget = _budget(self)
        if budget is None:
            return original(self, rollout_samples, global_step)
        self.kl_ctl.value = budget.beta
        status, step = original(self, rollout_samples, global_step)
        if SEQ_KL not in status:
            raise UnsupportedFrameworkError(f"OpenRLHF's train_step returned no {SEQ_KL} for the KL budget: "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        self.kl_ctl.value = take_step(budget, float(status[SEQ_KL]), status)
        return status, step

    return train_step


def _wrap_save(original: Callable) -> Callable:
    """BasePPOTrainer.save_logs_and_checkpoints: the budget's state joins OpenRLHF's client_states (saved with the
    actor's checkpoint, returned by get_checkpoint_states on resume)."""

    @functools.wraps(original)
    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        budget = _budget(self)
        if budget is not None:
            client_states = {**(client_states or {}), BUDGET_STATE: budget.state_dict()}
        return original(self, global_step, logs_dict, client_states)

    return save_logs_and_checkpoints


def _wrap_init_checkpoint_states(original: Callable) -> Callable:
    """BasePPOTrainer.init_checkpoint_states (fit's resume): once OpenRLHF resumed (global_step > 0), restore the
    budget from the checkpoint's client_states; one saved without a budget leaves the configured beta (logged)."""

    @functools.wraps(original)
    def init_checkpoint_states(self):
        states = original(self)
        budget = _budget(self)
        if budget is not None and states.get("global_step"):
            restore({BUDGET_STATE: budget}, states, "OpenRLHF's resumed checkpoint (client_states)")
            self.kl_ctl.value = budget.beta
        return states

    return init_checkpoint_states
