"""verl adapter, loss path: the preset's per-token KL term in verl's ppo_loss (`_kl_per_token`), its batch statistics
from the worker's whole update batch (`_micro_batch_statistics`) and its metrics. The wrappers hand each other their
values through `state.LOSS_CALL` (one ppo_loss call) and `state.UPDATE` (one actor update)."""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import Tensor

from ...reductions import EndOfSequence, KLStatistics, TaskAdvantages
from ...surrogate import kl_statistics, kl_term
from .._guard import UnsupportedFrameworkError
from ..metrics import GRAD_WEIGHT_GAP, IS_ESS, SEQ_KL
from .data_parallel import over_data_parallel_ranks
from .driver import ADVANTAGES_ENV
from .eos import EOS_PROB, IS_EOS, _row_keys
from .flags import PREFIX, _loss_settings, _native_preset
from .kl_budget import _budget_scaled, _kl_coef, _shipped_budget
from .state import EOS_ROWS, LOSS_CALL, UPDATE, Captured, LossCall, Reduction, Update

#: TensorDict key added to the batch an actor worker trains on: each row's index in it, carried by verl into every
#: shuffled mini-batch and micro-batch, so that ppo_loss can look up the rows' batch statistics
_ROW = "kl_adapters_row"


def _capture_policy_loss(get_policy_loss_fn: Callable) -> Callable:
    """Wrap the policy loss ppo_loss looks up so that, inside a ppo_loss call (`state.LOSS_CALL`), it records the
    tensors of this call (keyword arguments, as losses.ppo_loss passes them) when a preset applies to this actor
    config."""

    def patched(name):
        policy_loss_fn = get_policy_loss_fn(name)

        def policy_loss(*args, **kwargs):
            config, call = kwargs.get("config"), LOSS_CALL.get()
            settings = None if config is None or call is None else _loss_settings(config)
            if call is not None:
                call.captured = None if settings is None else Captured(
                    settings, kwargs["log_prob"], kwargs["old_log_prob"], kwargs["response_mask"].bool(),
                    kwargs.get("rollout_is_weights"), _native_preset(config.kl_loss_type), call.rows,
                    kwargs["advantages"], _kl_coef(config), call.reduction)
            return policy_loss_fn(*args, **kwargs)

        return policy_loss

    return patched


def _kl_term(original: Callable) -> Callable:
    """Wrap ppo_loss's kl_penalty: the preset's per-token KL term for the captured tensors (`_kl_per_token`).
    Only verl.workers.utils.losses' own global is wrapped: core_algos' kl_penalty, used by the reward path and
    distillation, is untouched."""

    def patched(logprob, ref_logprob, kl_penalty):  # verl's parameter names: ppo_loss passes them by keyword
        call = LOSS_CALL.get()
        captured = None if call is None else call.captured
        if captured is None:
            if isinstance(kl_penalty, str) and kl_penalty.startswith(PREFIX):
                raise UnsupportedFrameworkError(
                    f"kl_penalty({kl_penalty!r}) was called outside verl's ppo_loss with use_kl_loss=True, the only "
                    "path kl-adapters supports for its estimator names")
            return original(logprob, ref_logprob, kl_penalty)
        if logprob is not captured.log_prob:
            raise UnsupportedFrameworkError("verl's ppo_loss passed kl_penalty other log-probs than its policy loss; "
                                            "this verl code path is not the one kl-adapters is tested with")
        call.captured = None
        term, call.metrics = _kl_per_token(captured, ref_logprob)
        return _budget_scaled(term, call.metrics)

    return patched


def _kl_per_token(c: Captured, ref_log_prob: Tensor) -> tuple[Tensor, dict]:
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
    kl = kl_term(c.log_prob, ref_log_prob, mask, preset=c.settings.spec, old_logp=c.old_log_prob,
                 is_clip=c.settings.is_clip, **_reduction_kwargs(c))
    coef, seq_kl, lp = kl.coefficients, kl.sequence_kl, kl.logp
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    term = seq_kl[:, None] * mask / lengths + coef * (lp - lp.detach())
    if c.rollout_is_weights is not None:
        term = term * c.rollout_is_weights.detach().to(term.dtype)
    metrics = {SEQ_KL: seq_kl.mean().item(), IS_ESS: kl.is_ess.item()}
    if c.native is not None:
        metrics[GRAD_WEIGHT_GAP] = kl.grad_weight_gap(c.native, on_policy=True).item()
    return term, {k: Metric(AggregationType.MEAN, v) for k, v in metrics.items()}


def _reduction_kwargs(c: Captured) -> dict:
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
               ppo_loss. The EOS ids are the engine's generation config's and tokenizer's (`eos_token_ids`). The
               Megatron engine: the same from its vocab-parallel LM-head logits (`megatron`). Other engines add
               nothing: no termination control variate there."""
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
    """Wrap ppo_loss: bind its `LossCall` (the micro-batch's `_ROW` indices if tagged, its `_reduction_inputs`, ...)
    for the call, and add the kl_adapters/* metrics of its KL term."""

    def patched(config, model_output, data, *args, **kwargs):
        call = LossCall(budget=_shipped_budget(config, data), rows=data[_ROW] if _ROW in data.keys() else None,
                        dp_group=args[0] if args else kwargs.get("dp_group"),
                        reduction=_reduction_inputs(config, model_output, data))
        with LOSS_CALL.bound(call):
            loss, metrics = ppo_loss(config, model_output, data, *args, **kwargs)
        if call.metrics:
            metrics.update(call.metrics)
        return loss, metrics

    return patched


def _reduction_inputs(config, model_output, data) -> Reduction | None:
    """The micro-batch's `Reduction` when this actor config selects a reduced preset, else None (nothing is read).
    model_output's EOS_PROB / IS_EOS go through verl's own no_padding_2_padding, as ppo_loss turns "log_probs" into
    log_prob; the horizon is verl's max_response_len (`_horizon`)."""
    settings = _loss_settings(config)
    if settings is None or not settings.spec.uses_batch_statistics:
        return None
    eos = None
    if EOS_PROB in model_output:
        from verl.workers.utils.padding import no_padding_2_padding

        prob = no_padding_2_padding(model_output[EOS_PROB], data)
        is_eos = no_padding_2_padding(model_output[IS_EOS].to(prob.dtype), data) > 0.5
        eos = EndOfSequence(prob, is_eos, _horizon(data, prob.shape[1]))
    return Reduction(eos=eos, group=_group_ids(data, "cpu"))


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
            UPDATE.replace(Update(tensordict))
        return make_iterator(tensordict, *args, **kwargs)

    return patched


def _micro_batch_statistics(c: Captured, with_eos: bool) -> KLStatistics:
    """The reduced presets' statistics of a micro-batch's rows, computed once per actor update from the worker's whole
    batch: kl_statistics(old_log_probs, ref_log_prob, response_mask, preset, group=uid when verl passes it,
    task=`_task`(advantages, kl_loss_coef), eos=the batch's end-of-sequence probabilities from
    the worker's last compute_log_prob pass (`_stored_eos`) when this forward has them too), i.e. from the OTHER
    rows only (leave-one-out), so the gradient stays unbiased whatever the current policy (reductions.py). Cropped to
    the micro-batch's padded width (rows are left-aligned).

    verl's actor micro-batches are small (``ppo_micro_batch_size_per_gpu``, e.g. 1-8 sequences), so the leave-one-out
    statistics (`kl_statistics`) come from the whole batch the actor workers train on in one update: all data-parallel
    shards of the rollout batch (`over_data_parallel_ranks`). `_tag_rows` wraps verl's tensordict_utils.make_iterator (the split into shuffled
    mini-batches) to tag each row with its index; ppo_loss's micro-batch carries the tags, and this function computes
    the statistics once per update from the behaviour log-probs (old_log_probs, no extra forward pass), the batch's
    advantages and uid, and the end-of-sequence probabilities that compute_log_prob's forward (the one that made
    old_log_probs) left in the worker (`_keep_eos_rows`, looked up by each row's tokens), and hands each micro-batch
    its rows' (tests/verl/test_loss_path.py::test_statistics_of_the_workers_batch_reach_each_shuffled_micro_batch;
    through the FSDP2 engine, compute_log_prob included: tests/verl/test_engine.py). ppo_loss called outside such an
    update uses its own batch's statistics (tests/verl/test_loss_path.py::test_task_group_and_eos_reach_the_core). On
    the reward path the statistics are computed on the whole rollout batch within each uid group, with the advantages
    of the KL-free scores (`_advantage_then_kl`)."""
    update, call = UPDATE.get(), LOSS_CALL.get()
    if update is None or update.statistics is None:
        batch = None if update is None else update.batch
        if batch is None:
            raise UnsupportedFrameworkError("ppo_loss received kl_adapters row indices but no actor batch was tagged "
                                            "in this worker thread: this verl code path is not the tested one")
        fields = [k for k in ("old_log_probs", "ref_log_prob", "response_mask", "advantages") if k in batch.keys()]
        padded = dict(batch.select(*fields).to_padded_tensor().items())
        width = padded["response_mask"].shape[1]
        eos = _stored_eos(batch, width) if with_eos else None
        padded.update(eos=eos, uid=batch.get("uid") if "uid" in batch.keys() else None)
        padded, own = over_data_parallel_ranks(padded, call.dp_group)
        mask = padded["response_mask"].bool()
        statistics = kl_statistics(padded["old_log_probs"], padded["ref_log_prob"], mask, preset=c.settings.spec,
                                   group=_group_ids(padded, mask.device), eos=padded["eos"],
                                   task=_task(padded.get("advantages"), c.kl_loss_coef))
        update.statistics, update.batch = statistics[own].with_width(width), None
    rows = c.rows
    return update.statistics[rows.to(update.statistics.cv_coef.device)].with_width(
        c.response_mask.shape[1]).to(rows.device)


def _group_ids(batch, device) -> Tensor | None:
    """[B] integer ids of verl's "uid" column (the GRPO prompt group), or None where the batch does not carry it."""
    if "uid" not in batch.keys() or batch.get("uid") is None:
        return None
    import numpy as np
    import torch

    values = batch.get("uid")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    inverse = np.unique(np.asarray(values, dtype=object), return_inverse=True)[1]
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)


def _stored_eos(batch, width: int) -> EndOfSequence | None:
    """The end-of-sequence probabilities of the worker's tagged batch, looked up row by row in `EOS_ROWS` (emptied
    afterwards) and put in old_log_probs' padded layout by verl's no_padding_2_padding; None unless every row is there
    (no compute_log_prob pass: bypass mode, fused kernels, another engine). Any values keep the gradient exact: the
    statistics read only the other rows'."""
    import torch
    import torch.nn.functional as F
    from verl.workers.utils.padding import no_padding_2_padding

    keys = (_row_keys(batch["input_ids"], batch.get("multi_modal_inputs", None)) if "input_ids" in batch.keys()
            else None)
    found = EOS_ROWS.take(keys or [])
    if not found or any(row is None for row in found):
        return None
    device = batch["response_mask"].device
    prob, is_eos = (no_padding_2_padding(torch.cat([row[i].to(device, torch.float32) for row in found]), batch)
                    for i in (0, 1))
    pad = (0, width - prob.shape[1])  # negative: crop
    return EndOfSequence(F.pad(prob, pad), F.pad(is_eos, pad) > 0.5, _horizon(batch, width))
