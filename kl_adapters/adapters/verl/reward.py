"""verl adapter, reward path (``algorithm.kl_penalty=kl_adapters:reward``): verl's apply_kl_penalty with k1, then the
advantage estimator on the KL-free scores and the preset's KL reward-to-go added to its advantages."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ...reductions import TaskAdvantages
from ...surrogate import kl_coefficients, sequence_kl
from ..budget_wiring import take_step
from ..metrics import SEQ_KL
from .driver import advantage_scaling
from .flags import _reward_settings
from .kl_budget import _reward_budget
from .loss import _group_ids

#: DataProto.meta_info key: the KL beta handed from apply_kl_penalty to the advantage step
_REWARD_BETA = "kl_adapters/reward_beta"
#: DataProto.meta_info key: the reward-path `Preset` ("reward" or "reward-plain", resolved once: `Settings.spec`),
#: handed along with the beta
_REWARD_PRESET = "kl_adapters/reward_preset"


def _kl_in_reward(apply_kl_penalty: Callable) -> Callable:
    """Wrap apply_kl_penalty: under the `reward` preset run verl's with the k1 estimator (its rewards, metrics and
    kl_ctrl update) and hand beta to the advantage step through meta_info.

    Reward path (this and `_advantage_then_kl`): the ``reward`` and ``reward-plain`` presets. verl's apply_kl_penalty
    runs with its k1 estimator (its metrics ``actor/reward_kl_penalty(_coeff)`` and the kl_ctrl update unchanged),
    beta = kl_ctrl.value; the advantage estimator is given the KL-free scores and the KL is added to the advantages
    afterwards (`_advantage_then_kl`). Adds ``kl_adapters/seq_kl``. Under a KL budget (`_ship_beta`), applies the
    controller's beta through verl's fixed kl_ctrl and updates it from the rollout's sequence-KL estimate."""

    def patched(data, kl_ctrl, kl_penalty="kl"):
        settings = _reward_settings(kl_penalty)
        if settings is None:
            return apply_kl_penalty(data, kl_ctrl, kl_penalty=kl_penalty)
        budget = _reward_budget(kl_ctrl, settings)
        if budget is not None:
            kl_ctrl.value = budget.beta  # a fixed controller (check_config): the budget sets its value
        beta = float(kl_ctrl.value)  # the value verl applies in this call (it updates kl_ctrl afterwards)
        data, metrics = apply_kl_penalty(data, kl_ctrl, kl_penalty="k1")
        data.meta_info[_REWARD_BETA], data.meta_info[_REWARD_PRESET] = beta, settings.spec
        batch = data.batch
        metrics[SEQ_KL] = sequence_kl(batch["old_log_probs"], batch["ref_log_prob"],
                                                    batch["response_mask"]).mean().item()
        if budget is not None:
            kl_ctrl.value = take_step(budget, metrics[SEQ_KL], metrics)
        return data, metrics

    return patched


def _advantage_then_kl(compute_advantage: Callable) -> Callable:
    """Wrap an advantage function: the estimator sees the KL-free scores, then the KL reward-to-go is added to the
    advantages (after any group/batch normalisation): A_t <- A_t(scores) - beta * c_t, with c_t the on-policy
    per-token weight of the preset on the whole batch (`kl_coefficients(old_log_probs, ref_log_prob, mask)`):
        reward-plain  c_t = sum_{s>=t} k1_s
        reward        the reduced form (reductions.py) with statistics leave-one-out over the other rows of the same
                      GRPO group (verl's uid), else of the whole batch, fitted to the task + KL gradient:
                      task=TaskAdvantages(A(scores), beta, normalized=`_normalized_by`(the estimator's arguments)).
    The TaskRunner has no logits, so no end-of-sequence probabilities: no termination control variate on this path.
    k1 comes from ``old_log_probs`` and beta = kl_ctrl.value (`_kl_in_reward`). The KL is therefore never divided by
    GRPO's group std nor collapsed to a sequence sum, whatever ``adv_estimator`` is; beta keeps its meaning of a
    per-token reward coefficient on the raw reward scale
    (tests/verl/test_reward_path.py::test_reward_kl_added_after_grpo_normalisation).
    Pinned by tests/verl/test_reward_path.py."""

    def patched(data, *args, **kwargs):
        beta = data.meta_info.pop(_REWARD_BETA, None)
        spec = data.meta_info.pop(_REWARD_PRESET, None)  # the preset apply_kl_penalty handed along (`_kl_in_reward`)
        if beta is None:
            return compute_advantage(data, *args, **kwargs)
        penalized = data.batch["token_level_rewards"]
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        data = compute_advantage(data, *args, **kwargs)
        batch = data.batch
        mask = batch["response_mask"].bool()
        group = None
        if spec.uses_batch_statistics and "uid" in data.non_tensor_batch:
            group = _group_ids({"uid": data.non_tensor_batch["uid"]}, mask.device)
        task = None
        if spec.uses_batch_statistics and beta > 0:
            task = TaskAdvantages(batch["advantages"], beta, _normalized_by(compute_advantage, data, args, kwargs))
        coefficients = kl_coefficients(batch["old_log_probs"], batch["ref_log_prob"], mask, preset=spec, group=group,
                                       task=task)
        batch["advantages"] = batch["advantages"] - beta * coefficients.to(batch["advantages"].dtype)
        batch["token_level_rewards"] = penalized  # verl's k1-penalized rewards, for its reward metrics
        return data

    return patched


def _normalized_by(compute_advantage: Callable, data, args: tuple, kwargs: dict) -> bool:
    """TaskAdvantages.normalized for the advantages this call of verl's advantage function made (`advantage_scaling`
    of its own arguments)."""
    bound = inspect.signature(compute_advantage).bind(data, *args, **kwargs)
    bound.apply_defaults()
    scaling = advantage_scaling(bound.arguments.get("adv_estimator"),
                                bool(bound.arguments.get("norm_adv_by_std_in_grpo", True)))
    return scaling == "normalized"
