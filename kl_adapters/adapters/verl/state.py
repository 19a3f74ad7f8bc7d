"""What the verl adapter's wrappers hand each other inside a worker process: a typed state per thread
(`WorkerState`) and the process-wide end-of-sequence rows (`EosRows`), with who writes, who reads and when each field is
cleared. verl calls the wrapped functions in a fixed order (ppo_loss -> its policy loss -> kl_penalty; make_iterator
before the ppo_loss calls of an actor update; prepare_model_outputs -> logprobs_from_logits inside one forward), so a
value set by one wrapper is read by the next within the same call, on the same thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ...activation import Settings
from ...reductions import EndOfSequence, KLStatistics


@dataclass(frozen=True)
class Reduction:
    """What the reduced presets take from ppo_loss's micro-batch beside the tensors its policy loss receives."""

    eos: EndOfSequence | None  # pi(EOS | y_<t) of this forward (model_output's EOS_PROB), padded like log_prob
    group: Tensor | None  # [B] ids of verl's "uid" (the GRPO prompt group), when the micro-batch carries it


@dataclass(frozen=True)
class Captured:
    """The tensors ppo_loss passes to its policy loss, for the KL term that follows it in the same call."""

    settings: Settings
    log_prob: Tensor
    old_log_prob: Tensor
    response_mask: Tensor
    rollout_is_weights: Tensor | None
    native: str | None  # preset with the gradient of verl's own kl_loss_type, if one has it
    rows: Tensor | None  # the micro-batch's row indices in the worker's batch (loss.ROW), if verl's update tagged them
    advantages: Tensor  # [B, T] the advantages ppo_loss hands its policy loss
    kl_loss_coef: float
    reduction: Reduction | None  # None for the presets without batch statistics


@dataclass
class WorkerState:
    """One thread's hand-over between the verl adapter's wrappers (one actor update and one ppo_loss call at a time per
    thread). Field by field, who writes it (W), who reads it (R) and when it is cleared (C):

    One ppo_loss call (loss.py):
        budget     W `_with_metrics` at the call's start (`_shipped_budget`: beta, kl_loss_coef, target, or None);
                   R `_kl_coef` (the policy-loss capture) and `_budget_scaled` (the KL term); C overwritten next call
        rows       W `_with_metrics` at the call's start (the micro-batch's ROW indices, or None); R the capture;
                   C overwritten next call
        reduction  W `_with_metrics` at the call's start (`_reduction_inputs`); R the capture; C overwritten next call
        dp_group   W `_with_metrics` at the call's start (ppo_loss's dp_group argument, or None); R
                   `_micro_batch_statistics` (the statistics over every data-parallel rank's rows); C overwritten next call
        captured   W the policy-loss capture (`_capture_policy_loss`), inside ppo_loss; R and C `_kl_term`, the
                   kl_penalty call that follows; C also by `_with_metrics` at the call's start
        metrics    W `_kl_term`; R and C `_with_metrics` when ppo_loss returns (added to verl's metrics)
    One actor update (loss.py):
        batch      W `_tag_rows` (make_iterator on the worker's batch); R and C `_micro_batch_statistics`, at the first
                   micro-batch that needs its statistics
        statistics C `_tag_rows`; W `_micro_batch_statistics` (the whole batch's KLStatistics); R the update's later
                   micro-batches; replaced when a batch is tagged again
    One forward of the FSDP engine (eos.py):
        eos_ids    W `_eos_outputs` around prepare_model_outputs (the EOS ids, when pi(EOS) is wanted); R `_record_eos`;
                   C `_eos_outputs` when prepare_model_outputs returns (finally)
        eos_record W `_record_eos` (pi(EOS), is_eos of logprobs_from_logits' logits); R and C `_eos_outputs`
        eos_pending W `_keep_eos_rows` around infer_batch (an empty dict: keep rows, do not add model_output keys);
                   filled by `_eos_outputs`; R and C `_keep_eos_rows` when infer_batch returns (finally), into `EOS_ROWS`
    """

    budget: tuple[float, float, float] | None = None
    rows: Tensor | None = None
    reduction: Reduction | None = None
    dp_group: Any = None  # torch.distributed ProcessGroup of verl's data-parallel ranks
    captured: Captured | None = None
    metrics: dict | None = None
    batch: Any = None
    statistics: KLStatistics | None = None
    eos_ids: tuple[int, ...] | None = None
    eos_record: tuple[Tensor, Tensor] | None = None
    eos_pending: dict[bytes, tuple[Tensor, Tensor]] | None = None


_threads = threading.local()


def worker_state() -> WorkerState:
    """This thread's `WorkerState` (made at its first use)."""
    state = getattr(_threads, "state", None)
    if state is None:
        state = _threads.state = WorkerState()
    return state


@dataclass
class EosRows:
    """The actor worker's end-of-sequence probabilities from its last compute_log_prob pass: row key (eos.row_keys: a
    digest of the row's prompt + response token ids) -> (pi(EOS | x_<=j), is_eos) over the row's positions in
    log_probs' layout. Process-wide, not per thread: Ray may run compute_log_prob and update_actor on different
    threads of the worker. W `replace` by `_keep_eos_rows` (each compute_log_prob pass replaces the previous one's);
    R and C `take` by `_stored_eos` (the next update's statistics), which empties it."""

    rows: dict[bytes, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def replace(self, rows: dict[bytes, tuple[Tensor, Tensor]]) -> None:
        self.rows = dict(rows)

    def take(self, keys: list[bytes]) -> list[tuple[Tensor, Tensor] | None]:
        """The rows of `keys` (None where absent); empties the store."""
        found, self.rows = [self.rows.get(key) for key in keys], {}
        return found


#: the worker process's `EosRows`
EOS_ROWS = EosRows()
