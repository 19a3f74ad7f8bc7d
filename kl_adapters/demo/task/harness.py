"""A framework-agnostic RL loop on the task: the harness samples, a framework's real loss function learns.

The counterpart of `trl_run.run` for frameworks whose trainer needs a cluster (verl, OpenRLHF: bench/task_verl.py and
bench/task_openrlhf.py hand their real loss code to `run`), doing what TRL's GRPOTrainer does with the benchmark's
settings, so that results compare across frameworks (docs/task.md):

  * policy: the reference folder's model, trainable; reference: a second, frozen copy; tokenizer `reference.tokenizer()`
  * a generation round every `lag` optimizer steps (TRL's steps_per_generation = lag): prompts_per_step x lag prompts
    from the training prompts (a seeded permutation, walked in order and reshuffled when used up, as TRL's
    RepeatSampler walks the dataset), `group` completions each (TRL's num_generations: a prompt's completions are
    consecutive rows), sampled at temperature 1 (`evaluate.sample`, left-padded prompts, max_new_tokens of the
    setting), scored by the setting's reward; advantages per prompt group (`grpo_advantages`, TRL's
    scale_rewards="group"); old log-probs the sampling policy's (`Samples.logp`), reference log-probs by one forward
    of the reference. `rollout(policy, reference, round)`, when given, is the framework's own processing of the
    round before it is split (its advantage code, its rollout statistics: bench/task_verl.py, bench/task_openrlhf.py).
  * the round's rows shuffled (a generator seeded by the run seed) and split into `lag` micro-batches, consumed by the
    next `lag` optimizer steps: a rollout is 0 .. lag - 1 steps stale (TRL's shuffle_sequence_dict +
    split_tensor_dict); each step loss_fn(policy, batch).backward(), gradient clipping at 1.0 (the pre-clip norm is
    "grad_norm"), AdamW (weight decay 0, TRL's default) at rl.learning_rate decayed linearly to 0 over rl.steps.
  * evaluation (`evaluate.evaluate`) at step 0, every eval_every steps and after the last, seeded by
    1_000_003 * seed + step, as `trl_run.run`.

Pinned by tests/verl/test_task_harness.py (lag bookkeeping, advantages) and the smoke runs of tests/verl and
tests/openrlhf.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from ..completions import Completions
from .arithmetic import Example
from .evaluate import Scorer, completion_logps, decode, encode_prompts, evaluate, sample
from .settings import RLSettings

#: TRL's epsilon in (r - mean) / (std + eps) (GRPOTrainer._generate_and_score_completions, scale_rewards="group")
TRL_STD_EPSILON = 1e-4


@dataclass(frozen=True)
class Batch(Completions):
    """Rows of one generation round (`Completions`: prompts [B, P], completions [B, T], old / reference log-probs,
    rewards, advantages, prompt groups), and where they come from."""

    index: Tensor  # [B] the rows' positions in their generation round
    sampled_at: int  # the optimizer step at which the round was sampled (its policy had taken that many steps)

    def rows(self, index: Tensor) -> Batch:
        """The rows `index` of the batch (tensor fields indexed along the first dimension)."""
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})


LossFn = Callable[[torch.nn.Module, Batch], Tensor]
#: (policy, reference, generation round) -> the round as the framework hands it to its loss (its advantages, its
#: statistics)
Rollout = Callable[[torch.nn.Module, torch.nn.Module, Batch], Batch]


def grpo_advantages(rewards: Tensor, group: int) -> Tensor:
    """(r - mean) / (std + 1e-4) within each run of `group` consecutive rows, std with Bessel's correction: TRL's
    scale_rewards="group" (its nanstd, no NaN here)."""
    grouped = rewards.view(-1, group)
    mean, std = grouped.mean(-1, keepdim=True), grouped.std(-1, keepdim=True)
    return ((grouped - mean) / (std + TRL_STD_EPSILON)).reshape(-1)


def prompt_stream(train: list[Example], seed: int) -> Iterator[Example]:
    """The training prompts in a seeded random order, reshuffled each time they are used up."""
    rng = random.Random(f"task-harness/{seed}")
    while True:
        yield from rng.sample(train, len(train))


@torch.no_grad()
def generate(policy, reference, tok, examples: list[Example], group: int, max_new_tokens: int, scorer: Scorer,
             step: int) -> Batch:
    """One generation round: `group` completions of each example from the policy (torch's global RNG), scored, with
    the sampling policy's and the reference's log-probs and GRPO advantages."""
    rows = [e for e in examples for _ in range(group)]
    samples = sample(policy, *encode_prompts(tok, [e.prompt for e in rows]), max_new_tokens)
    tokens, mask = samples.tokens, samples.mask
    rewards = torch.tensor(scorer(decode(tok, samples), rows), dtype=torch.float32)
    picked = tokens[..., None]
    old = torch.where(mask, samples.logp.gather(-1, picked).squeeze(-1), 0.0)
    ref = torch.where(mask, completion_logps(reference, samples).gather(-1, picked).squeeze(-1), 0.0)
    return Batch(prompts=samples.prompts, prompt_mask=samples.prompt_mask, tokens=tokens, mask=mask, old_logp=old,
                 ref_logp=ref, rewards=rewards, advantages=grpo_advantages(rewards, group),
                 groups=torch.arange(len(examples)).repeat_interleave(group), index=torch.arange(len(rows)),
                 sampled_at=step)


def micro_batches(round_: Batch, lag: int, generator: torch.Generator) -> list[Batch]:
    """The round's rows shuffled and split into `lag` equal micro-batches (TRL's shuffle_sequence_dict +
    split_tensor_dict)."""
    order = torch.randperm(round_.mask.shape[0], generator=generator)
    return [round_.rows(part) for part in order.chunk(lag)]


def run(prepared, loss_fn: LossFn, rl: RLSettings, seed: int, rollout: Rollout | None = None,
        metrics: list[dict[str, float]] | None = None, progress: Callable[[dict], None] | None = None) -> dict:
    """Train from the prepared setting's reference with `loss_fn` (module docstring); returns {"history": evaluation
    rows, "step_seconds": each step's wall time (its generation round included, evaluations not), "steps": per-step
    metrics ("reward", "loss", "grad_norm", "completions/mean_length", "staleness", and the last entry of `metrics`,
    the list where the loss function records its framework's metrics, one per call), "finite": whether every loss and
    gradient norm was finite}. `prepared` is a `driver.Prepared`."""
    from transformers import AutoModelForCausalLM

    from .reference import tokenizer

    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(prepared.reference)
    policy.train()
    reference = AutoModelForCausalLM.from_pretrained(prepared.reference).eval().requires_grad_(False)
    tok = tokenizer()
    scorers = prepared.scorers()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=rl.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / rl.steps)
    prompts, shuffle = prompt_stream(prepared.train, seed), torch.Generator().manual_seed(seed)
    history, seconds, steps, pending = [], [], [], []

    def evaluate_at(step: int) -> None:
        if step % rl.eval_every and step != rl.steps:
            return
        start = time.perf_counter()
        row = {"step": step, **evaluate(policy, reference, tok, prepared.tests, prepared.max_new_tokens,
                                        seed=1_000_003 * seed + step, scorers=scorers)}
        row["eval_seconds"] = time.perf_counter() - start
        history.append(row)
        if progress:
            progress(row)

    evaluate_at(0)
    for step in range(rl.steps):
        start = time.perf_counter()
        if not pending:
            examples = [next(prompts) for _ in range(rl.prompts_per_step * rl.lag)]
            round_ = generate(policy, reference, tok, examples, rl.group, prepared.max_new_tokens,
                              scorers[prepared.reward], step)
            pending = micro_batches(rollout(policy, reference, round_) if rollout else round_, rl.lag, shuffle)
        batch = pending.pop(0)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(policy, batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        seconds.append(time.perf_counter() - start)
        steps.append({**(metrics[-1] if metrics else {}), "reward": float(batch.rewards.mean()),
                      "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                      "completions/mean_length": float(batch.mask.sum(-1).float().mean()),
                      "staleness": step - batch.sampled_at})
        evaluate_at(step + 1)
    return {"history": history, "step_seconds": seconds, "steps": steps,
            "finite": all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)}
