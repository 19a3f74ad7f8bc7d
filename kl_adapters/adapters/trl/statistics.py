"""TRL adapter, the reduced presets' batch statistics and what they are fitted with: TRL's advantages, the rows'
prompt groups and the policy's end-of-sequence probabilities, at rollout time where TRL has the whole generation
batch's log-probs (`rollout_statistics`), else at loss time (`statistics_inputs`).

Batch statistics of the variance-reduced presets ("sequence", "reward"; see kl_adapters.reductions): the
leave-one-out control-variate coefficient and baseline of each row must come from OTHER samples, the more the better,
while TRL's loss sees micro-batches of ``per_device_train_batch_size`` rows (default 8). Where TRL already has the
policy's log-probs of the whole generation batch at rollout time (``old_per_token_logps``: num_iterations > 1 or
steps_per_generation not dividing gradient_accumulation_steps; vLLM's ``sampling_per_token_logps``), a wrapper around
``_generate_and_score_completions`` (rollout.py) computes ``kl_statistics`` there, leave-one-out within each GRPO
group (the ``num_generations`` completions of one prompt), and stores them as [B] / [B, T] tensors of the batch dict
(``ROLLOUT_STATISTICS_KEYS``), which TRL's own ``shuffle_sequence_dict`` / ``split_tensor_dict`` permute and slice with
the rest into micro-batches; the loss uses the micro-batch's rows. Otherwise (TRL's on-policy default, where it skips
that forward pass) no forward pass is added: the statistics are leave-one-out over the micro-batch's own rows at loss
time (with several processes, over the rows of every process's micro-batch: data_parallel.py), within each prompt's
group (``GROUP_KEY``, stored at generation and carried by TRL's shuffle / split like the statistics; a row with fewer
than two other rows of its prompt in the micro-batch gets the plain form). With TRL's defaults
(per_device_train_batch_size = num_generations = 8, gradient_accumulation_steps = 1) that micro-batch IS the whole
generation batch, one group of 8. Either way row b's statistics are functions of the other rows only, so the expected
gradient is unchanged (tests/core/test_batch_exactness.py; the trainer identity with the stored statistics:
tests/trl/test_statistics.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...presets import Preset
from ...reductions import EndOfSequence, KLStatistics, TaskAdvantages
from ...surrogate import kl_statistics
from .data_parallel import _every_process, _fitting_inputs_of_every_process, _own_rows
from .flags import discount_of
from .inputs import GROUP_KEY, rollout_logps, statistics_of

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer


def group_ids(trainer: GRPOTrainer, rows: int) -> torch.Tensor:
    """[rows] prompt ids of this process's generation batch: TRL's RepeatSampler yields each prompt's
    num_generations completions consecutively, and each process takes a contiguous slice of the global batch."""
    mode_generations = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
    start = trainer.accelerator.process_index * rows
    return torch.div(torch.arange(start, start + rows), mode_generations, rounding_mode="floor")


def rollout_statistics(trainer: GRPOTrainer, batch: dict, preset: str | Preset,
                       eos: EndOfSequence | None = None) -> KLStatistics | None:
    """`kl_statistics(..., preset=preset)` of the whole generation batch, leave-one-out within each GRPO group, fitted
    with the batch's task advantages (`task_advantages`) and `eos` (the sampling policy's end-of-sequence
    probabilities, `rollout_end_of_sequence`), from the log-probs TRL has at rollout time (`rollout_logps`), over every
    process's generation batch; None when it has none. Row b's statistics depend on the other rows only. They are
    taken on-policy (no old_logp: the rollout log-probs are the policy that sampled), where `Preset.weighted_returns`
    has no effect, so `sequence` and `reward` get identical statistics here. Pinned by tests/trl/test_statistics.py
    (and, over processes, tests/trl/test_data_parallel.py)."""
    logps = rollout_logps(batch)
    if logps is None or batch.get("ref_per_token_logps") is None:
        return None
    logp, mask = logps
    group = group_ids(trainer, logp.shape[0]).to(logp.device)
    task, ref = task_advantages(trainer, batch, trainer.beta), batch["ref_per_token_logps"]
    if trainer.accelerator.num_processes == 1:
        return kl_statistics(logp, ref, mask, group=group, preset=preset, task=task, eos=eos,
                             discount=discount_of(trainer.args))
    # several processes: over every process's generation batch (a GRPO group split across processes included)
    task, every_eos = _fitting_inputs_of_every_process(trainer, task, eos)
    whole = kl_statistics(*(_every_process(trainer, x) for x in (logp, ref, mask)), preset=preset, task=task,
                          eos=every_eos, group=_every_process(trainer, group), discount=discount_of(trainer.args))
    return _own_rows(trainer, whole, mask)


def advantages_normalized(trainer: GRPOTrainer) -> bool:
    """Whether TRL divided the advantages by a standard deviation over rows that include the row: scale_rewards
    "group" or "batch" (GRPOConfig maps True / False to "group" / "none" in 1.14.0-1.16.0), or
    multi_objective_aggregation "normalize_then_sum" (the summed reward divided by the batch's std, whatever
    scale_rewards says). Pinned by tests/trl/test_task_and_eos.py::test_advantages_normalized."""
    return trainer.scale_rewards != "none" or trainer.multi_objective_aggregation == "normalize_then_sum"


def task_advantages(trainer: GRPOTrainer, inputs: dict, beta: float) -> TaskAdvantages | None:
    """TRL's advantages as its loss uses them ([B], or [B, T] from a subclass), with `beta` its KL coefficient: the
    policy loss's per-token descent weight is beta c - A before TRL's normaliser D, which the KL term shares
    (`per_token_normaliser`). grpo / sapo divide the task term by each row's own length instead of D: the advantages
    are still passed unscaled, since a per-row length factor on group-centred advantages would make the other rows'
    task terms depend on the row's own reward (the statistics must be functions of the other rows).
    None (the statistics then fit the KL term alone) with normalize_then_sum over several reward functions: each is
    standardised within the group by its own std, so no single shift and scale removes the row's own rewards from
    the other rows' advantages."""
    if trainer.multi_objective_aggregation == "normalize_then_sum" and len(trainer.reward_funcs) > 1:
        return None
    return TaskAdvantages(inputs["advantages"], beta=beta, normalized=advantages_normalized(trainer))


def statistics_inputs(trainer: GRPOTrainer, spec: Preset, inputs: dict, beta: float,
                      eos: EndOfSequence | None) -> dict:
    """The keyword arguments of kl_term / full_kl_surrogate_from_hidden that shape preset `spec`'s statistics at loss
    time: the rows' rollout statistics (`statistics_of`) with this forward's eos, or, none stored, TRL's task
    advantages, the rows' prompt groups (GROUP_KEY; a batch without it is one group) and eos for leave-one-out
    over the micro-batch; {} for a preset without statistics.

    The statistics are fitted to the gradient TRL takes, task + KL (kl_adapters.reductions), with, wherever they are
    computed (loss time, rollout time, ``full``):
      * ``TaskAdvantages(inputs["advantages"], beta, normalized)`` (`task_advantages`): TRL's advantages as its loss uses
        them, beta the GRPOConfig beta (the policy loss's per-token weight is beta c - A before the normaliser D the KL
        term shares), normalized unless scale_rewards = "none" under multi_objective_aggregation "sum_then_normalize";
        None for "normalize_then_sum" over several reward functions (no single shift and scale removes a row's own rewards
        from the other rows' advantages there); the rows' prompt ids as ``group`` (GRPO normalises per prompt);
      * ``EndOfSequence(pi(EOS | y_<t), y_t is EOS, max_completion_length)`` (`end_of_sequence`), the termination control
        variate's input, over every id TRL stops at (`eos_token_ids`). pi(EOS) is read from the policy forward TRL runs
        anyway: a forward hook on the backbone (transformers' ``base_model``, which TRL's forward runs in every release:
        1.14.x's full logits, 1.15+'s fused LM head, `full`'s hidden-state path) takes the last hidden state h and
        computes log pi(EOS) = logsumexp_e(h W_e / T) - h W_y / T + log pi(y), with W_e the EOS ids' rows of the output
        projection, W_y the sampled token's row and log pi(y) TRL's own log-prob (`eos._recorded`, `_eos_gap`): no second
        forward, nothing of size [B, T, V]. At loss time it is the current policy's (exactness needs it); at rollout, the
        forward that produced old_per_token_logps (statistics only; none when TRL runs no old-policy forward). A head
        that is not hidden @ W.T (bias, logit scale, soft-capping) gets no termination term, with a warning.
    """
    if not spec.uses_batch_statistics:
        return {}
    statistics = None if spec.needs_full_logits else statistics_of(inputs)
    if statistics is not None:
        return {"statistics": statistics, "eos": eos}
    return {"task": task_advantages(trainer, inputs, beta), "group": inputs.get(GROUP_KEY), "eos": eos}
