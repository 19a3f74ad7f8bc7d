"""OpenRLHF's real training step on the task benchmark: the runner of `bench/task.py --framework openrlhf`
(docs/task.md, "verl and OpenRLHF").

`run` trains through `kl_adapters.demo.task.harness.run` (generation rounds, their shuffle and split over `lag` steps,
gradient clipping, AdamW and evaluation exactly as TRL's run) with `TaskOpenRLHFLoss`: bench/demo_openrlhf.py's
`OpenRLHFStep`, i.e. OpenRLHF 0.11.2's ActorPPOTrainer.training_step (PolicyLoss ppo, token-mean, clip 0.2, its KL loss
or the adapter's), arguments from OpenRLHF's own CLI parsing (the adapter's launcher for --algo.kl.preset). Each
generation round the harness samples becomes one Experience as OpenRLHF's experience maker makes it
(`TaskOpenRLHFLoss.rollout`): sequences = left-padded prompt + completion; action_log_probs and base_action_log_probs
from OpenRLHF's Actor.forward of the policy (the sampling one: the round is made before the next step) and of the
reference, as its maker recomputes them after vLLM samples (under the adapter the policy's carry pi(EOS), as the
rollout forward's do); rewards; advantages from RemoteExperienceMaker.compute_advantages_and_returns
(--algo.advantage.estimator group_norm: GRPO's (r - mean) / (std + 1e-9) per prompt, and under the adapter its
rollout statistics). Actor.forward takes position ids from the attention mask, the harness's forwards (TRL's) do not:
with RoPE the two agree up to float rounding, but the log-probs of the training forward must be compared with ones
made alike, or the KL at pi = pi_ref is rounding noise that Adam turns into steps. OpenRLHF's replay buffer's
functions keep the round as rows (split_experience_batch, remove_padding_in_sequences) and batch each step's rows
(make_experience_batch).

Beta: TRL's loss_type "dapo" (trl_run) adds beta * k3_t to every token and divides task and KL by the step's token
count N_tok. OpenRLHF's own KL losses (k3, unbiased_gradient) are a global token mean like its policy loss, and the
adapter's KL takes the policy loss's normaliser N_tok too (kl_ctl / N_tok times the sum over the step's sequences of
grad KL_b, TRL's weight of the sequence KL): kl_ctl = --algo.kl.init_coef = beta in every configuration
(`OpenRLHFStep.kl_ctl`). The committed results (bench/results/task/task_short_openrlhf.*) ran before the adapter took
that normaliser (it weighed the sequence KL by kl_ctl / N_seq then) with kl_ctl = beta * N_seq / N_tok per step: the same
gradient (N_seq = rl.batch, every completion non-empty). beta=0: --algo.kl.init_coef 0. Pinned by
tests/openrlhf/test_task_harness.py::test_beta_means_trls.

Rollout statistics (kl_adapters:sequence): fitted once per round in the experience maker, within its prompt groups,
with the sampling policy's pi(EOS) and OpenRLHF's advantages against beta = the KL controller's value, init_coef (the
committed results: the previous round's kl_ctl x its mean length, from the second round on; the first round was fitted
to the KL term alone).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

import openrlhf_paths  # noqa: F401  (tests/openrlhf's CPU shim and, without CUDA, its TEST-ONLY import stubs)
from demo_openrlhf import OpenRLHFStep, actor_of, cli_argv

if TYPE_CHECKING:
    from kl_adapters.demo.task.driver import Prepared
    from kl_adapters.demo.task.harness import Batch
    from kl_adapters.demo.task.settings import RLSettings

#: configuration -> what it runs
CONFIGS = {
    "openrlhf-default-k3": "--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef beta",
    "unbiased_gradient": "... k3 --algo.kl.unbiased_gradient (OpenRLHF's fix, PR #1309)",
    "kl_adapters:sequence": "... --algo.kl.preset sequence (the launcher), kl_ctl = beta",
    "kl_adapters:sequence-plain": "... --algo.kl.preset sequence-plain (without the variance reductions)",
    "beta=0": "... --algo.kl.init_coef 0 (no KL term)",
}


class TaskOpenRLHFLoss(OpenRLHFStep):
    """task.harness.LossFn: OpenRLHF's training_step on the rows of the current round that the harness's micro-batch
    names, and `rollout`. kl-adapters' activation is per process: one at a time (`run` resets it around the run)."""

    def __init__(self, config: str, rl: RLSettings, max_new_tokens: int):
        if config not in CONFIGS:
            raise ValueError(f"unknown OpenRLHF configuration {config!r} for the task benchmark; valid: "
                             f"{', '.join(CONFIGS)}")
        argv = cli_argv(config, rl.group, rl.beta, max_new_tokens, prompts=rl.prompts_per_step * rl.lag,
                        rows=rl.batch, estimator="group_norm")
        super().__init__(config, argv, coef=rl.beta, rows=rl.batch)
        self.items: list = []  # the current round's rows, as OpenRLHF's replay buffer holds them

    def rollout(self, policy, reference, round_: Batch) -> Batch:
        """task.harness.Rollout: the round as OpenRLHF's experience maker makes it -- the policy's and the reference's
        log-probs from OpenRLHF's Actor.forward (its position ids; under the adapter the policy's carry pi(EOS), as
        the rollout forward's do), compute_advantages_and_returns -- kept as rows; returns the round with OpenRLHF's
        advantages (every token of a row holds its row's value, read at the first)."""
        import torch
        from openrlhf.trainer.ppo_utils.experience import (Experience, remove_padding_in_sequences,
                                                           split_experience_batch)
        from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

        self.built_for(policy)
        inputs = dict(sequences=round_.input_ids, action_mask=round_.mask, attention_mask=round_.attention_mask)
        with torch.no_grad():
            old, ref = self.trainer.actor(**inputs), actor_of(reference)(**inputs)
        experience = Experience(**inputs, action_log_probs=old, base_action_log_probs=ref, rewards=round_.rewards,
                                kl=torch.zeros_like(round_.old_logp), index=list(range(len(round_.rewards))), info={})
        self.maker.kl_ctl = FixedKLController(self.args.algo.kl.init_coef)  # kl_ctl (OpenRLHFStep)
        (experience,) = self.maker.compute_advantages_and_returns([experience])
        advantages = experience.advantages[:, 0].float()
        self.items = remove_padding_in_sequences(split_experience_batch(experience))
        return replace(round_, advantages=advantages)

    def experience(self, model, batch: Batch):
        """The micro-batch's rows of the round, batched as OpenRLHF's replay buffer batches them."""
        from openrlhf.trainer.ppo_utils.experience import make_experience_batch

        return make_experience_batch([self.items[i] for i in batch.index.tolist()])


def run(prepared: Prepared, config: str, rl: RLSettings, seed: int) -> dict:
    """driver.Runner: OpenRLHF's training_step under one configuration, on the rounds the task harness samples;
    OpenRLHF's metrics of each step merged into the harness's per-step rows."""
    warnings.filterwarnings("ignore")
    import kl_adapters
    from kl_adapters.demo.task.harness import run as train

    kl_adapters.disable()
    try:
        loss = TaskOpenRLHFLoss(config, rl, prepared.max_new_tokens)
        return train(prepared, loss, rl, seed, rollout=loss.rollout, metrics=loss.metrics)
    finally:
        kl_adapters.disable()
