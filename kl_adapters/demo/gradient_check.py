"""The demo's first table: the exact expected KL gradient of a framework's real loss, against grad KL(pi || pi_ref).

For the toy policy pi at a given state and a framework's real loss under one KL configuration, fed batches with zero
advantages (so that only its KL term has a gradient):

    E[g] = sum over every batch b of  P(b) * grad loss(b) / (s(b) * B)

where the batches are every completion y (B = 1, P = pi(y)) or, for a batch estimator (a preset with leave-one-out
statistics over the other rows: the reduced `sequence` / `reward`), every pair {y1, y2} (B = 2, P = pi(y1) pi(y2),
twice that for y1 != y2: the loss is a sum over rows, so both orders give the same loss), and s(b) is the framework's
documented KL scale: grad loss(b) = s(b) * sum_rows g(row), with g the configuration's per-sequence gradient estimate.
E[g] is compared with the exact gradient, by autograd through the enumerated sequence KL of the model,

    grad KL_seq = grad sum_y pi(y) (log pi(y) - log pi_ref(y)),

as the relative bias |E[g] - grad KL_seq| / |grad KL_seq| and the cosine. Exact up to float32 rounding: an unbiased
configuration shows ~1e-6. Pinned by tests/trl/test_demo.py::test_gradient_check_through_trls_compute_loss.

The states: at the initial state pi = pi_ref and every KL gradient is 0, so the check runs at the policy after a few
exact ascent steps on J (Adam on the enumerated objective, `ascended`), i.e. on the way from pi_ref to pi*.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .harness import Batch, LossFn
from .problem import ToyProblem, completion_logprobs, enumerated_input_ids

#: exact ascent steps on J before each check (0 would be pi = pi_ref, where every KL gradient vanishes)
STATES = (10, 40)
ASCENT_LR = 1e-2


@dataclass(frozen=True)
class CheckRow:
    config: str
    state: int  # exact ascent steps taken before the check
    batch_rows: int  # 1: every completion; 2: every pair (batch estimators)
    relative_bias: float
    cosine: float


def ascended(problem: ToyProblem, model: torch.nn.Module, ref: Tensor, steps: int) -> torch.nn.Module:
    """`model` after `steps` Adam steps (lr ASCENT_LR) on the exact J(pi) = E[r] - beta KL(pi || pi_ref), in place.

    `ref` is the [N] sequence log-probs of pi_ref."""
    optimizer = torch.optim.Adam(model.parameters(), lr=ASCENT_LR)
    for _ in range(steps):
        logp = _sequence_logps(problem, model)
        p = logp.exp()
        objective = (p * problem.rewards).sum() - problem.beta * (p * (logp - ref)).sum()
        optimizer.zero_grad(set_to_none=True)
        (-objective).backward()
        optimizer.step()
    return model


def exact_kl_gradient(problem: ToyProblem, model: torch.nn.Module, ref: Tensor) -> Tensor:
    """grad KL(pi || pi_ref) = grad sum_y pi(y) (log pi(y) - log pi_ref(y)), flattened, float64."""
    logp = _sequence_logps(problem, model)
    return _flat_grad((logp.exp() * (logp - ref)).sum(), model)


def expected_kl_gradient(problem: ToyProblem, model: torch.nn.Module, ref_logp: Tensor, loss_fn: LossFn,
                         scale: Callable[[Batch], float], batch_rows: int) -> Tensor:
    """E[g] (module docstring) of `loss_fn` at the model's current policy, by enumerating every batch of
    `batch_rows` (1 or 2) completions. `ref_logp` is the [N, T] per-token log pi_ref of every completion."""
    return sum(weight * g for weight, g in batch_gradients(problem, model, ref_logp, loss_fn, scale, batch_rows))


def batch_gradients(problem: ToyProblem, model: torch.nn.Module, ref_logp: Tensor, loss_fn: LossFn,
                    scale: Callable[[Batch], float], batch_rows: int, *, with_task: bool = False
                    ) -> Iterator[tuple[float, Tensor]]:
    """(probability, g) of every batch of `batch_rows` (1 or 2) completions at the model's current policy: g the
    flattened float64 gradient of `loss_fn` divided by scale(batch) * batch_rows (the batch's per-row estimate).
    Advantages are zero (the KL term alone), or with_task the batch's GRPO advantages r_i - mean_j r_j."""
    if batch_rows not in (1, 2):
        raise ValueError(f"batch_rows must be 1 (every completion) or 2 (every pair), got {batch_rows}")
    with torch.no_grad():
        logp = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
    p = logp.double().sum(-1).exp()
    params = list(model.parameters())
    for rows, weight in _batches(p, batch_rows):
        batch = enumerated_batch(problem, rows, logp, ref_logp, with_task=with_task)
        grads = torch.autograd.grad(loss_fn(model, batch), params, allow_unused=True)
        g = torch.cat([(torch.zeros_like(q) if x is None else x).flatten().double() for x, q in zip(grads, params)])
        yield weight, g / (scale(batch) * batch_rows)


def batch_rows(preset: str | None) -> int:
    """Rows per enumerated batch for a configuration: 2 for a kl-adapters preset with batch statistics, else 1."""
    from ..presets import get_preset

    return 2 if preset is not None and get_preset(preset).uses_batch_statistics else 1


def check(problem: ToyProblem, model: torch.nn.Module, ref_logp: Tensor,
          loss_fns: dict[str, tuple[Callable[[], LossFn], int]], scale: Callable[[Batch], float],
          states: tuple[int, ...] = STATES) -> list[CheckRow]:
    """One CheckRow per (configuration, state). loss_fns maps a configuration to (a factory of its loss, batch rows);
    the loss is made right before its enumeration (a framework whose activation is per process, as OpenRLHF's, holds
    one configuration at a time). Moves `model` (to the last state)."""
    ref = ref_logp.double().sum(-1)
    rows, done = [], 0
    for state in states:
        ascended(problem, model, ref, state - done)
        done = state
        exact = exact_kl_gradient(problem, model, ref)
        for config, (make_loss, n_rows) in loss_fns.items():
            est = expected_kl_gradient(problem, model, ref_logp, make_loss(), scale, n_rows)
            rows.append(CheckRow(config, state, n_rows, float((est - exact).norm() / exact.norm()),
                                 float(torch.nn.functional.cosine_similarity(est, exact, dim=0))))
    return rows


def table(rows: list[CheckRow], framework: str) -> str:
    """The check as text: one line per configuration, relative bias and cosine at each state."""
    states = sorted({r.state for r in rows})
    configs = list(dict.fromkeys(r.config for r in rows))
    width = max(16, *(len(c) + len(" (pairs)") + 2 for c in configs))
    head = f"{'configuration':<{width}}" + "".join(f"{f'after {s} steps: bias   cosine':>34}" for s in states)
    lines = [f"Exact gradient check through {framework}'s loss: expected KL gradient vs grad KL(pi || pi_ref), every "
             "completion enumerated", head, "-" * len(head)]
    for config in configs:
        cells = {r.state: r for r in rows if r.config == config}
        pairs = " (pairs)" if cells[states[0]].batch_rows == 2 else ""
        lines.append(f"{config + pairs:<{width}}" + "".join(
            f"{_percent(cells[s].relative_bias):>25}{cells[s].cosine:>9.4f}" for s in states))
    lines.append("bias = |E[g] - grad KL| / |grad KL| (float32 rounding: ~1e-6); pi = pi_ref after " + " and ".join(
        map(str, states)) + " exact ascent steps on J; (pairs): a batch estimator, every pair of completions enumerated")
    return "\n".join(lines)


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 1e-3 else f"{x:.0e}"


def enumerated_batch(problem: ToyProblem, rows: Tensor, logp: Tensor, ref_logp: Tensor, *,
                     with_task: bool = False) -> Batch:
    """The completions `rows` as a Batch with zero rewards and advantages (only a KL term has a gradient), or with_task
    their rewards and GRPO advantages r_i - mean_j r_j."""
    rewards = problem.rewards[rows].float() if with_task else torch.zeros(len(rows))
    return Batch(input_ids=enumerated_input_ids(problem)[rows], completion_mask=problem.space.mask[rows],
                 rewards=rewards, advantages=rewards - rewards.mean() if with_task else rewards,
                 old_logp=logp[rows], ref_logp=ref_logp[rows])


def _batches(p: Tensor, batch_rows: int) -> Iterator[tuple[Tensor, float]]:
    """(rows, probability) of every batch: each completion, or each unordered pair (weight 2 p_i p_j for i != j)."""
    n = len(p)
    if batch_rows == 1:
        for i in range(n):
            yield torch.tensor([i]), float(p[i])
        return
    for i in range(n):
        for j in range(i, n):
            yield torch.tensor([i, j]), float(p[i] * p[j] * (1 if i == j else 2))


def _sequence_logps(problem: ToyProblem, model: torch.nn.Module) -> Tensor:
    lp = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask, torch.float64)
    return lp.sum(-1)


def _flat_grad(value: Tensor, model: torch.nn.Module) -> Tensor:
    grads = torch.autograd.grad(value, list(model.parameters()), allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten().double()
                      for g, p in zip(grads, model.parameters())])
