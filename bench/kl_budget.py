"""KL budget on the exact demo problem (issue 23): does beta follow a KL target, and does the policy end near pi*?

Usage (one part per framework environment; every part writes bench/results/kl_budget_<part>.{json,txt,png} with --out):
    .venvs/trl/bin/python bench/kl_budget.py rules      the update rules compared, no framework (core kl_term)
    .venvs/trl/bin/python bench/kl_budget.py trl        TRL's GRPOTrainer.train() with KLGRPOConfig(kl_target=...)
    .venvs/verl/bin/python bench/kl_budget.py verl      verl's ppo_loss (harness), budget + verl's adaptive kl_ctrl
    .venvs/openrlhf/bin/python bench/kl_budget.py openrlhf   OpenRLHF's training_step (harness), budget + --algo.kl.target
    options: --seeds 3 --steps 600 --group 256 --lr 6e-3 --beta 0.2 --workers 2 --configs a,b --out DIR

Problem: kl_adapters.demo's ToyProblem (31 completions of a tiny GPT-2, reward "answer"), beta* = --beta. Per seed
the target is KL(pi*(beta*) || pi_ref) of that seed's reference, computed exactly, so the budget's right answer is
beta* and its fixed point the policy pi*(beta*). Each budget configuration starts from beta*/10 and from 10 beta*
(in the framework's units of beta, below); "fixed beta*" trains at beta* without a budget (the noise floor: the exact
KL of a policy trained at the right beta still fluctuates around the target). Every step is evaluated exactly
(`ExactEvaluator`: KL(pi || pi_ref), KL(pi || pi*(beta*))).

Reported per configuration and start, mean +- standard error over seeds (and per seed): the tracking error, the mean
over the last quarter of the steps of |KL(pi || pi_ref) / target - 1| (exact KL; target <= 10% on every seed), its
maximum there, the final |KL / target - 1|, the final KL(pi || pi*(beta*)) and the final beta / beta*.

Units of beta and what runs, per part (G completions per step, token-mean task losses as in bench/demo_*.py):
  rules     the harness (`harness.train`) with task + kl_term(preset sequence).surrogate(beta (G-1)/G / T): beta in
            the objective's units; rules "pi", "dual", "ziegler" of kl_adapters.budget with their default gains.
  trl       KLGRPOConfig(kl_preset="sequence", kl_target=target, beta=start), TRL's beta* = beta* (G-1)/G
            (kl_adapters.demo.trl_runner); the adapter's KLBudgetCallback updates it every optimizer step.
  verl      bench/demo_verl.py's VerlLoss. Budget: kl_loss_type=kl_adapters:sequence:kl_target=<target>,
            kl_loss_coef=start (beta* = beta* (G-1)/G); the harness plays verl's driver (the adapter's _ship_beta):
            it ships the budget's beta with the batch (kl_adapters_beta) and updates it from ppo_loss's
            kl_adapters/seq_kl. Native: algorithm.use_kl_in_reward with verl's k1 ("kl") and
            algorithm.kl_ctrl.type=adaptive, target_kl=<the same target>, horizon = 10 G (Ziegler's K = 0.1 per
            step; verl's default 10000 moves beta at most 0.5% per step here), through apply_kl_penalty +
            compute_advantage(grpo, no std) + ppo_loss.
  openrlhf  bench/demo_openrlhf.py's OpenRLHFLoss (--algo.kl.use_loss, k3). Budget: --algo.kl.preset sequence,
            kl_ctl = the budget's beta (init_coef's units, the KL over the policy loss's token count; beta* = beta*
            (G-1)/G; bench/results/kl_budget_openrlhf.* ran when the adapter weighed the sequence KL per sequence,
            with beta* (G-1)/G / E_ref[length] there, docs/kl_budget.md), the harness playing PPOTrainer's role (the adapter's train_step wrapper: beta as kl_ctl, updated from the
            step's kl_adapters/seq_kl). Native: --algo.kl.target <the same target>, OpenRLHF's
            AdaptiveKLController(init_coef, target, horizon = 10 G) updated with the step's "kl" (its token-mean k3)
            and G, as PPOTrainer.train_step does; beta* = beta* (G-1)/G.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import shlex
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("KL_ADAPTERS", None)  # only each configuration's own flag selects kl-adapters
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "openrlhf")]

PARTS = ("rules", "trl", "verl", "openrlhf")
STARTS = (0.1, 10.0)
#: native adaptive controllers: horizon = HORIZON_PER_SAMPLE * G, so that n_steps / horizon = 0.1 per step (Ziegler's K)
HORIZON_PER_SAMPLE = 10
TRACKING_TARGET = 0.10


@dataclass(frozen=True)
class Run:
    part: str
    config: str
    start: float  # initial beta / beta* (1.0: fixed beta*)
    seed: int
    steps: int
    group: int
    lr: float
    beta: float  # beta*


#: part -> configuration -> description
CONFIGS: dict[str, dict[str, str]] = {
    "rules": {"pi": "kl_adapters.budget rule 'pi' (dual ascent + proportional term; k_i 0.02, k_p 0.5)",
              "dual": "rule 'dual' (dual ascent on log beta; k_i 0.02)",
              "ziegler": "rule 'ziegler' (Ziegler et al. 2019; K 0.1, error clipped at 0.2)",
              "fixed beta*": "no budget, beta = beta*"},
    "trl": {"kl_target": "KLGRPOConfig(kl_preset='sequence', kl_target=target)",
            "fixed beta*": "KLGRPOConfig(kl_preset='sequence'), beta = beta*"},
    "verl": {"kl_target (loss)": "actor.kl_loss_type=kl_adapters:sequence:kl_target=<target>",
             "verl adaptive (reward)": "algorithm.kl_ctrl.type=adaptive target_kl=<target>, kl_penalty=kl in reward",
             "fixed beta*": "actor.kl_loss_type=kl_adapters:sequence, kl_loss_coef = beta*"},
    "openrlhf": {"kl_target (loss)": "--algo.kl.preset sequence with the budget's beta as kl_ctl",
                 "openrlhf adaptive (loss)": "--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.target <target>",
                 "fixed beta*": "--algo.kl.preset sequence, kl_ctl = beta* (G-1)/G"},
}


def runs_of(part: str, configs: list[str], seeds: int, steps: int, group: int, lr: float, beta: float) -> list[Run]:
    return [Run(part, c, start, s, steps, group, lr, beta) for s in range(seeds) for c in configs
            for start in ((1.0,) if c == "fixed beta*" else STARTS)]


def target_of(problem, seed: int) -> tuple[float, object]:
    """KL(pi*(beta*) || pi_ref) of the seed's reference (exact), and the evaluator."""
    from kl_adapters.demo.problem import ExactEvaluator, sequence_logprobs

    evaluator = ExactEvaluator(problem, sequence_logprobs(problem, problem.model(seed)))
    p = evaluator.optimum.exp()
    return float((p * (evaluator.optimum - evaluator.ref)).sum()), evaluator


# ---- the parts ------------------------------------------------------------------------------------------------------


class Controlled:
    """A harness.LossFn that runs `step(model, batch, beta)` (a framework's loss with coefficient beta, returning the
    loss and that step's sequence-KL estimate) and updates a KLBudget from the estimate after each step."""

    def __init__(self, budget, step):
        self.budget, self.step, self.betas, self.estimates = budget, step, [], []

    def __call__(self, model, batch):
        beta = self.budget.beta
        loss, kl = self.step(model, batch, beta)
        self.betas.append(beta)
        self.estimates.append(kl)
        self.budget.observe(kl, 1)
        self.budget.update()
        return loss


def budget_for(run: Run, target: float, beta_star: float, rule: str = "pi"):
    """The controller of a run, starting at start * beta_star (its framework's units); a fixed-beta* run is a budget
    that never moves (rule 'dual' with k_i 0), so every configuration logs the same way."""
    from kl_adapters.budget import KLBudget

    if run.config == "fixed beta*":
        return KLBudget(target, beta_star, rule="dual", gains={"k_i": 0.0})
    return KLBudget(target, run.start * beta_star, rule=rule)


def run_rules(run: Run, problem, target: float):
    from kl_adapters.demo.harness import batch_logps, kl_coefficient, train
    from kl_adapters.surrogate import kl_term

    scale = kl_coefficient(problem, run.group) / problem.beta / problem.horizon  # (G-1)/G / T

    def step(model, batch, beta):
        logp = batch_logps(model, batch)
        task = -(batch.advantages[:, None] * logp).sum() / (run.group * problem.horizon)
        term = kl_term(logp, batch.ref_logp, batch.completion_mask, preset="sequence")
        return task + term.surrogate(beta * scale), float(term.sequence_kl.mean())

    rule = "dual" if run.config == "fixed beta*" else run.config
    loss = Controlled(budget_for(run, target, problem.beta, rule), step)
    history = train(problem, loss, seed=run.seed, steps=run.steps, group=run.group, learning_rate=run.lr)
    return history, loss.betas, loss.estimates


def run_trl(run: Run, problem, target: float):
    from kl_adapters.demo.harness import TrainSettings
    from kl_adapters.demo.trl_runner import make_trainer, train_exactly

    beta_star = problem.beta * (run.group - 1) / run.group
    budget = {} if run.config == "fixed beta*" else {"kl_target": target}
    trainer = make_trainer(problem, "sequence", run.seed, TrainSettings(run.steps, run.group, run.lr),
                           {"beta": run.start * beta_star, "logging_steps": 1, **budget})
    history = train_exactly(problem, trainer)
    logs = [r for r in trainer.state.log_history if "kl_adapters/seq_kl" in r]
    betas = [r.get("kl_adapters/beta", trainer.args.beta) / beta_star * problem.beta for r in logs]
    return history, betas, [r["kl_adapters/seq_kl"] for r in logs]


def run_verl(run: Run, problem, target: float):
    from demo_verl import VerlLoss

    from kl_adapters.adapters.verl import BETA_KEY
    from kl_adapters.demo.harness import kl_coefficient, train

    coef = kl_coefficient(problem, run.group)
    if run.config == "verl adaptive (reward)":
        from verl.trainer.ppo.core_algos import AdaptiveKLController

        loss = VerlLoss(problem, "kl_adapters:reward (reward path)", run.group)
        loss.estimator = "kl"  # verl's own k1 in the reward: the adapter stays off
        loss.kl_ctrl = AdaptiveKLController(init_kl_coef=run.start * coef, target_kl=target,
                                            horizon=HORIZON_PER_SAMPLE * run.group)
        betas = []

        def native(model, batch):
            betas.append(loss.kl_ctrl.value / coef * problem.beta)
            return loss(model, batch)

        history = train(problem, native, seed=run.seed, steps=run.steps, group=run.group, learning_rate=run.lr)
        return history, betas, [m["kl_adapters/seq_kl"] if "kl_adapters/seq_kl" in m else None for m in loss.metrics]
    from dataclasses import replace

    loss = VerlLoss(problem, "kl_adapters:sequence", run.group)
    if run.config != "fixed beta*":
        loss.actor = replace(loss.actor, kl_loss_type=f"kl_adapters:sequence:kl_target={target!r}")

    def step(model, batch, beta):
        if run.config != "fixed beta*":  # (fixed: kl_loss_coef = beta* already)
            loss.non_tensor[BETA_KEY] = beta  # what the adapter's driver (_ship_beta) ships with each update
        out = loss(model, batch)
        return out, loss.metrics[-1]["kl_adapters/seq_kl"]

    controlled = Controlled(budget_for(run, target, coef), step)
    history = train(problem, controlled, seed=run.seed, steps=run.steps, group=run.group, learning_rate=run.lr)
    return history, [b / coef * problem.beta for b in controlled.betas], controlled.estimates


def run_openrlhf(run: Run, problem, target: float):
    import kl_adapters
    from demo_openrlhf import OpenRLHFLoss

    from kl_adapters.demo.harness import kl_coefficient, train

    coef = kl_coefficient(problem, run.group)
    kl_adapters.disable()
    try:
        if run.config == "openrlhf adaptive (loss)":
            from openrlhf.trainer.ppo_utils.kl_controller import AdaptiveKLController

            loss = OpenRLHFLoss(problem, "openrlhf-default-k3", run.group)
            controller = AdaptiveKLController(run.start * coef, target, HORIZON_PER_SAMPLE * run.group)
            loss.kl_ctl = lambda: controller.value
            betas = []

            def native(model, batch):
                betas.append(controller.value / coef * problem.beta)
                out = loss(model, batch)
                controller.update(loss.metrics[-1]["kl"], run.group)  # PPOTrainer.train_step's update
                return out

            history = train(problem, native, seed=run.seed, steps=run.steps, group=run.group, learning_rate=run.lr)
            return history, betas, [m.get("kl_adapters/seq_kl") for m in loss.metrics]
        loss = OpenRLHFLoss(problem, "kl_adapters:sequence", run.group)
        current = {}
        loss.kl_ctl = lambda: current["beta"]  # the budget's (fixed beta*: beta* (G-1)/G, never moving)

        def step(model, batch, beta):
            current["beta"] = beta
            out = loss(model, batch)
            return out, loss.metrics[-1]["kl_adapters/seq_kl"]

        controlled = Controlled(budget_for(run, target, coef), step)
        history = train(problem, controlled, seed=run.seed, steps=run.steps, group=run.group, learning_rate=run.lr)
        return history, [b / coef * problem.beta for b in controlled.betas], controlled.estimates
    finally:
        kl_adapters.disable()


RUNNERS = {"rules": run_rules, "trl": run_trl, "verl": run_verl, "openrlhf": run_openrlhf}


def execute(run: Run) -> dict:
    """One run, in a worker process: exact history, beta / beta* per step (beta in the objective's units), the
    controller's estimate per step, the target."""
    import torch

    from kl_adapters.demo.problem import ToyProblem

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    problem = ToyProblem(beta=run.beta)
    target, _ = target_of(problem, run.seed)
    start = time.perf_counter()
    history, betas, estimates = RUNNERS[run.part](run, problem, target)
    return {"config": run.config, "start": run.start, "seed": run.seed, "target": target, "beta_star": run.beta,
            "history": history, "beta": betas, "estimate": estimates, "seconds": time.perf_counter() - start}


# ---- summary --------------------------------------------------------------------------------------------------------


def errors_of(result: dict) -> dict:
    """Tracking error and the final state of one run (exact KL), beta relative to beta*."""
    kl = [h["kl_ref"] for h in result["history"]]
    rel = [abs(k / result["target"] - 1) for k in kl]
    tail = rel[len(rel) * 3 // 4:]
    return {"tracking": statistics.fmean(tail), "tracking_max": max(tail), "final": rel[-1],
            "kl_opt": result["history"][-1]["kl_opt"], "beta_ratio": result["beta"][-1] / result["beta_star"]}


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for key in dict.fromkeys((r["config"], r["start"]) for r in results):
        runs = sorted((r for r in results if (r["config"], r["start"]) == key), key=lambda r: r["seed"])
        per_seed = [errors_of(r) for r in runs]
        row = {"config": key[0], "start": key[1], "seeds": [r["seed"] for r in runs],
               "targets": [r["target"] for r in runs]}
        for metric in per_seed[0]:
            values = [e[metric] for e in per_seed]
            row[metric] = {"mean": mean_se(values)[0], "se": mean_se(values)[1], "per_seed": values}
        row["met"] = all(v <= TRACKING_TARGET for v in row["tracking"]["per_seed"])
        rows.append(row)
    return rows


def table(rows: list[dict], title: str) -> str:
    head = (f"{'configuration':<26} {'start':>7}  {'tracking error (last 1/4)':>27}  {'max':>6}  {'final':>6}  "
            f"{'KL(pi||pi*) final':>19}  {'beta/beta*':>10}  per-seed tracking        <= 10%")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        start = "beta*" if r["start"] == 1.0 else f"{r['start']:g}b*"
        t, k = r["tracking"], r["kl_opt"]
        lines.append(
            f"{r['config']:<26} {start:>7}  {100 * t['mean']:>18.1f}% +- {100 * t['se']:4.1f}%  "
            f"{100 * r['tracking_max']['mean']:>5.0f}%  {100 * r['final']['mean']:>5.1f}%  "
            f"{k['mean']:>10.4f} +- {k['se']:.4f}  {r['beta_ratio']['mean']:>10.2f}  "
            + ", ".join(f"{100 * v:.1f}%" for v in t["per_seed"]).ljust(24) + f" {'met' if r['met'] else 'NOT met'}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    keys = list(dict.fromkeys((r["config"], r["start"]) for r in results))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, key in enumerate(keys):
        color = colors[i % len(colors)]
        label = f"{key[0]} from {'beta*' if key[1] == 1.0 else f'{key[1]:g} beta*'}"
        for j, r in enumerate(x for x in results if (x["config"], x["start"]) == key):
            kw = {"color": color, "lw": 1.0, "alpha": 0.8, "label": label if j == 0 else None}
            axes[0].plot([h["kl_ref"] / r["target"] for h in r["history"]], **kw)
            axes[1].plot([b / r["beta_star"] for b in r["beta"]], **kw)
            axes[2].plot([h["kl_opt"] for h in r["history"]], **kw)
    axes[0].axhspan(1 - TRACKING_TARGET, 1 + TRACKING_TARGET, color="grey", alpha=0.2)
    axes[0].set(yscale="log", xlabel="optimizer step", ylabel="KL(pi || pi_ref) / target  (exact)")
    axes[1].set(yscale="log", xlabel="optimizer step", ylabel="beta / beta*")
    axes[2].set(yscale="log", xlabel="optimizer step", ylabel="KL(pi || pi*(beta*))  (exact)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--group", type=int, default=256)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--beta", type=float, default=0.2, help="beta* (0.2: the demo's)")
    parser.add_argument("--configs", help="comma-separated subset of the part's configurations")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="kl-adapters-demo")
    args = parser.parse_args(argv)
    configs = list(CONFIGS[args.part]) if not args.configs else [c.strip() for c in args.configs.split(",")]
    unknown = set(configs) - set(CONFIGS[args.part])
    if unknown:
        raise SystemExit(f"unknown configuration(s) {sorted(unknown)}; valid: {', '.join(CONFIGS[args.part])}")
    runs = runs_of(args.part, configs, args.seeds, args.steps, args.group, args.lr, args.beta)
    interpreter = Path(sys.executable)
    command = " ".join(shlex.quote(a) for a in [
        *([f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []),
        str(interpreter.relative_to(ROOT)) if interpreter.is_relative_to(ROOT) else str(interpreter),
        "bench/kl_budget.py", *sys.argv[1:]])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"kl_budget_{args.part}"
    from kl_adapters.demo.output import output_to

    with output_to(out / f"{name}.log") as say:
        return _main(args, runs, configs, command, out, name, say)


def _main(args, runs: list[Run], configs: list[str], command: str, out: Path, name: str, say) -> int:
    """The runs, the table, the files; `say` prints to the terminal (the frameworks' output goes to <name>.log)."""
    say(f"{name}: {len(runs)} runs ({', '.join(configs)}; seeds {args.seeds}, {args.steps} steps, G={args.group}, "
        f"lr {args.lr}, beta* {args.beta}), {args.workers} workers; frameworks' output -> {out / name}.log")
    began = time.perf_counter()
    results = []
    context = multiprocessing.get_context("spawn")
    with (ProcessPoolExecutor(args.workers, mp_context=context) if args.workers else contextlib.nullcontext()) as pool:
        jobs = [pool.submit(execute, run) for run in runs] if pool else None
        for k, run in enumerate(runs):
            result = jobs[k].result() if pool else execute(run)
            results.append(result)
            e = errors_of(result)
            say(f"  [{k + 1:>2}/{len(runs)}] {run.config:<24} start {run.start:>4g} seed {run.seed}: target "
                f"{result['target']:.3f}, tracking error {100 * e['tracking']:.1f}%, KL(pi||pi*) {e['kl_opt']:.4f}, "
                f"beta/beta* {e['beta_ratio']:.2f} ({result['seconds']:.0f} s; "
                f"{time.perf_counter() - began:.0f} s so far)")
    rows = summarize(results)
    title = (f"KL budget, part {args.part!r}: demo problem (31 sequences, reward 'answer'), beta* = {args.beta}, "
             f"target = KL(pi*(beta*) || pi_ref) per seed, G={args.group}, {args.steps} steps, lr {args.lr}, "
             f"seeds {', '.join(str(s) for s in range(args.seeds))} (mean +- se)")
    text = table(rows, title) + "\n\nconfigurations:\n" + "\n".join(
        f"  {c}: {CONFIGS[args.part][c]}" for c in configs)
    text += f"\n\nwall time {time.perf_counter() - began:.0f} s ({args.workers} workers)"
    say("\n" + text)
    (out / f"{name}.txt").write_text(f"$ {command}\n\n{text}\n")
    (out / f"{name}.json").write_text(json.dumps({"command": command, "environment": environment(),
                                                  "summary": rows, "runs": results}, indent=1) + "\n")
    plot(results, out / f"{name}.png", title)
    say(f"\n{out / name}.{{txt,json,png,log}}")
    return 0


def environment() -> dict:
    from kl_adapters.demo.output import environment as demo_environment

    return demo_environment()


if __name__ == "__main__":
    raise SystemExit(main())
