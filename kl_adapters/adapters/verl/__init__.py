"""verl adapter: the chosen preset's exact KL gradient in verl's actor loss, and the exact KL reward path.

Supported: versions.TESTED["verl"] (0.9.0, 0.9.1; others raise `UnsupportedFrameworkError` naming the range); what
differs between releases and why 0.8.0 is refused: `patch`. Flag (`flag_settings`, verl's estimator-name fields):
``actor_rollout_ref.actor.kl_loss_type=kl_adapters:<preset>`` (actor KL loss) or
``algorithm.kl_penalty=kl_adapters:reward`` (KL in the reward), or ``KL_ADAPTERS=<preset>`` for whichever path is on;
with neither, every wrapper runs verl's own function unchanged. Every process is reached by the ``verl.plugins`` entry
point (`verl_plugin`) and the Ray job's runtime_env (`patch`).

Modules (the sections of the former adapters/verl.py; names with a leading underscore are the package's own):
    flags      flag resolution and the refusals at configuration (`flag_settings`, `check_config`)
    loss       the loss path: KL term, batch statistics, metrics (ppo_loss, its policy loss and kl_penalty)
    eos        pi(EOS | y_<t) from the FSDP engine's logits (`end_of_sequence_probabilities`)
    megatron   the same from the Megatron engine's vocab-parallel logits (where megatron-core is installed)
    reward     the reward path (apply_kl_penalty, the advantage functions)
    kl_budget  the KL budget: beta shipped with each update, its state in the checkpoint
    driver     the Ray job's runtime_env and validate_config
    state      what the wrappers hand each other in a worker (`patching.Scoped` values, `state.EOS_ROWS`), with extents
This package wires them (`SITES`, `patch`, `unpatch`) through the adapters' shared `patching` module.

What is patched (attribute -> wrapper, `SITES`; name-import sites already loaded are rebound too, see `patch`):
    verl.workers.utils.losses.get_policy_loss_fn   `_capture_policy_loss`: the tensors ppo_loss hands its policy loss
    verl.workers.utils.losses.kl_penalty           `_kl_term`: the KL term of ppo_loss (core_algos' is untouched)
    verl.workers.utils.losses.ppo_loss             `_with_metrics`: kl_adapters/* metrics, the reduced presets' inputs
    verl.utils.tensordict_utils.make_iterator      `_tag_rows`: the rows of the batch an actor update trains on
    verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits, FSDPEngineWithLMHead.prepare_model_outputs,
    verl.workers.engine_workers.TrainingWorker.infer_batch    `_record_eos`, `_eos_outputs`, `_keep_eos_rows`:
                                                   pi(EOS | y_<t) from the forward's own logits
    verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead._lm_head_logits_processor,
    .prepare_model_outputs (trigger verl.workers.engine)    `megatron._record_eos`, `megatron._keep_rows`: the same
                                                   from the Megatron engine's logits, where megatron-core is installed
    verl.trainer.ppo.ray_trainer.apply_kl_penalty, .compute_advantage,
    verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories    `_kl_in_reward`, `_advantage_then_kl`
    verl.trainer.constants_ppo.get_ppo_ray_runtime_env, verl.utils.config.validate_config    `_forward_env`,
                                                   `_validate_first`: the driver (forward KL_ADAPTERS, refuse flags)
    RayPPOTrainer / v1 PPOTrainer ._update_actor, ._save_checkpoint, ._load_checkpoint    the KL budget (`_ship_beta`)

Math. Loss path (`_kl_per_token`): ppo_loss adds ``kl_loss_coef * agg_loss(kld, ...)``, and kld's per-token gradient
is ``w_t * c_t * grad log_prob_t`` (c the preset's weight, `kl_coefficients`, behaviour log-probs old_log_probs; w
verl's rollout_is_weights or 1), so the added gradient is that of ``kl_surrogate(..., beta=kl_loss_coef * B / D)``, D
agg_loss's divisor. Reward path (`_advantage_then_kl`): the advantage estimator sees the KL-free scores, then
``-beta * c_t`` is added to its advantages. The reduced presets' statistics are leave-one-out (exact), fitted to the
task + KL gradient (`_reduction_kwargs`, `_micro_batch_statistics`). Metrics: `_kl_per_token`. KL budget
(``kl_adapters:<preset>:kl_target=<nats>``): `_ship_beta`. Preset ``full``: refused (`check_loss_settings`).

Pinned by tests/verl/test_loss_path.py (::test_gradient_is_task_plus_kl_surrogate,
::test_micro_batch_keeps_verls_normaliser, ::test_task_group_and_eos_reach_the_core,
::test_statistics_of_the_workers_batch_reach_each_shuffled_micro_batch), tests/verl/test_engine.py,
tests/verl/test_eos.py, tests/verl/test_reward_path.py (::test_reward_kl_added_after_grpo_normalisation),
tests/verl/test_config.py, tests/verl/test_activation.py and tests/verl/test_budget.py.
"""

from __future__ import annotations

import sys

from ... import activation
from .._guard import require_version
from ..patching import Site, install, uninstall
from . import megatron
from .driver import ADVANTAGES_ENV, _forward_env, _validate_first, advantage_scaling
from .eos import EOS_PROB, IS_EOS, _eos_outputs, _keep_eos_rows, _record_eos, end_of_sequence_probabilities, eos_token_ids
from .eos import _row_keys  # noqa: F401 - timed by bench/verl_eos_cost.py as verl._row_keys
from .flags import (LOSS_KEY, PREFIX, REWARD_KEY, RUNTIME_ENV_KEY, check_budget_config, check_config,
                    check_loss_settings, check_reward_settings, flag_settings)
from .kl_budget import BETA_KEY, BUDGET_FILE, _load_budgets, _save_budgets, _ship_beta
from .loss import _capture_policy_loss, _kl_term, _tag_rows, _with_metrics
from .reward import _advantage_then_kl, _kl_in_reward

__all__ = ["ADVANTAGES_ENV", "BETA_KEY", "BUDGET_FILE", "EOS_PROB", "IS_EOS", "LOSS_KEY", "PREFIX", "REWARD_KEY",
           "RUNTIME_ENV_KEY", "SITES", "advantage_scaling", "check_budget_config", "check_config", "check_loss_settings",
           "check_reward_settings", "end_of_sequence_probabilities", "eos_token_ids", "flag_settings", "patch",
           "unpatch"]

#: trigger module -> functions patched when it is imported (the same module names are the "verl" triggers of
#: kl_adapters.adapters.loader.ADAPTERS). `everywhere` never for kl_penalty and get_policy_loss_fn: losses' copies are
#: the only ones ppo_loss uses; core_algos' serve other paths
SITES: dict[str, tuple[Site, ...]] = {
    "verl.utils.config": (Site("validate_config", ("config", "use_reference_policy", "use_critic"), _validate_first,
                                everywhere=True),),
    # verl 0.8.0: get_ppo_ray_runtime_env() takes no config (0.9.0 added it for per-engine env vars)
    "verl.trainer.constants_ppo": (Site("get_ppo_ray_runtime_env", ("config",), _forward_env, everywhere=True,
                                        params_in={"0.8.0": ()}),),
    "verl.workers.utils.losses": (
        Site("get_policy_loss_fn", ("name",), _capture_policy_loss),
        Site("kl_penalty", ("logprob", "ref_logprob", "kl_penalty"), _kl_term),
        Site("ppo_loss", ("config", "model_output", "data", "dp_group"), _with_metrics, everywhere=True),
        Site("make_iterator", ("tensordict", "mini_batch_size", "epochs"), _tag_rows,
             module="verl.utils.tensordict_utils"),
    ),
    # pi(EOS | y_<t) from the logits the FSDP engine's forward already makes (the termination control variate)
    "verl.workers.engine.fsdp.transformer_impl": (
        Site("logprobs_from_logits", ("logits", "labels"), _record_eos),
        Site("prepare_model_outputs", ("self", "output", "output_args", "micro_batch", "logits_processor_func"),
             _eos_outputs, owner="FSDPEngineWithLMHead"),
    ),
    "verl.workers.engine_workers": (Site("infer_batch", ("self", "data"), _keep_eos_rows, owner="TrainingWorker"),),
    # the same from the Megatron engine's LM-head logits (vocab-parallel); verl.workers.engine imports that engine only
    # where megatron-core is installed, so these sites are installed only where it did (`patch`)
    "verl.workers.engine": tuple(Site(name, params, wrap, module=megatron.MODULE, owner="MegatronEngineWithLMHead")
                                 for name, params, wrap in (
        ("_lm_head_logits_processor", ("self", "logits", "label", "temperature"), megatron._record_eos),
        ("prepare_model_outputs", ("self", "output", "data"), megatron._keep_rows))),
    "verl.trainer.ppo.ray_trainer": (
        Site("apply_kl_penalty", ("data", "kl_ctrl", "kl_penalty"), _kl_in_reward, everywhere=True),
        Site("compute_advantage", ("data", "adv_estimator"), _advantage_then_kl, everywhere=True),
        *(Site(name, params, wrap, owner="RayPPOTrainer") for name, params, wrap in (
            ("_update_actor", ("self", "batch"), _ship_beta), ("_save_checkpoint", ("self",), _save_budgets),
            ("_load_checkpoint", ("self",), _load_budgets))),
    ),
    # the v1 trainer's driver methods (KL budget: beta shipped with each update, its state in the checkpoint)
    "verl.trainer.ppo.v1.trainer_base": tuple(Site(name, params, wrap, owner="PPOTrainer") for name, params, wrap in (
        ("_update_actor", ("self", "batch", "metrics"), _ship_beta), ("_save_checkpoint", ("self",), _save_budgets),
        ("_load_checkpoint", ("self",), _load_budgets))),
    # the TransferQueue trainer's advantage step: it broadcasts GRPO's advantage of each session's final output to
    # every row, overwriting what the inner compute_advantage added, so it is wrapped itself. verl 0.9.x: in the v1
    # trainer's utils; verl 0.8.0 (no v1 package): defined in its TransferQueue trainer module main_ppo_sync
    "verl.trainer.ppo.v1.utils": (
        Site("compute_advantage_for_multi_trajectories", ("data", "batch_keys", "adv_estimator"), _advantage_then_kl,
              everywhere=True),
    ),
    "verl.trainer.main_ppo_sync": (
        Site("compute_advantage_for_multi_trajectories", ("data", "batch_keys", "adv_estimator"), _advantage_then_kl,
              everywhere=True),
    ),
}


def patch(trigger: str) -> None:
    """Wrap the functions of `SITES[trigger]` (idempotent). Refuses verl versions not in versions.TESTED, and functions
    whose signature differs from the tested one of that release, with UnsupportedFrameworkError. Copies made by
    `from <trigger> import name` in verl modules loaded before this call are rebound too (the import-site binding
    pitfall), except kl_penalty and get_policy_loss_fn, which are wrapped only where ppo_loss looks them up. A refused
    KL_ADAPTERS raises its SettingError (`activation.check_environment`).

    Reaching every process: the ``verl.plugins`` entry point (`verl_plugin`) is imported by ``verl/__init__`` in every
    process that imports verl -- driver, TaskRunner, each worker, on every node where kl-adapters is installed -- and
    patches the modules of `SITES` as they are imported. The driver forwards an active KL_ADAPTERS into the Ray job's
    runtime_env (all workers on all nodes, `_forward_env`); workers activate from it at interpreter start (the .pth
    hook).

    Supported: the releases in versions.TESTED["verl"] (0.9.0, 0.9.1; others raise `UnsupportedFrameworkError` naming
    the range). Their KL code paths were diffed, not only tested: 0.9.0 -> 0.9.1 changes none of the functions patched
    here nor agg_loss / kl_penalty (only GSPO's policy-loss aggregation and profiling, outside the KL paths). verl 0.8.0
    differs in four places: get_ppo_ray_runtime_env() takes no config (handled: `Site.params_in`); agg_loss has no
    "token-sum" mode (verl itself raises for it); there is no v1 trainer, its TransferQueue trainer is
    verl.trainer.main_ppo_sync, whose compute_advantage_for_multi_trajectories is wrapped like v1's; and verl/__init__
    does not load ``verl.plugins`` entry points yet (0.9.0 added that), so there only KL_ADAPTERS or
    ``actor_rollout_ref.model.external_lib=kl_adapters.adapters.verl_plugin`` bring the adapter into the workers (a
    ``kl_adapters:`` name alone reaches verl's own kl_penalty, which raises NotImplementedError). main_ppo_sync is one
    of loader.ADAPTERS' triggers, but 0.8.0 stays off the tested list: its usual launch, ``python -m
    verl.trainer.main_ppo_sync``, runs that module as __main__ (never imported under its name, so never patched, in
    the driver or in the TaskRunner Ray ships from it), and its unpatched compute_advantage_for_multi_trajectories
    would then overwrite the KL reward-to-go of GRPO's reward path."""
    activation.check_environment()
    sites = SITES[trigger]
    if trigger == "verl.workers.engine":  # the Megatron engine's sites, where verl.workers.engine could import it
        sites = tuple(site for site in sites if site.module in sys.modules)
    install("verl", require_version("verl"), trigger, sites)


def unpatch() -> None:
    """Restore every verl function this adapter wrapped, in every loaded verl module and wrapped class."""
    uninstall("verl")
