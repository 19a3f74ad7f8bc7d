"""TRL adapter, several processes: the loss-time statistics over the rows of every process's micro-batch, as one
process holding them all would fit them (accelerate's gather). Pinned by tests/trl/test_data_parallel.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...activation import Settings
from ...reductions import EndOfSequence, KLStatistics, TaskAdvantages
from ...surrogate import kl_statistics

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer


def _statistics_across_processes(trainer: GRPOTrainer, settings: Settings, logp, ref, mask, behaviour,
                                 options: dict) -> dict:
    """Loss-time statistics (none stored at rollout) over the rows of every process's micro-batch, as one process
    holding them all would fit them (a GRPO group split across processes included): kl_statistics of the gathered
    inputs (`_every_process`; the statistics kl_term computes from a batch, which is_clip does not enter), this
    process's rows of them. Returns kl_term's options with them. Pinned by tests/trl/test_data_parallel.py."""
    task, eos = _fitting_inputs_of_every_process(trainer, options["task"], options["eos"])
    whole = kl_statistics(*(_every_process(trainer, x) for x in (logp, ref, mask)), preset=settings.spec,
                          old_logp=_every_process(trainer, behaviour), task=task, eos=eos,
                          group=_every_process(trainer, options["group"]), discount=options["discount"])
    return {"statistics": _own_rows(trainer, whole, mask), "eos": options["eos"], "discount": options["discount"]}


def _every_process(trainer: GRPOTrainer, x: torch.Tensor | None) -> torch.Tensor | None:
    """[B] / [B, T] `x` of every process, rows in process order ([B, T] zero-padded to the widest), detached."""
    if x is None:
        return None
    acc = trainer.accelerator
    return acc.gather(acc.pad_across_processes(x.detach(), dim=1) if x.dim() > 1 else x.detach())


def _fitting_inputs_of_every_process(trainer: GRPOTrainer, task: TaskAdvantages | None,
                                     eos: EndOfSequence | None) -> tuple[TaskAdvantages | None, EndOfSequence | None]:
    """The task advantages and end-of-sequence probabilities of every process's rows (`_every_process`)."""
    return (None if task is None else replace(task, advantages=_every_process(trainer, task.advantages)),
            None if eos is None else replace(eos, prob=_every_process(trainer, eos.prob),
                                             is_eos=_every_process(trainer, eos.is_eos)))


def _own_rows(trainer: GRPOTrainer, statistics: KLStatistics, mask: torch.Tensor) -> KLStatistics:
    """This process's rows of statistics fitted on every process's rows, at its own width."""
    rows = mask.shape[0]
    start = trainer.accelerator.process_index * rows
    return statistics[start:start + rows].with_width(mask.shape[1])
