"""One wiring of the KL budget (`kl_adapters.budget.KLBudget`) into a trainer, shared by the three adapters: where the
controller lives, its once-per-step update and metrics, and its state restored from the trainer's checkpoint.

Each adapter says when a step ends and where its framework keeps checkpoint state (TRL: a transformers callback whose
state rides in trainer_state.json, updated at on_step_end; verl: the driver's trainer, a JSON file beside its
checkpoint, updated once per rollout; OpenRLHF: the single controller, a key of its checkpoint's client_states, once
per rollout). What they share is here: `kept_budget` (made at first use on the object that owns beta), `take_step`
(the step's sequence-KL estimate -> the next beta, with the metrics ``kl_adapters/beta`` / ``kl_adapters/kl_target`` of
the beta just applied) and `restore` (every budget the checkpoint holds resumes; one it lacks keeps the configured beta,
logged). The controller's math and its pinning tests: kl_adapters.budget. Imports neither torch nor any framework.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from ..budget import KLBudget

#: attribute of the object a budget is kept on (a trainer, or verl's KL controller); in memory only
ATTRIBUTE = "_kl_adapters_budget"
_log = logging.getLogger("kl_adapters")


def kept_budget(holder: object, target: float | None, start: Callable[[], float]) -> KLBudget | None:
    """The KL budget kept on `holder`, made at first use with target `target` and initial beta `start()` (the
    configured coefficient; called only then); None without a target."""
    if target is None:
        return None
    if ATTRIBUTE not in vars(holder):
        setattr(holder, ATTRIBUTE, KLBudget(target, start()))
    return getattr(holder, ATTRIBUTE)


def take_step(budget: KLBudget, estimate: float, metrics: dict | None = None) -> float:
    """End one budget step: add the budget's metrics (the beta this step applied, the target) to `metrics` when given,
    observe the step's mean sequence-KL estimate (``kl_adapters/seq_kl``) and return the updated beta."""
    if metrics is not None:
        metrics.update(budget.metrics())
    budget.observe(estimate, 1)
    return budget.update()


def restore(budgets: Mapping[str, KLBudget], stored: Mapping[str, dict], where: str) -> None:
    """Resume each of `budgets` (name -> budget) from its state in `stored` (name -> `KLBudget.state_dict()`, read
    from a checkpoint); one `stored` lacks keeps the configured beta, with a warning naming `where` (the checkpoint)."""
    for name, budget in budgets.items():
        if name in stored:
            budget.load_state_dict(stored[name])
        else:
            _log.warning("kl-adapters: %s holds no %s KL budget; it starts from the configured beta %g", where, name,
                         budget.beta)
