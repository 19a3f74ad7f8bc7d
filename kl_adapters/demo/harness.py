"""A framework-agnostic training loop on the toy problem: the harness samples, a framework's loss function learns.

Each step the harness draws G completions i.i.d. from the current policy (exactly: from the enumerated sequence
distribution, which is what autoregressive sampling produces), scores them with r, and hands a `Batch` to a loss
function -- typically a framework's real loss code (verl's ppo_loss, OpenRLHF's actor training step) configured with
one KL configuration. The harness then takes an Adam step (learning rate decayed linearly to 0) and evaluates the
policy exactly (`problem.ExactEvaluator`). Advantages are r_i - mean_j r_j (no std scaling), as in `trl_runner`, so
the task gradient is (1 - 1/G) grad E[r]; a loss function must scale its KL coefficient by (G - 1)/G accordingly
(`kl_coefficient`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .completions import Completions, logps_and_eos
from .problem import ExactEvaluator, ToyProblem, completion_logprobs, enumerated_input_ids


@dataclass(frozen=True)
class TrainSettings:
    """How long and how hard every configuration trains (shared by the TRL runner and the harness runners)."""

    steps: int = 120
    group: int = 256  # G completions per step, one prompt
    learning_rate: float = 6e-3  # Adam, decayed linearly to 0
    hidden: int = 32


@dataclass(frozen=True)
class Batch:
    """One step's sampled group, in the padded [G, T] layout of the completion tokens."""

    input_ids: Tensor  # [G, 1 + T] prompt token + completion, EOS-padded
    completion_mask: Tensor  # [G, T] bool
    rewards: Tensor  # [G]
    advantages: Tensor  # [G] r_i - mean_j r_j
    old_logp: Tensor  # [G, T] log-probs under the policy that sampled the group (detached), 0 at padding
    ref_logp: Tensor  # [G, T] reference log-probs, 0 at padding


LossFn = Callable[[torch.nn.Module, Batch], Tensor]


def kl_coefficient(problem: ToyProblem, group: int) -> float:
    """The KL coefficient that makes (1 - 1/G) grad E[r] - coef grad KL proportional to grad J."""
    return problem.beta * (group - 1) / group


def train(problem: ToyProblem, loss_fn: LossFn, *, seed: int, steps: int, group: int, learning_rate: float,
          hidden: int = 32) -> list[dict[str, float]]:
    """Exact metrics after 0..steps optimizer steps of `loss_fn` on groups the harness samples."""
    torch.manual_seed(seed)
    model = problem.model(seed, hidden)
    with torch.no_grad():
        ref = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
    evaluate = ExactEvaluator(problem, ref.double().sum(-1))
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / steps)
    sampler = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps + 1):
        batch, current = sample_batch(problem, model, ref, group, sampler)
        history.append(evaluate(current))
        if step == steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()
        schedule.step()
    return history


@torch.no_grad()
def sample_batch(problem: ToyProblem, model: torch.nn.Module, ref: Tensor, group: int,
                 generator: torch.Generator) -> tuple[Batch, Tensor]:
    """Draw G completions i.i.d. from the model's policy; return the `Batch` and the [N] log pi of every sequence.

    `ref` is the [N, T] reference log-probs of every enumerated completion.
    """
    all_ids, all_mask = enumerated_input_ids(problem), problem.space.mask
    current = completion_logprobs(model, all_ids, all_mask)
    sequence = current.double().sum(-1)
    rows = torch.multinomial(sequence.exp(), group, replacement=True, generator=generator)
    rewards = problem.rewards[rows].float()
    batch = Batch(input_ids=all_ids[rows], completion_mask=all_mask[rows], rewards=rewards,
                  advantages=rewards - rewards.mean(), old_logp=current[rows], ref_logp=ref[rows])
    return batch, sequence


def core_loss(problem: ToyProblem, preset: str | None, group: int) -> LossFn:
    """The reference loss with no framework: policy gradient with a constant normaliser + kl_surrogate(preset).

    loss = -(1/(G T)) sum_i A_i sum_t log pi(y_it) + kl_surrogate(..., beta = kl_coefficient / T); preset None: no KL.
    """
    from ..surrogate import kl_surrogate

    def loss(model: torch.nn.Module, batch: Batch) -> Tensor:
        logp = batch_logps(model, batch)
        task = -(batch.advantages[:, None] * logp).sum() / (group * problem.horizon)
        if preset is None:
            return task
        return task + kl_surrogate(logp, batch.ref_logp, batch.completion_mask, preset=preset,
                                   beta=kl_coefficient(problem, group) / problem.horizon)

    return loss


def batch_logps(model: torch.nn.Module, batch: Batch) -> Tensor:
    """[G, T] log pi(y_t | y_<t) of the batch's completions, with gradient, 0 at padding."""
    return completion_logprobs(model, batch.input_ids, batch.completion_mask)


def batch_logps_and_eos(problem: ToyProblem, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """From one forward of the model: [G, T] log pi(y_t | y_<t) with gradient, pi(EOS | y_<t) (detached) and
    whether y_t is EOS (bool), all 0 / False at padding (`completions.logps_and_eos` of the batch); equals
    `batch_logps` in its first output (tests/verl/test_demo_runner.py::test_harness_eos_probabilities)."""
    return logps_and_eos(model, of_toy(batch), problem.eos_id)


def of_toy(batch: Batch) -> Completions:
    """The batch (input_ids = one prompt token + completion) in the framework losses' layout
    (`completions.Completions`), as one group."""
    ids = batch.input_ids
    return Completions(prompts=ids[:, :1], prompt_mask=torch.ones_like(ids[:, :1]), tokens=ids[:, 1:],
                       mask=batch.completion_mask, old_logp=batch.old_logp, ref_logp=batch.ref_logp,
                       rewards=batch.rewards, advantages=batch.advantages, groups=None)
