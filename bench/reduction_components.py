"""Each switch of `ReductionConfig` turned off, one at a time: what it does to the variance of the trained gradient.

Usage: .venvs/core/bin/python bench/reduction_components.py tabular    (exact; writes reduction_components_tabular.*)
       .venvs/core/bin/python bench/reduction_components.py bigram [--switches termination james_stein
                                                                   termination+james_stein] (a+b: both off at once)
                                                                       (writes reduction_components_bigram.*)
       .venvs/core/bin/python bench/reduction_components.py tied [--switches ...]
                                                                       (writes reduction_components_tied.*)
       .venvs/trl/bin/python bench/reduction_components.py gpt2 [--horizon 32] [--step 50 200] [--groups 32]
                                                                   [--switches ...] (as for bigram)
                                                                       (writes reduction_components_gpt2_T<horizon>.*)
(bench/results/<name>.{txt,json}; --name overrides the name.)

Every row is `sequence` with every other part as by default, the variance of the gradient a trainer takes (task +
KL) with one switch off relative to it with every switch on: above 1, the switch lowers the variance there (`fit` off
is `sequence-plain`). Each switch keeps the gradient exact (tests/core/test_reduction_config.py), so every row
estimates the same gradient. Three problems:

* tabular, exact (`audit.batch_moments(total=True)`: every ordered batch of G = 4, the batch size of
  tests/core/test_reduction_benefit.py, on V = 3, T = 3, GRPO advantages r - the batch mean, task beta 0.5, the
  termination control variate on, no noise): `drifted` (the exact audit's problems: pi = pi_ref + drift x N(0, 1)
  per logit, a reward ~ U[0, 1) per sequence, off-policy from mu = pi + 0.5 x N(0, 1)); `trained` (the policy after
  exact Adam ascent on E[R] - 0.5 KL from pi_ref, R = 5 r with r ~ U[0, 1): bench/tabular_variance.py's problem at its
  beta 0.1; off-policy mu = pi + 0.3 x N(0, 1)); `far off` (the drifted problem from mu = pi + s x N(0, 1), s = 2, 3:
  prefix importance weights past e^(+-4), where the baseline fade acts);
* bigram (bench/variance.py's model: V = 16, rare EOS, R = task x the number of token-0 draws, beta 0.1, policies
  after `state` exact ascent steps from the drifted one), Monte Carlo over `batches` batches of G = 8, every
  configuration on the same batches: the ratio of mean squared distances to the exact expected gradient with a
  paired delta-method standard error. A negative task penalizes token 0, so that the trained policy suppresses a
  token the reference allows (the unseen tail of xi);
* tied: the bigram with task 0 at the drifted policy, the gradient a GRPO trainer takes from a group whose rewards
  tie (its advantages are all zero, so the group's gradient is the KL term alone; `frac_reward_zero_std` in TRL's
  logs is the share of such groups), at T = 256 and 1024, drift 0.05 and 0.2, G = 8;
* gpt2: the long-horizon GPT-2 through TRL's compute_loss (`long_horizon_trl.training_gradients`: groups of G = 32
  completions, the policy after `step` steps of a `sequence-plain` GRPOTrainer.train() run, bench/long_horizon.py's
  settings), the ratio of covariance traces on the same groups with a paired jackknife standard error.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
import variance  # noqa: E402
from tabular_toys import problem as tabular_problem  # noqa: E402
from tabular_variance import ascent_path  # noqa: E402
from timing import write_result_and_table  # noqa: E402

from kl_adapters.audit import batch_moments, random_policies, sequence_space  # noqa: E402
from kl_adapters.reductions import ReductionConfig, reduction_config  # noqa: E402

#: every switch of ReductionConfig (its bool fields), in declaration order
SWITCHES = tuple(f.name for f in fields(ReductionConfig) if f.type in (bool, "bool"))
DEFAULT = ReductionConfig()
#: the tabular problems' sequences, the task's beta of `batch_moments` (its GRPO advantages) and the reward scale
#: that makes it r's beta 0.1
SPACE, TABULAR_BETA, TRAINED_SCALE = sequence_space(3, 3), 0.5, 5.0


def without(switch: str) -> ReductionConfig:
    """The default configuration with one switch off ("a+b": those switches off together)."""
    return ReductionConfig(**{name: False for name in switch.split("+")})


@dataclass(frozen=True)
class Tabular:
    """One exact tabular problem: pi's, pi_ref's and (off-policy) mu's logits over V = 3, T = 3, and the rewards."""

    label: str
    logits: Tensor
    ref_logits: Tensor
    behaviour: Tensor | None
    rewards: Tensor


def drifted(seed: int, drift: float, off_policy: float | None) -> Tabular:
    """The exact audit's problem (`audit.task_audit`): pi = pi_ref + drift x N(0, 1), reward ~ U[0, 1) per sequence;
    mu = pi + off_policy x N(0, 1) (None: on-policy)."""
    pol = random_policies(3, 3, seed, drift=drift, off_policy=off_policy or 0.0)
    rewards = torch.rand(pol.space.num_sequences, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    regime = "on" if off_policy is None else f"off {off_policy:g}"
    return Tabular(f"drifted seed {seed} drift {drift:g} {regime}", pol.logits, pol.ref_logits,
                   None if off_policy is None else pol.behaviour_logits, rewards)


def trained(seed: int, steps: int, off_policy: bool) -> Tabular:
    """The policy after `steps` exact Adam steps (lr 0.05) on E[R] - 0.5 KL(pi || pi_ref) from pi_ref, R = 5 r,
    r ~ U[0, 1) per sequence (bench/tabular_toys.py's problem); off-policy mu = pi + 0.3 x N(0, 1)."""
    ref, r = tabular_problem(SPACE, seed, 1.0)
    rewards = TRAINED_SCALE * r
    logits = ascent_path(SPACE, ref, rewards, TABULAR_BETA, [steps], 0.05)[steps]
    behaviour = (logits + 0.3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed),
                                            dtype=logits.dtype)) if off_policy else None
    return Tabular(f"trained seed {seed} step {steps} {'off' if off_policy else 'on'}", logits, ref, behaviour,
                   rewards)


def tabular_variance(p: Tabular, config: ReductionConfig, group: int = 4) -> float:
    """tr Cov of `sequence`'s task + KL batch gradient under `config`, exact over every ordered batch of `group`."""
    with reduction_config(config):
        return batch_moments(SPACE, p.logits, p.ref_logits, "sequence", group, behaviour_logits=p.behaviour,
                             rewards=p.rewards, eos=True, total=True)[1]


def tabular_ratios(p: Tabular, switches: tuple[str, ...] = SWITCHES, group: int = 4) -> dict[str, float]:
    """{switch: variance with it off / variance with every switch on}, exact."""
    base = tabular_variance(p, DEFAULT, group)
    return {s: tabular_variance(p, without(s), group) / base for s in switches}


@dataclass(frozen=True)
class BigramCell:
    """One cell of the bigram problem (bench/variance.py): horizon, policy drift, regime ("on" / "off"), ascent
    state, task scale (R = task x the number of token-0 draws), batch size G, batches, beta."""

    horizon: int
    drift: float
    regime: str
    state: int
    task: float
    group: int = 8
    batches: int = 512
    beta: float = 0.1


def bigram_ratios(cell: BigramCell, switches: tuple[str, ...] = SWITCHES) -> dict[str, tuple[float, float]]:
    """{switch: (ratio, standard error)}: mean |g - E g|^2 of the task + KL batch gradient with the switch off over
    the same with every switch on, on the same batches (g: bench/variance.py's g_total, E g exact)."""
    model = variance.bigram(16, cell.horizon, cell.drift, 0.05, 0.25, 0)
    if cell.state:
        model = variance.ascended(model, cell.horizon, cell.state, cell.task, cell.beta, 0.01)
    kl_grad, _ = variance.exact_gradient(model, cell.horizon)
    task_grad, _ = variance.exact_task_gradient(model, cell.horizon, cell.task)
    target = (1 - 1 / cell.group) * task_grad - cell.beta * kl_grad
    probs = torch.softmax(model.logits, -1)
    configs = {"": DEFAULT, **{s: without(s) for s in switches}}
    dist: dict[str, list[Tensor]] = {k: [] for k in configs}
    gen = torch.Generator().manual_seed(1)
    rows, chunk = cell.batches * cell.group, max(cell.group, 2 ** 18 // cell.horizon // cell.group * cell.group)
    for start in range(0, rows, chunk):
        s = variance.sample(model, min(chunk, rows - start), cell.horizon, cell.regime == "off", gen)
        group = torch.arange(s.states.shape[0]) // cell.group
        task = variance.task_advantages(s, cell.group, cell.task, cell.beta)
        g_task = variance.batch_gradients(s, probs, cell.group, task.advantages[:, None])
        for name, config in configs.items():
            with reduction_config(config):
                c, _ = variance.preset_weights("sequence", s, model, group, task=task)
            g = g_task - cell.beta * variance.batch_gradients(s, probs, cell.group, c)
            dist[name].append((g - target).square().sum(-1))
    base = torch.cat(dist[""])
    return {s: variance.ratio_with_se(torch.cat(dist[s]), base) for s in switches}


def paired_ratio(a: Tensor, b: Tensor) -> tuple[float, float]:
    """(tr Cov a / tr Cov b, paired jackknife standard error) of [n, P] gradient samples of the same n groups."""
    from kl_adapters.demo.long_horizon_trl import trace_stats

    def ratio(rows: Tensor) -> float:
        return trace_stats(a[rows])["trace"] / trace_stats(b[rows])["trace"]

    n = len(a)
    loo = torch.tensor([ratio(torch.arange(n) != i) for i in range(n)])
    return ratio(torch.ones(n, dtype=torch.bool)), float(((n - 1) / n * ((loo - loo.mean()) ** 2).sum()).sqrt())


def gpt2_ratios(horizon: int, steps: list[int], groups: int, seed: int = 0,
                switches: tuple[str, ...] = SWITCHES) -> dict[int, dict[str, tuple[float, float]]]:
    """{step: {switch: (ratio, se)}} on the long-horizon GPT-2 (beta 0.2) after `step` steps of a sequence-plain
    run through TRL (G = 32, lr 3e-3), `groups` groups of 32 completions per step, the same for every switch."""
    from kl_adapters.demo.long_horizon_harness import LongSettings
    from kl_adapters.demo.long_horizon_problem import LongHorizonProblem
    from kl_adapters.demo.long_horizon_trl import run_trl, training_gradients

    torch.set_num_threads(1)
    problem = LongHorizonProblem(horizon=horizon, beta=0.2, seed=seed)
    settings = LongSettings(steps=max(steps), group=32, learning_rate=3e-3, eval_every=math.gcd(*steps),
                            eval_samples=8, final_samples=8)
    kept = {}

    def keep(step: int, model: torch.nn.Module) -> None:
        if step in steps:
            kept[step] = {k: v.clone() for k, v in model.state_dict().items()}

    run_trl(problem, "sequence-plain", settings, at_evaluation=keep)
    out = {}
    for step in steps:
        model = problem.model()
        model.load_state_dict(kept[step])
        grads = {}
        for name, config in {"": DEFAULT, **{s: without(s) for s in switches}}.items():
            with reduction_config(config):
                grads[name] = training_gradients(problem, model, ["sequence"], 32, groups, seed=step)["sequence"]
        out[step] = {s: paired_ratio(grads[s], grads[""]) for s in switches}
    return out


def tabular_grid() -> list[Tabular]:
    """The committed tabular grid: the exact audit's 12 cells (3 seeds x 2 drifts x on / off), 12 trained, 6 far
    off."""
    return ([drifted(seed, drift, off) for seed in (0, 1, 2) for drift in (1.0, 0.3) for off in (None, 0.5)]
            + [trained(seed, steps, off) for seed in (0, 1, 2) for steps in (30, 300) for off in (False, True)]
            + [drifted(seed, 1.0, s) for seed in (0, 1, 2) for s in (2.0, 3.0)])


#: the committed bigram grid: the rewarded token at T = 256 and 1024 along the ascent, off-policy, the penalized token
BIGRAM = ([BigramCell(h, 0.2, "on", st, 0.05, batches=512 if h == 256 else 256) for h in (256, 1024)
           for st in (0, 20, 80, 300)]
          + [BigramCell(h, 0.05, "off", st, 0.05, batches=1024 if h == 256 else 512) for h in (256, 1024)
             for st in (20, 80)]
          + [BigramCell(h, 0.2, "on", st, task) for h, task in ((64, -0.5), (256, -0.2), (256, -0.5))
             for st in (80, 300)])


#: the tied-reward grid: the KL term alone, on-policy, at the drifted policy
TIED = [BigramCell(h, drift, "on", 0, 0.0, batches=256 if h == 256 else 128)
        for h in (256, 1024) for drift in (0.05, 0.2)]


def _cells(label: str, ratios: dict[str, tuple[float, float] | float], switches: tuple[str, ...] = SWITCHES) -> str:
    def cell(x):
        return f"{x:>9.4f}" if isinstance(x, float) else f"{x[0]:>6.3f}±{x[1]:<6.3f}"
    return f"{label:<44}" + "".join(f" {cell(ratios[s]):>13}" for s in switches)


def _header(title: str, switches: tuple[str, ...] = SWITCHES) -> list[str]:
    return [title, f"{'problem':<44}" + "".join(f" {s[:13]:>13}" for s in switches)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problem", choices=("tabular", "bigram", "tied", "gpt2"))
    ap.add_argument("--horizon", type=int, default=32, help="gpt2: T")
    ap.add_argument("--step", type=int, nargs="+", default=[50, 200], help="gpt2: the policies measured")
    ap.add_argument("--groups", type=int, default=32, help="gpt2: groups of 32 completions per policy")
    ap.add_argument("--seed", type=int, default=0, help="gpt2: the problem's and the run's seed")
    ap.add_argument("--switches", nargs="+", default=list(SWITCHES), help="bigram, tied, gpt2: the switches turned "
                    "off, one row each; a+b turns a and b off together (default: every switch)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    unknown = [s for s in args.switches for part in s.split("+") if part not in SWITCHES]
    if unknown or (args.problem == "tabular" and args.switches != list(SWITCHES)):
        ap.error(f"--switches: bigram, tied and gpt2 only, each of {', '.join(SWITCHES)} (or a+b); "
                 f"got {' '.join(args.switches)}")
    switches = tuple(args.switches)
    warnings.filterwarnings("ignore")
    note = "variance with the switch off / with every switch on (above 1: the switch lowers the variance)"
    if args.problem == "tabular":
        rows = [{"problem": p.label, "ratios": tabular_ratios(p)} for p in tabular_grid()]
        lines = _header(f"tabular, exact, task + KL, G = 4, V = 3, T = 3: {note}")
        lines += [_cells(r["problem"], r["ratios"]) for r in rows]
    elif args.problem in ("bigram", "tied"):
        rows = []
        for cell in BIGRAM if args.problem == "bigram" else TIED:
            rows.append({"cell": asdict(cell), "ratios": bigram_ratios(cell, switches)})
            print(_cells(_bigram_label(cell), rows[-1]["ratios"], switches), flush=True)
        what = "task + KL" if args.problem == "bigram" else "tied rewards (the KL term alone)"
        lines = _header(f"{args.problem}, {what}, G = 8, {note} (+- paired se)", switches)
        lines += [_cells(_bigram_label(BigramCell(**r["cell"])), r["ratios"], switches) for r in rows]
    else:
        by_step = gpt2_ratios(args.horizon, args.step, args.groups, args.seed, switches)
        rows = [{"step": step, "ratios": ratios} for step, ratios in by_step.items()]
        lines = _header(f"GPT-2 through TRL compute_loss, task + KL, G = 32, T = {args.horizon}, {args.groups} groups "
                        f"(seed {args.seed}): {note} (+- paired jackknife se)", switches)
        lines += [_cells(f"policy after {r['step']} sequence-plain steps", r["ratios"], switches) for r in rows]
    text = "\n".join(lines)
    print(text)
    name = args.name or "reduction_components_" + (f"gpt2_T{args.horizon}" if args.problem == "gpt2" else args.problem)
    write_result_and_table(name, {"switches": list(switches), "rows": rows}, text)
    return 0


def _bigram_label(cell: BigramCell) -> str:
    return (f"T={cell.horizon} drift {cell.drift:g} {cell.regime} state {cell.state} task {cell.task:g}"
            f" ({cell.batches} batches)")


if __name__ == "__main__":
    raise SystemExit(main())
