"""verl adapter: the chosen preset's exact KL gradient in verl's actor loss, and the exact KL reward path.

Supported: versions.TESTED["verl"] (0.9.0, 0.9.1; others raise `UnsupportedFrameworkError` naming the range); what
differs between releases and why 0.8.0 is refused: `patch`. Flag (`flag_settings`, verl's estimator-name fields):
``actor_rollout_ref.actor.kl_loss_type=kl_adapters:<preset>`` (actor KL loss) or
``algorithm.kl_penalty=kl_adapters:reward`` (KL in the reward), or ``KL_ADAPTERS=<preset>`` for whichever path is on;
with neither, every wrapper runs verl's own function unchanged. Every process is reached by the ``verl.plugins`` entry
point (`verl_plugin`) and the Ray job's runtime_env (`patch`).

What is patched (attribute -> wrapper, `SITES`; name-import sites already loaded are rebound too, see `patch`):
    verl.workers.utils.losses.get_policy_loss_fn   `_capture_policy_loss`: the tensors ppo_loss hands its policy loss
    verl.workers.utils.losses.kl_penalty           `_kl_term`: the KL term of ppo_loss (core_algos' is untouched)
    verl.workers.utils.losses.ppo_loss             `_with_metrics`: kl_adapters/* metrics, the reduced presets' inputs
    verl.utils.tensordict_utils.make_iterator      `_tag_rows`: the rows of the batch an actor update trains on
    verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits, FSDPEngineWithLMHead.prepare_model_outputs,
    verl.workers.engine_workers.TrainingWorker.infer_batch    `_record_eos`, `_eos_outputs`, `_keep_eos_rows`:
                                                   pi(EOS | y_<t) from the forward's own logits
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

import functools
import inspect
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from .. import activation, native
from ..activation import ENV_VAR, Settings, parse
from ..budget import BETA_METRIC, TARGET_METRIC, KLBudget, check_budget_preset
from ..presets import get_preset
from ..reductions import EndOfSequence, KLStatistics, TaskAdvantages
from ..surrogate import kl_coefficients, kl_statistics, kl_term, sequence_kl
from ._guard import UnsupportedFrameworkError, refuse_untested_path, require_version
from .versions import supported_range

#: verl estimator names starting with this select a preset: "kl_adapters:<KL_ADAPTERS value>"
PREFIX = "kl_adapters:"
_ORIGINAL = "__kl_adapters_original__"
#: DataProto.meta_info key: the KL beta handed from apply_kl_penalty to the advantage step
_REWARD_BETA = "kl_adapters/reward_beta"
#: DataProto.meta_info key: the reward-path preset ("reward" or "reward-plain"), handed along with the beta
_REWARD_PRESET = "kl_adapters/reward_preset"
#: presets the reward path implements (a detached KL reward-to-go in the advantages)
_REWARD_PRESETS = ("reward", "reward-plain")
#: TensorDict key added to the batch an actor worker trains on: each row's index in it, carried by verl into every
#: shuffled mini-batch and micro-batch, so that ppo_loss can look up the rows' batch statistics
_ROW = "kl_adapters_row"
#: model_output keys beside verl's "log_probs", in its layout: pi(EOS | y_<t) of the forward that made them (float) and
#: whether y_t is an end-of-sequence token (bool); added by the FSDP engine's forward when a reduced preset is on
EOS_PROB, IS_EOS = "kl_adapters_eos_prob", "kl_adapters_is_eos"
#: advantage estimators whose advantages are only shifted by a mean over rows that include the row (GRPO without
#: norm_adv_by_std_in_grpo, RLOO): TaskAdvantages(normalized=False); every other one is taken as std-normalized
_SHIFT_ONLY = ("rloo", "rloo_vectorized")
#: set by the driver in the Ray job's env_vars (`_with_advantage_scaling`): "normalized" or "shifted" (`_task`)
ADVANTAGES_ENV = "KL_ADAPTERS_VERL_ADVANTAGES"

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


# ----------------------------------------------------------------------------------------------- flag resolution


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
    if get_preset(settings.preset).needs_full_logits:
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
    if loss or reward:
        _check_tested_path(actor)
    return ("loss", loss) if loss else ("reward", reward) if reward else None


def _check_tested_path(actor) -> None:
    """Refuse (`refuse_untested_path`) the actor settings whose code path no test runs: Ulysses sequence parallelism
    (verl shards each packed sequence and exchanges it inside flash-attention's forward, which needs CUDA). The FSDP
    engine's remove-padding and dynamic batch size are tested (tests/verl/test_coverage_engine.py)."""
    sizes = (actor.get("ulysses_sequence_parallel_size", 1),
             (actor.get("fsdp_config") or {}).get("ulysses_sequence_parallel_size", 1))
    sp = max((size for size in sizes if isinstance(size, int)), default=1)  # the doctor: unresolved values are text
    if sp > 1:
        refuse_untested_path(f"kl-adapters is not tested with actor_rollout_ref.actor.ulysses_sequence_parallel_size="
                             f"{sp} (Ulysses exchanges sequence shards inside flash-attention, which the CPU tests "
                             "cannot run)")


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


# ----------------------------------------------------------------------------------------------------- loss path


@dataclass(frozen=True)
class _Reduction:
    """What the reduced presets take from ppo_loss's micro-batch beside the tensors its policy loss receives."""

    eos: EndOfSequence | None  # pi(EOS | y_<t) of this forward (model_output's EOS_PROB), padded like log_prob
    group: Tensor | None  # [B] ids of verl's "uid" (the GRPO prompt group), when the micro-batch carries it


@dataclass(frozen=True)
class _Captured:
    """The tensors ppo_loss passes to its policy loss, for the KL term that follows it in the same call."""

    settings: Settings
    log_prob: Tensor
    old_log_prob: Tensor
    response_mask: Tensor
    rollout_is_weights: Tensor | None
    native: str | None  # preset with the gradient of verl's own kl_loss_type, if one has it
    rows: Tensor | None  # the micro-batch's row indices in the worker's batch (`_ROW`), if verl's update tagged them
    advantages: Tensor  # [B, T] the advantages ppo_loss hands its policy loss
    kl_loss_coef: float
    reduction: _Reduction | None  # None for the presets without batch statistics


#: per thread (one actor update and one ppo_loss call at a time): .captured (_Captured | None), .metrics (dict | None),
#: .rows (this ppo_loss call's `_ROW` indices), .reduction (its `_Reduction`), .batch (the worker's tagged batch until
#: its statistics are computed), .statistics (KLStatistics of that batch); and, inside one forward of the FSDP engine,
#: .eos_ids / .eos_record / .eos_pending (`_eos_outputs`)
_local = threading.local()


def _native_preset(kl_loss_type: str) -> str | None:
    """The preset with the gradient of verl's own estimator (`native.verl_loss`; low_var_kl for kl_adapters: names)."""
    return native.verl_loss("low_var_kl" if kl_loss_type.startswith(PREFIX) else kl_loss_type).preset


def _capture_policy_loss(get_policy_loss_fn: Callable) -> Callable:
    """Wrap the policy loss ppo_loss looks up so that it records the tensors of this call (keyword arguments, as
    losses.ppo_loss passes them) when a preset applies to this actor config."""

    def patched(name):
        policy_loss_fn = get_policy_loss_fn(name)

        def policy_loss(*args, **kwargs):
            config = kwargs.get("config")
            settings = None if config is None else _loss_settings(config)
            _local.captured = None if settings is None else _Captured(
                settings, kwargs["log_prob"], kwargs["old_log_prob"], kwargs["response_mask"].bool(),
                kwargs.get("rollout_is_weights"), _native_preset(config.kl_loss_type), getattr(_local, "rows", None),
                kwargs["advantages"], _kl_coef(config), getattr(_local, "reduction", None))
            return policy_loss_fn(*args, **kwargs)

        return policy_loss

    return patched


def _kl_term(original: Callable) -> Callable:
    """Wrap ppo_loss's kl_penalty: the preset's per-token KL term for the captured tensors (`_kl_per_token`).
    Only verl.workers.utils.losses' own global is wrapped: core_algos' kl_penalty, used by the reward path and
    distillation, is untouched."""

    def patched(logprob, ref_logprob, kl_penalty):  # verl's parameter names: ppo_loss passes them by keyword
        captured, _local.captured = getattr(_local, "captured", None), None
        if captured is None:
            if isinstance(kl_penalty, str) and kl_penalty.startswith(PREFIX):
                raise UnsupportedFrameworkError(
                    f"kl_penalty({kl_penalty!r}) was called outside verl's ppo_loss with use_kl_loss=True, the only "
                    "path kl-adapters supports for its estimator names")
            return original(logprob, ref_logprob, kl_penalty)
        if logprob is not captured.log_prob:
            raise UnsupportedFrameworkError("verl's ppo_loss passed kl_penalty other log-probs than its policy loss; "
                                            "this verl code path is not the one kl-adapters is tested with")
        term, _local.metrics = _kl_per_token(captured, ref_logprob)
        return _budget_scaled(term, _local.metrics)

    return patched


def _kl_per_token(c: _Captured, ref_log_prob: Tensor) -> tuple[Tensor, dict]:
    """Per-token KL term for verl's agg_loss: gradient w_t * c_t * grad log_prob_t, value = the sequence's
    (importance-weighted) KL estimate spread evenly over its tokens. Zero at padding. Also returns the metrics.
    The reduced presets' inputs: `_reduction_kwargs`.

    Actor loss: ppo_loss adds ``kl_loss_coef * agg_loss(kld, response_mask, loss_agg_mode, **global batch info)``.
    The adapter's kld has per-token gradient ``w_t * c_t * grad log_prob_t`` (c = the preset's weight,
    `kl_coefficients`, behaviour log-probs ``old_log_probs``; w = verl's ``rollout_is_weights`` when present, else 1),
    so the KL goes through verl's own aggregation and ``kl_loss_coef`` keeps its strength relative to the task loss.
    Without rollout IS weights the added gradient is that of
        kl_surrogate(log_prob, ref_log_prob, response_mask, preset=p, old_logp=old_log_probs, beta=kl_loss_coef * B / D)
    with B the micro-batch's sequences and D agg_loss's divisor: batch_num_tokens / dp_size (token-mean; this is
    ``per_sequence_beta(kl_loss_coef, mask, "token-mean", num_tokens=batch_num_tokens / dp_size)``), global_batch_size /
    dp_size (seq-mean-token-sum; times loss_scale_factor or the padded length for -norm), 1 / dp_size (token-sum)
    (tests/verl/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate and
    ::test_micro_batch_keeps_verls_normaliser). Sequence-level ``rollout_is_weights`` (verl's default
    rollout_is="sequence") weight each sequence's term, which keeps it unbiased under the rollout policy up to their
    truncation (and batch normalisation); token-level ones weight each token, as verl does for its policy loss (biased,
    as there). kld's value is the importance-weighted sequence KL estimate spread evenly over the sequence's tokens, so
    verl's ``actor/kl_loss`` reads as a KL (token-mean: per token; seq-mean-token-sum: per sequence).
    ``seq-mean-token-mean`` is refused (`check_loss_settings`).

    Metrics added beside verl's: ``kl_adapters/seq_kl`` (mean per-sequence KL estimate; on the reward path too,
    `_kl_in_reward`), ``kl_adapters/is_ess`` (effective sample size of the per-decision importance weights, 1
    on-policy: `KLTerm.is_ess`), ``kl_adapters/grad_weight_gap`` = sum|c_native - c_preset| / sum|c_preset| (c_native:
    the per-token weight of verl's own ``kl_loss_type``, verl's default low_var_kl for kl_adapters: names, ignoring its
    +-10 clamp; 0 = no difference)."""
    from verl.utils.metric import AggregationType, Metric

    mask = c.response_mask
    kl = kl_term(c.log_prob, ref_log_prob, mask, preset=c.settings.preset, old_logp=c.old_log_prob,
                 is_clip=c.settings.is_clip, **_reduction_kwargs(c))
    coef, seq_kl, lp = kl.coefficients, kl.sequence_kl, kl.logp
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    term = seq_kl[:, None] * mask / lengths + coef * (lp - lp.detach())
    if c.rollout_is_weights is not None:
        term = term * c.rollout_is_weights.detach().to(term.dtype)
    metrics = {"kl_adapters/seq_kl": seq_kl.mean().item(), "kl_adapters/is_ess": kl.is_ess.item()}
    if c.native is not None:
        native = kl.coefficients_of(c.native, on_policy=True)
        gap = (native - coef).abs().sum() / coef.abs().sum().clamp(min=1e-30)
        metrics["kl_adapters/grad_weight_gap"] = gap.item()
    return term, {k: Metric(AggregationType.MEAN, v) for k, v in metrics.items()}


def _reduction_kwargs(c: _Captured) -> dict:
    """kl_term's statistics inputs for the reduced presets ({} for the others). The trainer's gradient per token is
    (A_t - kl_loss_coef c_t) grad log pi_t whatever loss_agg_mode (verl aggregates both terms alike), so the task is
    TaskAdvantages(advantages, kl_loss_coef, normalized=`_task`: how the algorithm scaled them).
    Tagged rows (an actor update): the statistics of the worker's whole batch (`_micro_batch_statistics`) and this
    forward's eos; ppo_loss on its own: statistics of this micro-batch, within its uid groups, with its eos.
    Pinned by tests/verl/test_loss_path.py::test_task_group_and_eos_reach_the_core and
    ::test_statistics_of_the_workers_batch_reach_each_shuffled_micro_batch.

    Batch statistics (the variance-reduced ``sequence`` / ``reward``), fitted to the trainer's task + KL gradient
    (reductions.py). What the core receives on the loss path:
        task   TaskAdvantages(advantages, kl_loss_coef, normalized): ppo_loss's advantages (its per-token weight is
               A_t - kl_loss_coef c_t whatever loss_agg_mode); normalized unless the driver's runtime_env says
               "shifted" (`ADVANTAGES_ENV`, from algorithm.adv_estimator / norm_adv_by_std_in_grpo:
               `advantage_scaling`), since the workers never see the algorithm config
        group  verl's ``uid`` (the GRPO prompt group: the rows sharing the advantages' normalisation)
        eos    EndOfSequence(pi(EOS | y_<t) of the current policy, responses == an EOS id, max_response_len): the
               termination control variate. The FSDP engine's forward already makes the logits; `_record_eos` reads
               pi(EOS) beside verl's logprobs_from_logits with two gathers per token (log pi(v) = z_v - z_y +
               log pi(y)), and `_eos_outputs` puts it into model_output (EOS_PROB / IS_EOS, log_probs' layout) for
               ppo_loss. The EOS ids are the engine's generation config's and tokenizer's (`eos_token_ids`). Other
               engines (Megatron, ...) add nothing: no termination control variate there."""
    if c.reduction is None:
        return {}
    eos = c.reduction.eos
    if c.rows is not None:
        return {"statistics": _micro_batch_statistics(c, eos is not None), "eos": eos}
    group = None if c.reduction.group is None else c.reduction.group.to(c.log_prob.device)
    return {"group": group, "eos": eos, "task": _task(c.advantages, c.kl_loss_coef)}


def _task(advantages: Tensor | None, kl_loss_coef: float) -> TaskAdvantages | None:
    """The loss path's task term (`_reduction_kwargs`): normalized unless the driver told the workers the advantages
    are only shifted (ADVANTAGES_ENV, `_with_advantage_scaling`); None without advantages or with kl_loss_coef 0."""
    if advantages is None or kl_loss_coef <= 0:
        return None
    return TaskAdvantages(advantages, kl_loss_coef, normalized=os.environ.get(ADVANTAGES_ENV) != "shifted")


def _with_metrics(ppo_loss: Callable) -> Callable:
    """Wrap ppo_loss: start each call with no captured tensors, the micro-batch's `_ROW` indices (if tagged) and its
    `_reduction_inputs`, and add the kl_adapters/* metrics of its KL term."""

    def patched(config, model_output, data, *args, **kwargs):
        _local.captured = _local.metrics = None
        _local.budget = _shipped_budget(config, data)
        _local.rows = data[_ROW] if _ROW in data.keys() else None
        _local.reduction = _reduction_inputs(config, model_output, data)
        loss, metrics = ppo_loss(config, model_output, data, *args, **kwargs)
        extra, _local.metrics = getattr(_local, "metrics", None), None
        if extra:
            metrics.update(extra)
        return loss, metrics

    return patched


def _reduction_inputs(config, model_output, data) -> _Reduction | None:
    """The micro-batch's `_Reduction` when this actor config selects a reduced preset, else None (nothing is read).
    model_output's EOS_PROB / IS_EOS go through verl's own no_padding_2_padding, as ppo_loss turns "log_probs" into
    log_prob; the horizon is verl's max_response_len (`_horizon`)."""
    settings = _loss_settings(config)
    if settings is None or not get_preset(settings.preset).uses_batch_statistics:
        return None
    eos = None
    if EOS_PROB in model_output:
        from verl.workers.utils.padding import no_padding_2_padding

        prob = no_padding_2_padding(model_output[EOS_PROB], data)
        is_eos = no_padding_2_padding(model_output[IS_EOS].to(prob.dtype), data) > 0.5
        eos = EndOfSequence(prob, is_eos, _horizon(data, prob.shape[1]))
    return _Reduction(eos=eos, group=_group_ids(data, "cpu"))


def _horizon(data, width: int) -> int:
    """The longest response verl's rollout may produce: the max_response_len that left_right_2_no_padding records (the
    rollout's padded response length), else the padded width of data["responses"]. Never the micro-batch's own
    longest response, which would make the termination control variate read the row's own length (biased)."""
    from verl.utils import tensordict_utils as tu

    horizon = tu.get_non_tensor_data(data=data, key="max_response_len", default=None)
    if horizon is None and "responses" in data.keys() and not data["responses"].is_nested:
        horizon = data["responses"].shape[1]
    if horizon is None or int(horizon) < width:
        raise UnsupportedFrameworkError(f"ppo_loss's batch gives no maximum response length >= its width {width} "
                                        "(max_response_len, or padded responses): this verl code path is not the "
                                        "tested one")
    return int(horizon)


def _tag_rows(make_iterator: Callable) -> Callable:
    """Wrap verl's tensordict_utils.make_iterator, with which TrainingWorker.train_mini_batch splits the batch an actor
    worker trains on (its data-parallel shard of the whole rollout batch, every PPO epoch) into shuffled mini-batches,
    that the engine splits into micro-batches for ppo_loss. A batch holding the KL loss's inputs gets a `_ROW` column
    (its row indices; verl slices and shuffles it with the rows) and is kept until ppo_loss first needs its statistics
    (a batch split again is tagged again and gets fresh statistics). ppo_loss reads only the fields it selects, so the
    extra column changes no output of verl's own code."""

    def patched(tensordict, *args, **kwargs):
        if {"old_log_probs", "ref_log_prob", "response_mask"} <= set(tensordict.keys()):
            import torch

            tensordict[_ROW] = torch.arange(tensordict.batch_size[0])
            _local.batch, _local.statistics = tensordict, None
        return make_iterator(tensordict, *args, **kwargs)

    return patched


def _micro_batch_statistics(c: _Captured, with_eos: bool) -> KLStatistics:
    """The reduced presets' statistics of a micro-batch's rows, computed once per actor update from the worker's whole
    batch: kl_statistics(old_log_probs, ref_log_prob, response_mask, preset, group=uid when verl passes it,
    task=`_task`(advantages, kl_loss_coef), eos=the batch's end-of-sequence probabilities from
    the worker's last compute_log_prob pass (`_stored_eos`) when this forward has them too), i.e. from the OTHER
    rows only (leave-one-out), so the gradient stays unbiased whatever the current policy (reductions.py). Cropped to
    the micro-batch's padded width (rows are left-aligned).

    verl's actor micro-batches are small (``ppo_micro_batch_size_per_gpu``, e.g. 1-8 sequences), so the leave-one-out
    statistics (`kl_statistics`) come from the whole batch an actor worker trains on in one update: its data-parallel
    shard of the rollout batch. `_tag_rows` wraps verl's tensordict_utils.make_iterator (the split into shuffled
    mini-batches) to tag each row with its index; ppo_loss's micro-batch carries the tags, and this function computes
    the statistics once per update from the behaviour log-probs (old_log_probs, no extra forward pass), the batch's
    advantages and uid, and the end-of-sequence probabilities that compute_log_prob's forward (the one that made
    old_log_probs) left in the worker (`_keep_eos_rows`, looked up by each row's tokens), and hands each micro-batch
    its rows' (tests/verl/test_loss_path.py::test_statistics_of_the_workers_batch_reach_each_shuffled_micro_batch;
    through the FSDP2 engine, compute_log_prob included: tests/verl/test_engine.py). ppo_loss called outside such an
    update uses its own batch's statistics (tests/verl/test_loss_path.py::test_task_group_and_eos_reach_the_core). On
    the reward path the statistics are computed on the whole rollout batch within each uid group, with the advantages
    of the KL-free scores (`_advantage_then_kl`)."""
    if getattr(_local, "statistics", None) is None:
        batch = getattr(_local, "batch", None)
        if batch is None:
            raise UnsupportedFrameworkError("ppo_loss received kl_adapters row indices but no actor batch was tagged "
                                            "in this worker thread: this verl code path is not the tested one")
        fields = [k for k in ("old_log_probs", "ref_log_prob", "response_mask", "advantages") if k in batch.keys()]
        padded = batch.select(*fields).to_padded_tensor()
        mask = padded["response_mask"].bool()
        eos = _stored_eos(batch, mask.shape[1]) if with_eos else None
        statistics = kl_statistics(padded["old_log_probs"], padded["ref_log_prob"], mask, preset=c.settings.preset,
                                   group=_group_ids(batch, mask.device), eos=eos,
                                   task=_task(padded["advantages"] if "advantages" in fields else None,
                                              c.kl_loss_coef))
        _local.statistics, _local.batch = statistics, None
    rows = c.rows
    return _local.statistics[rows.to(_local.statistics.cv_coef.device)].with_width(
        c.response_mask.shape[1]).to(rows.device)


def _group_ids(batch, device) -> Tensor | None:
    """[B] integer ids of verl's "uid" column (the GRPO prompt group), or None where the batch does not carry it."""
    if "uid" not in batch.keys():
        return None
    import numpy as np
    import torch

    values = batch.get("uid")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    inverse = np.unique(np.asarray(values, dtype=object), return_inverse=True)[1]
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)


# ------------------------------------------------------------------------------------ end-of-sequence probabilities

#: the actor worker's end-of-sequence probabilities from its last compute_log_prob pass (`_keep_eos_rows`): row key
#: (`_row_keys`: its prompt + response token ids) -> (pi(EOS | x_<=j), is_eos) over the row's positions in log_probs'
#: layout; read and emptied by the next update's statistics (`_stored_eos`). Process-wide, not per thread: Ray may run
#: compute_log_prob and update_actor on different threads of the worker.
_EOS_ROWS: dict[bytes, tuple[Tensor, Tensor]] = {}


def end_of_sequence_probabilities(logits: Tensor, labels: Tensor, log_probs: Tensor,
                                  eos_ids: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """(pi(EOS | x_<=j) summed over eos_ids, whether labels_j is an EOS id) at every position of one call of verl's
    logprobs_from_logits(logits [..., V] (already at the rollout temperature), labels [...]) -> log_probs [...].

    No second pass over the vocabulary: log_probs = z_label - logsumexp(z), so log pi(v) = z_v - z_label + log_probs
    (two gathers per token), as precise as verl's log-probs (float32; bf16 where verl's fallback computes bf16 logits'
    log_softmax in bf16). Detached, float32. Pinned by tests/verl/test_eos.py::test_eos_probabilities_are_the_softmax
    and, through the FSDP engine against a separate forward, tests/verl/test_engine.py."""
    import torch

    with torch.no_grad():
        z, ids = logits.detach(), torch.as_tensor(eos_ids, device=logits.device)
        shift = log_probs.detach().float() - z.gather(-1, labels[..., None]).squeeze(-1).float()
        prob = torch.exp(z.index_select(-1, ids).float() + shift[..., None]).sum(-1).clamp(max=1.0)
        return prob, torch.isin(labels, ids)


def eos_token_ids(model_config) -> tuple[int, ...]:
    """The end-of-sequence ids verl's rollout stops at, from the engine's HFModelConfig: its generation config's
    eos_token_id (an id or a list) and its tokenizer's eos_token_id. () when neither is set."""
    ids: set[int] = set()
    for value in (getattr(getattr(model_config, "generation_config", None), "eos_token_id", None),
                  getattr(getattr(model_config, "tokenizer", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def _wants_eos(loss_fn) -> bool:
    """Whether a worker's loss function (verl's partial(ppo_loss, config=actor_config)) selects a reduced preset,
    whose termination control variate reads pi(EOS | y_<t)."""
    config = getattr(loss_fn, "keywords", {}).get("config") if loss_fn is not None else None
    if config is None or not hasattr(config, "kl_loss_type"):
        return False
    settings = _loss_settings(config)
    return settings is not None and get_preset(settings.preset).uses_batch_statistics


def _record_eos(logprobs_from_logits: Callable) -> Callable:
    """Wrap the FSDP engine's logprobs_from_logits: while `_eos_outputs` asks for it (_local.eos_ids), also record
    `end_of_sequence_probabilities` of the same logits. Its result is verl's, untouched."""

    def patched(logits, labels, *args, **kwargs):
        log_probs = logprobs_from_logits(logits, labels, *args, **kwargs)
        ids = getattr(_local, "eos_ids", None)
        if ids:
            _local.eos_record = end_of_sequence_probabilities(logits, labels, log_probs, ids)
        return log_probs

    return patched


def _eos_outputs(prepare_model_outputs: Callable) -> Callable:
    """Wrap FSDPEngineWithLMHead.prepare_model_outputs, which turns the model's logits into model_output["log_probs"]:
    in the actor's training forward under a reduced preset (its loss function, passed here as
    logits_processor_func, `_wants_eos`), add model_output[EOS_PROB] / [IS_EOS] in log_probs' layout; in an armed
    compute_log_prob pass (`_keep_eos_rows`), keep them per row instead. Nothing else changes; with no reduced preset
    verl's method runs alone. No second forward: `_record_eos` reads the logits this forward already made. Only the
    FSDP engine is wrapped: other engines (Megatron, ...) add nothing, so no termination control variate there."""

    def patched(self, output, output_args, micro_batch, logits_processor_func, *args, **kwargs):
        pending = getattr(_local, "eos_pending", None)
        ids = eos_token_ids(self.model_config) if pending is not None or _wants_eos(logits_processor_func) else ()
        if not ids:
            return prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func, *args, **kwargs)
        _local.eos_ids, _local.eos_record = ids, None
        try:
            model_output = prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func,
                                                 *args, **kwargs)
        finally:
            record, _local.eos_ids, _local.eos_record = _local.eos_record, None, None
        if record is None or model_output.get("log_probs") is None:  # fused kernels: verl made no logits here
            return model_output
        prob, is_eos = _like_log_probs(self, record, model_output["log_probs"], output_args)
        if pending is None:
            model_output[EOS_PROB], model_output[IS_EOS] = prob, is_eos
        else:
            pending.update(zip(_row_keys(micro_batch["input_ids"]), zip(prob.unbind(), is_eos.unbind())))
        return model_output

    return patched


def _like_log_probs(engine, record: tuple[Tensor, Tensor], log_probs: Tensor, output_args: dict):
    """The recorded (prob, is_eos) of `_record_eos` in the layout of model_output["log_probs"]: verl's own
    _gather_and_unpad_packed where the record still holds the packed padding (or a sequence-parallel shard), then
    log_probs' nested offsets."""
    import torch

    packed = torch.stack((record[0], record[1].to(record[0].dtype)), -1).reshape(-1, 2)
    values = log_probs.values() if log_probs.is_nested else log_probs
    if packed.shape[0] != values.shape[0]:
        packed = engine._gather_and_unpad_packed(packed, output_args.get("pad_size", 0))
    if packed.shape[0] != values.shape[0]:
        raise UnsupportedFrameworkError(f"verl's engine made {values.shape[0]} log-probs from logits at "
                                        f"{packed.shape[0]} positions: this verl code path is not the tested one")
    prob, is_eos = packed[:, 0].contiguous(), packed[:, 1] > 0.5
    if not log_probs.is_nested:
        return prob, is_eos
    offsets = log_probs.offsets()
    return (torch.nested.nested_tensor_from_jagged(prob, offsets),
            torch.nested.nested_tensor_from_jagged(is_eos, offsets))


def _row_keys(input_ids: Tensor) -> list[bytes]:
    """One key per row of a nested [B, j] tensor of token ids: a digest of the row's ids (rows with the same tokens
    have the same end-of-sequence probabilities under the same policy)."""
    import hashlib

    values, offsets = input_ids.values().cpu().numpy(), input_ids.offsets().tolist()
    return [hashlib.blake2b(values[a:b].tobytes(), digest_size=16).digest() for a, b in zip(offsets, offsets[1:])]


def _keep_eos_rows(infer_batch: Callable) -> Callable:
    """Wrap TrainingWorker.infer_batch: for the actor (its loss function `_wants_eos`), outside verl's reference pass
    through the actor (no_lora_adapter), keep each row's end-of-sequence probabilities in `_EOS_ROWS` (replacing the
    previous pass's). That pass is compute_log_prob, which makes old_log_probs: the same forward, no extra cost
    beyond two gathers per token. Its output is verl's, untouched."""

    def patched(self, data, *args, **kwargs):
        from verl.utils import tensordict_utils as tu

        if not _wants_eos(self.loss_fn) or tu.get(data, key="no_lora_adapter", default=False):
            return infer_batch(self, data, *args, **kwargs)
        _local.eos_pending = {}
        try:
            output = infer_batch(self, data, *args, **kwargs)
        finally:
            pending, _local.eos_pending = _local.eos_pending, None
        _EOS_ROWS.clear()
        _EOS_ROWS.update(pending)
        return output

    return patched


def _stored_eos(batch, width: int) -> EndOfSequence | None:
    """The end-of-sequence probabilities of the worker's tagged batch, looked up row by row in `_EOS_ROWS` (emptied
    afterwards) and put in old_log_probs' padded layout by verl's no_padding_2_padding; None unless every row is there
    (no compute_log_prob pass: bypass mode, fused kernels, another engine). Any values keep the gradient exact: the
    statistics read only the other rows'."""
    import torch
    import torch.nn.functional as F
    from verl.workers.utils.padding import no_padding_2_padding

    found = [_EOS_ROWS.get(key) for key in _row_keys(batch["input_ids"])] if "input_ids" in batch.keys() else [None]
    _EOS_ROWS.clear()
    if not found or any(row is None for row in found):
        return None
    device = batch["response_mask"].device
    prob, is_eos = (no_padding_2_padding(torch.cat([row[i].to(device, torch.float32) for row in found]), batch)
                    for i in (0, 1))
    pad = (0, width - prob.shape[1])  # negative: crop
    return EndOfSequence(F.pad(prob, pad), F.pad(is_eos, pad) > 0.5, _horizon(batch, width))


# --------------------------------------------------------------------------------------------------- reward path


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
        data.meta_info[_REWARD_BETA], data.meta_info[_REWARD_PRESET] = beta, settings.preset
        batch = data.batch
        metrics["kl_adapters/seq_kl"] = sequence_kl(batch["old_log_probs"], batch["ref_log_prob"],
                                                    batch["response_mask"]).mean().item()
        if budget is not None:
            metrics.update(budget.metrics())
            budget.observe(metrics["kl_adapters/seq_kl"], 1)
            kl_ctrl.value = budget.update()
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
        preset = data.meta_info.pop(_REWARD_PRESET, "reward")
        if beta is None:
            return compute_advantage(data, *args, **kwargs)
        penalized = data.batch["token_level_rewards"]
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        data = compute_advantage(data, *args, **kwargs)
        batch = data.batch
        mask = batch["response_mask"].bool()
        group = None
        if get_preset(preset).uses_batch_statistics and "uid" in data.non_tensor_batch:
            group = _group_ids({"uid": data.non_tensor_batch["uid"]}, mask.device)
        task = None
        if get_preset(preset).uses_batch_statistics and beta > 0:
            task = TaskAdvantages(batch["advantages"], beta, _normalized_by(compute_advantage, data, args, kwargs))
        coefficients = kl_coefficients(batch["old_log_probs"], batch["ref_log_prob"], mask, preset=preset, group=group,
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


# ------------------------------------------------------------------------------------------------------ KL budget

#: non-tensor key of the actor's update batch (DataProto.meta_info in verl's v0 trainer, KVBatchMeta.extra_info in v1,
#: both non-tensor data of the TensorDict every actor worker trains on): the budget's beta for this update
BETA_KEY = "kl_adapters_beta"
#: the budgets' state in each checkpoint folder (global_step_<n>/, beside verl's data.pt)
BUDGET_FILE = "kl_adapters_budget.json"
#: the driver's metric of the update's sequence-KL estimate (the workers' kl_adapters/seq_kl, as verl collects it)
_SEQ_KL = "actor/kl_adapters/seq_kl"
_BUDGET_ATTR = "_kl_adapters_budget"
_log = logging.getLogger("kl_adapters")


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
        check_budget_preset(loss.preset, loss.is_clip, off_policy=off_policy)
    if reward is not None and reward.kl_target is not None:
        if algo.kl_ctrl.type != "fixed":
            raise ValueError(f"kl_target={reward.kl_target} and algorithm.kl_ctrl.type={algo.kl_ctrl.type} would both "
                             "set the reward's KL coefficient: use algorithm.kl_ctrl.type=fixed with a kl_target")
        if not float(algo.kl_ctrl.kl_coef) > 0:
            raise ValueError(f"kl_target={reward.kl_target} starts from algorithm.kl_ctrl.kl_coef, which is "
                             f"{algo.kl_ctrl.kl_coef}: set it > 0")


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
    budget = getattr(_local, "budget", None)
    return budget[0] if budget is not None else float(config.kl_loss_coef)


def _budget_scaled(term: Tensor, metrics: dict) -> Tensor:
    """ppo_loss multiplies the KL term by kl_loss_coef; under a budget the term is rescaled so that the product is the
    shipped beta times it, and kl_adapters/beta, kl_adapters/kl_target join the metrics."""
    budget = getattr(_local, "budget", None)
    if budget is None:
        return term
    from verl.utils.metric import AggregationType, Metric

    beta, coef, target = budget
    metrics.update({BETA_METRIC: Metric(AggregationType.MEAN, beta), TARGET_METRIC: Metric(AggregationType.MEAN, target)})
    return term * (beta / coef)


def _loss_budget(trainer) -> KLBudget | None:
    """A verl trainer's loss-path budget (driver side), made at first use from its actor config: target = the
    kl_loss_type value's kl_target, initial beta = kl_loss_coef; None without a target."""
    actor = trainer.config.actor_rollout_ref.actor
    settings = _loss_settings(actor)
    if settings is None or settings.kl_target is None:
        return None
    if _BUDGET_ATTR not in trainer.__dict__:
        setattr(trainer, _BUDGET_ATTR, KLBudget(settings.kl_target, float(actor.kl_loss_coef)))
    return getattr(trainer, _BUDGET_ATTR)


def _reward_budget(kl_ctrl, settings: Settings | None) -> KLBudget | None:
    """The reward-path budget, kept on verl's KL controller object (initial beta = its value); None without a target."""
    if settings is None or settings.kl_target is None:
        return None
    if _BUDGET_ATTR not in kl_ctrl.__dict__:
        setattr(kl_ctrl, _BUDGET_ATTR, KLBudget(settings.kl_target, float(kl_ctrl.value)))
    return getattr(kl_ctrl, _BUDGET_ATTR)


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
        budget.observe(sum(values) / len(values), 1)
        budget.update()
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
            for name, budget in budgets.items():
                if name in stored:
                    budget.load_state_dict(stored[name])
                else:
                    _log.warning("kl-adapters: %s holds no %s-path KL budget; it starts from the configured beta %g",
                                 path, name, budget.beta)
        return output

    return patched


# ----------------------------------------------------------------------------------------------- driver helpers


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
    if settings is None or not get_preset(settings.preset).uses_batch_statistics:
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


# ---------------------------------------------------------------------------------------------------- patching


@dataclass(frozen=True)
class _Site:
    """One verl function to wrap: where it lives, its expected leading parameters, and the wrapper factory."""

    name: str
    params: tuple[str, ...]
    wrap: Callable[[Callable], Callable]
    #: also rebind `from module import name` copies in verl modules already loaded (never for kl_penalty and
    #: get_policy_loss_fn: losses' copies are the only ones ppo_loss uses; core_algos' serve other paths)
    everywhere: bool = True
    #: releases whose function has other leading parameters than 0.9.1's: release -> those parameters
    params_in: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: the module holding the function when it is not the trigger itself (one the trigger has imported)
    module: str | None = None
    #: the class of that module whose method this is (wrapped on the class itself; `everywhere` does not apply)
    owner: str | None = None

    def expected_params(self, version: str) -> tuple[str, ...]:
        return self.params_in.get(version, self.params)


#: trigger module -> functions patched when it is imported (the same module names are the "verl" triggers of
#: kl_adapters.activation.ADAPTERS)
SITES: dict[str, tuple[_Site, ...]] = {
    "verl.utils.config": (_Site("validate_config", ("config", "use_reference_policy", "use_critic"), _validate_first),),
    # verl 0.8.0: get_ppo_ray_runtime_env() takes no config (0.9.0 added it for per-engine env vars)
    "verl.trainer.constants_ppo": (_Site("get_ppo_ray_runtime_env", ("config",), _forward_env,
                                         params_in={"0.8.0": ()}),),
    "verl.workers.utils.losses": (
        _Site("get_policy_loss_fn", ("name",), _capture_policy_loss, everywhere=False),
        _Site("kl_penalty", ("logprob", "ref_logprob", "kl_penalty"), _kl_term, everywhere=False),
        _Site("ppo_loss", ("config", "model_output", "data", "dp_group"), _with_metrics),
        _Site("make_iterator", ("tensordict", "mini_batch_size", "epochs"), _tag_rows, everywhere=False,
              module="verl.utils.tensordict_utils"),
    ),
    # pi(EOS | y_<t) from the logits the FSDP engine's forward already makes (the termination control variate)
    "verl.workers.engine.fsdp.transformer_impl": (
        _Site("logprobs_from_logits", ("logits", "labels"), _record_eos, everywhere=False),
        _Site("prepare_model_outputs", ("self", "output", "output_args", "micro_batch", "logits_processor_func"),
              _eos_outputs, owner="FSDPEngineWithLMHead"),
    ),
    "verl.workers.engine_workers": (_Site("infer_batch", ("self", "data"), _keep_eos_rows, owner="TrainingWorker"),),
    "verl.trainer.ppo.ray_trainer": (
        _Site("apply_kl_penalty", ("data", "kl_ctrl", "kl_penalty"), _kl_in_reward),
        _Site("compute_advantage", ("data", "adv_estimator"), _advantage_then_kl),
        *(_Site(name, params, wrap, owner="RayPPOTrainer") for name, params, wrap in (
            ("_update_actor", ("self", "batch"), _ship_beta), ("_save_checkpoint", ("self",), _save_budgets),
            ("_load_checkpoint", ("self",), _load_budgets))),
    ),
    # the v1 trainer's driver methods (KL budget: beta shipped with each update, its state in the checkpoint)
    "verl.trainer.ppo.v1.trainer_base": tuple(_Site(name, params, wrap, owner="PPOTrainer") for name, params, wrap in (
        ("_update_actor", ("self", "batch", "metrics"), _ship_beta), ("_save_checkpoint", ("self",), _save_budgets),
        ("_load_checkpoint", ("self",), _load_budgets))),
    # the TransferQueue trainer's advantage step: it broadcasts GRPO's advantage of each session's final output to
    # every row, overwriting what the inner compute_advantage added, so it is wrapped itself. verl 0.9.x: in the v1
    # trainer's utils; verl 0.8.0 (no v1 package): defined in its TransferQueue trainer module main_ppo_sync
    "verl.trainer.ppo.v1.utils": (
        _Site("compute_advantage_for_multi_trajectories", ("data", "batch_keys", "adv_estimator"), _advantage_then_kl),
    ),
    "verl.trainer.main_ppo_sync": (
        _Site("compute_advantage_for_multi_trajectories", ("data", "batch_keys", "adv_estimator"), _advantage_then_kl),
    ),
}


def _verl_modules() -> list[types.ModuleType]:
    return [m for n, m in list(sys.modules.items()) if (n == "verl" or n.startswith("verl.")) and m is not None]


def _is_ours(fn: object) -> bool:
    return isinstance(fn, types.FunctionType) and _ORIGINAL in fn.__dict__


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
    differs in four places: get_ppo_ray_runtime_env() takes no config (handled: `_Site.params_in`); agg_loss has no
    "token-sum" mode (verl itself raises for it); there is no v1 trainer, its TransferQueue trainer is
    verl.trainer.main_ppo_sync, whose compute_advantage_for_multi_trajectories is wrapped like v1's; and verl/__init__
    does not load ``verl.plugins`` entry points yet (0.9.0 added that), so there only KL_ADAPTERS or
    ``actor_rollout_ref.model.external_lib=kl_adapters.adapters.verl_plugin`` bring the adapter into the workers (a
    ``kl_adapters:`` name alone reaches verl's own kl_penalty, which raises NotImplementedError). main_ppo_sync is one
    of activation.ADAPTERS' triggers, but 0.8.0 stays off the tested list: its usual launch, ``python -m
    verl.trainer.main_ppo_sync``, runs that module as __main__ (never imported under its name, so never patched, in
    the driver or in the TaskRunner Ray ships from it), and its unpatched compute_advantage_for_multi_trajectories
    would then overwrite the KL reward-to-go of GRPO's reward path."""
    activation.check_environment()
    version = require_version("verl")
    for site in SITES[trigger]:
        module = sys.modules[site.module or trigger]
        holder = getattr(module, site.owner) if site.owner else module
        original = vars(holder).get(site.name) if site.owner else getattr(module, site.name, None)
        if _is_ours(original):
            continue
        params = tuple(inspect.signature(original).parameters) if callable(original) else None
        expected = site.expected_params(version)
        if params is None or params[: len(expected)] != expected:
            raise UnsupportedFrameworkError(
                f"verl {version}: {module.__name__}.{'.'.join(filter(None, (site.owner, site.name)))}"
                f"{params or ''} is not the function kl-adapters was tested with ({supported_range('verl')}, "
                f"parameters {expected})")
        wrapper = functools.wraps(original)(site.wrap(original))
        setattr(wrapper, _ORIGINAL, original)
        targets = _verl_modules() if site.everywhere and not site.owner else [holder]
        for target in targets:
            if target is holder or vars(target).get(site.name) is original:
                setattr(target, site.name, wrapper)


def _owners() -> list[type]:
    """The loaded verl classes whose methods `SITES` wraps."""
    return [getattr(sys.modules[site.module or trigger], site.owner) for trigger, sites in SITES.items()
            for site in sites if site.owner and (site.module or trigger) in sys.modules]


def unpatch() -> None:
    """Restore every verl function this adapter wrapped, in every loaded verl module and wrapped class."""
    for holder in [*_verl_modules(), *_owners()]:
        for name, value in list(vars(holder).items()):
            if _is_ours(value):
                setattr(holder, name, getattr(value, _ORIGINAL))
