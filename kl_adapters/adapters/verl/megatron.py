"""verl adapter, Megatron engine: pi(EOS | y_<t) from the logits MegatronEngineWithLMHead's forward already makes, so
that the reduced presets get their termination control variate under ``actor.strategy=megatron`` as under FSDP
(`eos`). Two wrappers, installed only where verl could import its Megatron engine (megatron-core installed):

    MegatronEngineWithLMHead._lm_head_logits_processor   `_record_eos`: beside verl's ``log_probs`` (megatron's
        vocab-parallel cross entropy), ``ret[EOS_PROB]`` / ``ret[IS_EOS]`` in the same [1, tokens] layout, so verl's
        model-forward post-processing (`postprocess_thd_engine` / `postprocess_bshd_engine`: context-parallel gather,
        unpacking to nested rows) turns them into model_output entries in log_probs' layout, where ppo_loss finds them
    MegatronEngineWithLMHead.prepare_model_outputs       `_keep_rows`: in an armed compute_log_prob pass
        (`eos._keep_eos_rows`) the two entries are moved out of model_output into the pass's per-row store, so verl's
        infer_batch output is untouched

Under tensor parallelism the logits are vocab-sharded ([..., V / tp] on each rank, rank r holding ids [r V/tp,
(r + 1) V/tp), megatron's `VocabUtility`). The normaliser is the one verl's log-probs already carry: megatron's
vocab-parallel cross entropy gives log pi(y) = z_y - logsumexp_V(z) over the whole vocabulary, so with z_y and z_EOS
(each held by exactly one rank: gathered there, zero elsewhere, one SUM all-reduce of [tokens, 1 + #EOS ids] over the
tensor-parallel group) log pi(EOS) = z_EOS - z_y + log pi(y) on every rank: two gathers per token, no second pass over
the vocabulary, no second logsumexp. The columns are read before verl divides the logits by the temperature in place
(and before megatron's cross entropy overwrites float32 logits with their softmax, in place), then divided by the same
temperature in the logits' dtype, as verl does: the same numbers verl's log-probs come from (bf16 logits: float32
arithmetic on them, as megatron's cross entropy). Cost: two gathers per token and, under TP > 1, one all-reduce of
[tokens, 1 + #EOS ids] per micro-batch forward. Nothing is read unless the actor's loss selects a reduced preset;
use_fused_kernels (no logits) leaves the statistics without pi(EOS), as under FSDP. Pinned by
tests/verl/test_megatron.py (verl's logits processor at TP 2 and 1 against the softmax of the full logits; verl's
TrainingWorker + Megatron engine at TP 2, packed and padded forwards, against a separate forward and the oracle
update) and, on a GPU, tests/verl/test_gpu.py::test_megatron_actor_update_on_gpu.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .eos import EOS_PROB, IS_EOS, _wants_eos, eos_token_ids, place_eos
from .state import EOS_PENDING

#: the module defining verl's Megatron engine (imported by verl.workers.engine when megatron-core is installed)
MODULE = "verl.workers.engine.megatron.transformer_impl"


def vocab_parallel_columns(logits: Tensor, labels: Tensor, ids: tuple[int, ...]) -> Tensor:
    """[..., 1 + len(ids)] the logits at `labels` and at each EOS id, in the logits' dtype, detached, whole-vocabulary
    ids read from this rank's vocab shard logits [..., V / tp] and summed over megatron's tensor-parallel group (each
    id lives on one rank: exact, even in bf16)."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.utils import VocabUtility

    size = mpu.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = VocabUtility.vocab_range_from_per_partition_vocab_size(part, mpu.get_tensor_model_parallel_rank(),
                                                                   size)[0] if size > 1 else 0
    wanted = torch.cat((labels.unsqueeze(-1), torch.as_tensor(ids, device=labels.device).expand(*labels.shape, -1)),
                       -1).long() - start
    here = (wanted >= 0) & (wanted < part)
    columns = logits.detach().gather(-1, wanted.clamp(0, part - 1)).masked_fill(~here, 0)
    if size > 1:
        torch.distributed.all_reduce(columns, group=mpu.get_tensor_model_parallel_group())
    return columns


def eos_from_columns(columns: Tensor, temperature: Tensor, log_probs: Tensor) -> Tensor:
    """pi(EOS | y_<t) summed over the EOS ids, float32 in [0, 1]: the `vocab_parallel_columns` divided by the
    temperature as verl divides the logits (in their dtype), log pi(EOS) = z_EOS - z_y + log pi(y)."""
    import torch

    with torch.no_grad():
        z = (columns / temperature.unsqueeze(-1).to(columns.dtype)).float()
        log_norm = z[..., 0] - log_probs.detach().float()
        return torch.exp(torch.logsumexp(z[..., 1:], -1) - log_norm).clamp(0.0, 1.0)


def _record_eos(processor: Callable) -> Callable:
    """Wrap MegatronEngineWithLMHead._lm_head_logits_processor: when the actor's loss selects a reduced preset
    (`eos._wants_eos` of its logits_processor_func) or a compute_log_prob pass keeps pi(EOS) (`state.EOS_PENDING`),
    add ret[EOS_PROB] (pi(EOS | y_<t), float32) and ret[IS_EOS] (label is an EOS id, as 0/1 in that dtype) beside
    ret["log_probs"], in its layout. verl's entries are untouched; with no reduced preset verl's method runs alone."""

    def patched(self, logits, label, temperature, *args, **kwargs):
        wanted = EOS_PENDING.get() is not None or _wants_eos(kwargs.get("logits_processor_func"))
        ids = eos_token_ids(self.model_config) if wanted and not kwargs.get("distillation_only") else ()
        if not ids:
            return processor(self, logits, label, temperature, *args, **kwargs)
        columns = vocab_parallel_columns(logits, label, ids)  # before verl's in-place temperature division
        ret = processor(self, logits, label, temperature, *args, **kwargs)
        if "log_probs" in ret:
            import torch

            prob = eos_from_columns(columns, temperature, ret["log_probs"])
            ret[EOS_PROB] = prob
            ret[IS_EOS] = torch.isin(label, torch.as_tensor(ids, device=label.device)).to(prob.dtype)
        return ret

    return patched


def _keep_rows(prepare_model_outputs: Callable) -> Callable:
    """Wrap MegatronEngineWithLMHead.prepare_model_outputs (model output -> model_output for the loss): IS_EOS as
    bool, as the FSDP engine hands it; in an armed compute_log_prob pass (`state.EOS_PENDING`), both entries moved
    into the pass's rows instead (`eos.place_eos`, as the FSDP engine does: keyed by each row's token ids and
    multi-modal inputs)."""

    def patched(self, output, data, *args, **kwargs):
        model_output = prepare_model_outputs(self, output, data, *args, **kwargs)
        if not isinstance(model_output, dict) or EOS_PROB not in model_output:
            return model_output
        prob, is_eos = model_output.pop(EOS_PROB), model_output.pop(IS_EOS) > 0.5
        return place_eos(model_output, prob, is_eos, EOS_PENDING.get(), data)

    return patched
