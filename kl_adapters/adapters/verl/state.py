"""What the verl adapter's wrappers hand each other inside a worker process: one `patching.Scoped` value per verl call
that encloses the wrappers reading it, and the process-wide end-of-sequence rows (`EosRows`). verl calls the wrapped
functions in a fixed order (ppo_loss -> its policy loss -> kl_penalty; make_iterator before the ppo_loss calls of an
actor update; infer_batch -> prepare_model_outputs -> logprobs_from_logits inside one forward), so a value bound by an
outer wrapper is read by the inner ones within the same call, on the same thread. Who binds each one (B), who reads
it (R), and its extent:

    LOSS_CALL    one ppo_loss call (`LossCall`): B `loss._with_metrics` around ppo_loss; R the policy-loss capture,
                 the KL term (`loss._kl_term`), `kl_budget._kl_coef`, `kl_budget._budget_scaled`, the update's
                 statistics (`loss._micro_batch_statistics`: its data-parallel group)
    UPDATE       one actor update (`Update`): set by `loss._tag_rows` when make_iterator splits the worker's batch (no
                 single call encloses the update's ppo_loss calls, so it holds until the next batch is tagged); R
                 `loss._micro_batch_statistics`, which computes its statistics at the first micro-batch needing them
    EOS_REQUEST  one forward of the FSDP engine (`EosRequest`): B `eos._eos_outputs` around prepare_model_outputs (the
                 EOS ids, when pi(EOS) is wanted); R `eos._record_eos`, which leaves pi(EOS), is_eos there
    EOS_PENDING  one compute_log_prob pass (row key -> pi(EOS), is_eos): B `eos._keep_eos_rows` around infer_batch;
                 filled by `eos._eos_outputs` (FSDP) or `megatron._keep_rows` (Megatron); then moved into `EOS_ROWS`
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ...activation import Settings
from ...reductions import EndOfSequence, KLStatistics
from ..patching import Scoped


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
class LossCall:
    """One ppo_loss call: what `_with_metrics` reads at its start, and what the wrappers inside it leave for each other.

    budget     `_shipped_budget`: (beta, kl_loss_coef, target) of a KL budget, or None
    rows       the micro-batch's ROW indices, or None (not tagged)
    dp_group   ppo_loss's dp_group argument, or None (the statistics over every data-parallel rank's rows)
    reduction  `_reduction_inputs`
    captured   the policy-loss capture's tensors, taken by the KL term that follows it
    metrics    the KL term's kl_adapters/* metrics, added to verl's when ppo_loss returns
    """

    budget: tuple[float, float, float] | None
    rows: Tensor | None
    dp_group: Any  # torch.distributed ProcessGroup of verl's data-parallel ranks
    reduction: Reduction | None
    captured: Captured | None = None
    metrics: dict | None = None


@dataclass
class Update:
    """One actor update: the worker's tagged batch until its statistics are computed, then their KLStatistics."""

    batch: Any
    statistics: KLStatistics | None = None


@dataclass
class EosRequest:
    """One forward's request for pi(EOS | y_<t): the EOS ids, and the (pi(EOS), is_eos) `_record_eos` read."""

    ids: tuple[int, ...]
    record: tuple[Tensor, Tensor] | None = None


LOSS_CALL: Scoped[LossCall] = Scoped("verl.loss_call")
UPDATE: Scoped[Update] = Scoped("verl.update")
EOS_REQUEST: Scoped[EosRequest] = Scoped("verl.eos_request")
EOS_PENDING: Scoped[dict[bytes, tuple[Tensor, Tensor]]] = Scoped("verl.eos_pending")


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
