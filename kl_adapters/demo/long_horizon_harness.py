"""Training settings of the long-horizon benchmark, its evaluation schedule, and a framework-agnostic training loop.

`train` is `harness.train` for `long_horizon_problem`: each step it samples G completions from the current policy
(`long_horizon_problem.sample`, autoregressively with a KV cache), scores them, and hands a `harness.Batch` (the
completions, rewards, advantages r_i - mean_j r_j, the sampling policy's and the reference's per-token log-probs) to
a loss function -- verl's or OpenRLHF's real loss code in bench/long_horizon.py -- then takes an Adam step (learning
rate decayed linearly to 0, as TRL's default schedule). The TRL runner (`long_horizon_trl`) trains through TRL's own
GRPOTrainer.train() instead and shares only the settings and the evaluation.

Evaluation (`evaluate_policy`): the policy's J* - J, KL(pi || pi*), KL(pi || pi_ref), E[R] with standard errors
(`long_horizon_problem.evaluate`) from `eval_samples` completions every `eval_every` steps and `final_samples` at the
last step; the sampling seed depends only on (problem seed, step), so every configuration of a seed is evaluated with
the same random numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .harness import Batch
from .long_horizon_problem import A_ID, LongHorizonProblem, Samples, evaluate, rewards, sample, states


@dataclass(frozen=True)
class LongSettings:
    """How long and how hard every configuration trains, and how often it is evaluated."""

    steps: int = 100
    group: int = 32  # G completions per step, one prompt
    learning_rate: float = 3e-3  # Adam, decayed linearly to 0
    eval_every: int = 10
    eval_samples: int = 512
    final_samples: int = 4096

    def evaluates_at(self, step: int) -> int:
        """How many completions evaluate the policy after `step` optimizer steps (0: not evaluated then)."""
        if step == self.steps:
            return self.final_samples
        return self.eval_samples if step % self.eval_every == 0 else 0


def evaluate_policy(problem: LongHorizonProblem, model: torch.nn.Module, step: int, n: int) -> dict[str, float]:
    """`long_horizon_problem.evaluate` on n completions of the model's policy, seeded by (problem seed, step)."""
    generator = torch.Generator().manual_seed(1_000_003 * problem.seed + step)
    start = time.perf_counter()
    out = evaluate(problem, sample(model, problem, n, generator))
    return {"step": step, "samples": n, **out, "eval_seconds": time.perf_counter() - start}


def batch_of(problem: LongHorizonProblem, samples: Samples) -> Batch:
    """The sampled group as a `harness.Batch` (float32 log-probs, 0 at padding; advantages r_i - mean_j r_j)."""
    tokens, mask = samples.tokens, samples.mask
    prev, _ = states(tokens)
    t = torch.arange(problem.horizon).expand_as(tokens)
    old = samples.logp.gather(-1, tokens[..., None]).squeeze(-1)
    ref = problem.reference[t, prev, tokens]
    r = rewards(tokens).float()
    zero = torch.zeros((), dtype=torch.float32)
    return Batch(input_ids=torch.cat([torch.full_like(tokens[:, :1], A_ID), tokens], 1), completion_mask=mask,
                 rewards=r, advantages=r - r.mean(), old_logp=torch.where(mask, old.float(), zero),
                 ref_logp=torch.where(mask, ref.float(), zero))


LossFn = Callable[[torch.nn.Module, Batch], Tensor]
#: called after each evaluation with the evaluation's row (progress lines)
Progress = Callable[[dict[str, float]], None]


def train(problem: LongHorizonProblem, loss_fn: LossFn, settings: LongSettings,
          progress: Progress | None = None) -> dict:
    """Train the problem's policy with `loss_fn` on groups this loop samples; returns {"history": evaluation rows,
    "step_seconds": wall time of each step (sampling, loss, backward, Adam), "train_reward": each group's mean R}."""
    torch.manual_seed(problem.seed)
    model = problem.model()
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / settings.steps)
    sampler = torch.Generator().manual_seed(problem.seed)
    history, seconds, train_reward = [], [], []
    for step in range(settings.steps + 1):
        if settings.evaluates_at(step):
            history.append(evaluate_policy(problem, model, step, settings.evaluates_at(step)))
            if progress:
                progress(history[-1])
        if step == settings.steps:
            break
        start = time.perf_counter()
        batch = batch_of(problem, sample(model, problem, settings.group, sampler))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()
        schedule.step()
        seconds.append(time.perf_counter() - start)
        train_reward.append(float(batch.rewards.mean()))
    return {"history": history, "step_seconds": seconds, "train_reward": train_reward}
