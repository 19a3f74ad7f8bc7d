"""verl's real loss code on the task benchmark: the runner of `bench/task.py --framework verl`
(docs/task.md, "verl and OpenRLHF").

`run` trains through `kl_adapters.demo.task.harness.run` (generation rounds, their shuffle and split over `lag` steps,
gradient clipping, AdamW and evaluation exactly as TRL's run) with `TaskVerlLoss`: bench/demo_verl.py's `VerlPPOLoss`,
i.e. verl 0.9.1's `ppo_loss` (policy loss "vanilla", clip 0.2, loss_agg_mode token-mean, the prompt groups as verl's
``uid``, pi(EOS) of the loss's forward in model_output), and verl's own advantage code on each generation round
(`TaskVerlLoss.rollout`: ray_trainer.compute_advantage(..., "grpo", norm_adv_by_std_in_grpo=True), what
RayPPOTrainer.fit runs on the rollout batch: (r - mean) / (std + 1e-6) within each uid), with the adapter's workers
told "normalized" advantages (ADVANTAGES_ENV, as verl's driver does for that estimator).

Beta: TRL's loss_type "dapo" (trl_run) adds beta * k3_t to every token and divides task and KL by the step's token
count; verl's token-mean divides both by batch_num_tokens, the step's token count, so kl_loss_coef = beta, natively
and under kl_adapters:<preset> (which uses verl's divisor: docs/verl.md). Pinned by
tests/verl/test_task_harness.py::test_beta_means_trls.

Reduced presets (kl_adapters:sequence): ppo_loss called outside a worker's update takes its own micro-batch's
leave-one-out statistics within its uid groups (docs/verl.md), with the current forward's pi(EOS); with lag > 1 a
micro-batch holds parts of groups (still exact, fewer rows to fit from).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

from demo_verl import VerlPPOLoss, grpo_advantages, outcome_proto, outcome_scores

if TYPE_CHECKING:
    from kl_adapters.demo.task.driver import Prepared
    from kl_adapters.demo.task.harness import Batch
    from kl_adapters.demo.task.settings import RLSettings

#: configuration -> what it runs
CONFIGS = {
    "verl-default": "actor.use_kl_loss=True, kl_loss_type=low_var_kl (verl's default, k3), kl_loss_coef = beta",
    "k3+": "kl_loss_type=k3+ (verl's straight-through k2-gradient fix)",
    "kl_adapters:sequence": "kl_loss_type=kl_adapters:sequence (kl-adapters; uid groups, pi(EOS))",
    "kl_adapters:sequence-plain": "kl_loss_type=kl_adapters:sequence-plain (without the variance reductions)",
    "beta=0": "actor.use_kl_loss=False (no KL term)",
}


class TaskVerlLoss(VerlPPOLoss):
    """task.harness.LossFn: verl's ppo_loss on the harness's micro-batches (kl_loss_coef = rl.beta), and `rollout`."""

    def __init__(self, config: str, rl: RLSettings):
        from kl_adapters.demo.task.reference import EOS_ID

        if config not in CONFIGS:
            raise ValueError(f"unknown verl configuration {config!r} for the task benchmark; valid: "
                             f"{', '.join(CONFIGS)}")
        super().__init__(config, group=rl.group, rows=rl.batch, coef=rl.beta, eos_id=EOS_ID, normalized=True)

    def rollout(self, policy, reference, round_: Batch) -> Batch:
        """task.harness.Rollout: the round with verl's GRPO advantages (outcome reward at each row's last token; every
        token of a row holds its row's value, read at the first)."""
        data = outcome_proto(round_, {"token_level_rewards": outcome_scores(round_),
                                      "response_mask": round_.mask.long()})
        return replace(round_, advantages=grpo_advantages(data, self.normalized)[:, 0].float())


def run(prepared: Prepared, config: str, rl: RLSettings, seed: int) -> dict:
    """driver.Runner: verl's ppo_loss under one configuration, on the rounds the task harness samples; verl's metrics
    of each step merged into the harness's per-step rows."""
    warnings.filterwarnings("ignore")
    from kl_adapters.demo.task.harness import run as train

    loss = TaskVerlLoss(config, rl)
    return train(prepared, loss, rl, seed, rollout=loss.rollout, metrics=loss.metrics)
