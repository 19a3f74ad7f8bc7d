"""Variance of TRL's training gradient on the demo's toy problem (task + KL, and the KL term alone): exact over every
pair of completions (G = 2), or Monte Carlo at the training G (issues 16 and 20).

At policies on the exact ascent path from pi_ref towards pi* (`gradient_check.ascended`, Adam on the enumerated J),
batches go through TRL 1.16 GRPOTrainer's real `compute_loss` (the demo's settings, `kl_adapters.demo.trl_runner`;
one prompt, so a batch is one GRPO group) under each configuration, with
  kl    zero advantages: the KL term's gradient alone;
  total GRPO advantages r_i - mean_j r_j of the batch: the gradient a training step takes, task + KL.

Exact mode (--group 2, the default): every unordered pair of completions (probability p_i p_j, twice for i != j); the
mean and covariance trace of the batch gradient are exact, and the KL-only mean is checked against grad KL (relative
bias ~1e-6 for the unbiased presets). A row with one other row gets the plain form (reductions.py), so at G = 2 the
reduced presets differ from the plain ones only through `full`'s exact per-position KL.

Monte Carlo mode (--group G > 2, --batches N): N batches of G completions drawn i.i.d. from pi at each state, the same
batches for every configuration (paired), task + KL only. The N batches form --blocks blocks; each block gives an
unbiased estimate of each configuration's covariance trace, and the ratio to sequence-plain's is reported with a
delta-method standard error over blocks. Bias check: |mean_X - mean_plain|^2 over its expected value under equal
means, tr Cov(g_X - g_plain) / N (about 1 for two unbiased configurations, >> 1 for a biased one).

--trained CONFIG:SEED:STEP (Monte Carlo only, repeatable) measures instead at the policy a real training run visits:
the demo's quick run (`kl-adapters demo`: GRPOTrainer.train(), G = 256, 120-step schedule) of CONFIG from SEED's
initial policy (= its pi_ref), stopped after STEP optimizer steps (the same first STEP steps as the full run).

Configurations: the demo's (trl_runner.SPECS) and `sequence-kl-fit`: `sequence` with the adapter passing neither the
task advantages nor pi(EOS) (its statistics fitted to the KL term alone: the adapter before issue 20, emulated by
filtering `adapters.trl.loss.statistics_inputs`).
Usage: .venvs/trl/bin/python bench/demo_gradient_variance.py [--states 40 150 400] [--configs ...]
       .venvs/trl/bin/python bench/demo_gradient_variance.py --group 256 --batches 800 [--blocks 20] [--seed 0]
       .venvs/trl/bin/python bench/demo_gradient_variance.py --group 256 --trained sequence:27:64 [--trained ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from timing import write_result_and_table  # noqa: E402

from kl_adapters.adapters.trl import loss as trl_loss  # noqa: E402
from kl_adapters.demo import gradient_check, harness, run, trl_runner  # noqa: E402
from kl_adapters.demo.problem import (ExactEvaluator, ToyProblem, completion_logprobs,  # noqa: E402
                                      enumerated_input_ids, sequence_logprobs)

CONFIGS = ("sequence-plain", "sequence", "full", "trl-default")
KL_FIT = "sequence-kl-fit"
PLAIN = "sequence-plain"


class KLOnlyFit:
    """The `sequence` loss with the adapter's statistics inputs stripped of task advantages and pi(EOS)."""

    def __init__(self, loss):
        self.loss = loss

    def __call__(self, model, batch):
        real = trl_loss.statistics_inputs
        trl_loss.statistics_inputs = lambda *a: {k: v for k, v in real(*a).items() if k not in ("task", "eos")}
        try:
            return self.loss(model, batch)
        finally:
            trl_loss.statistics_inputs = real


def loss_factories(problem: ToyProblem, configs: list[str], seed: int = 0):
    """(model, {config: loss factory}, scale): every configuration through one trainer (`trl_runner.check_losses`) on
    the initial policy (= pi_ref) of `seed`."""
    model, losses, scale = trl_runner.check_losses(problem, [c for c in configs if c != KL_FIT] or [PLAIN], seed)
    factories = {c: losses[c][0] for c in configs if c != KL_FIT}
    if KL_FIT in configs:
        factories[KL_FIT] = lambda: KLOnlyFit(trl_runner.CheckLoss(losses[PLAIN][0]().trainer, "sequence"))
    return model, factories, scale


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten().double() for g, p in zip(grads, params)])


def pair_moments(problem: ToyProblem, model, ref_tok: torch.Tensor, loss_fn, scale, with_task: bool):
    """Exact (mean, covariance trace) of the batch-of-2 gradient, flattened, float64."""
    mean, second = 0.0, 0.0
    for weight, g in gradient_check.batch_gradients(problem, model, ref_tok, loss_fn, scale, 2, with_task=with_task):
        mean, second = mean + weight * g, second + weight * float(g @ g)
    return mean, second - float(mean @ mean)


def exact_rows(problem, model, ref_tok, factories, scale, configs, state, exact):
    rows = []
    for config in configs:
        kl_mean, kl_var = pair_moments(problem, model, ref_tok, factories[config](), scale, with_task=False)
        _, total_var = pair_moments(problem, model, ref_tok, factories[config](), scale, with_task=True)
        rows.append({"state": state, "config": config, "kl_bias": float((kl_mean - exact).norm() / exact.norm()),
                     "kl_trace": kl_var, "total_trace": total_var})
        print(f"  state {state}: {config} done", flush=True)
    for r in rows:
        plain = next(p for p in rows if p["config"] == PLAIN)
        r["kl_ratio"], r["total_ratio"] = r["kl_trace"] / plain["kl_trace"], r["total_trace"] / plain["total_trace"]
    return rows


class Blocks:
    """Per-configuration block estimates of the batch gradient's covariance trace, and the paired differences to
    sequence-plain (for the bias check), accumulated without storing gradients."""

    def __init__(self):
        self.sum, self.sq, self.n = {}, {}, 0
        self.block_traces: dict[str, list[float]] = {}
        self.diff_total, self.diff_sq, self.count = {}, {}, 0

    def add(self, grads: dict[str, torch.Tensor]) -> None:
        for c, g in grads.items():
            self.sum[c] = self.sum.get(c, 0.0) + g
            self.sq[c] = self.sq.get(c, 0.0) + float(g @ g)
            d = g - grads[PLAIN]
            self.diff_total[c] = self.diff_total.get(c, 0.0) + d
            self.diff_sq[c] = self.diff_sq.get(c, 0.0) + float(d @ d)
        self.n += 1
        self.count += 1

    def close_block(self) -> None:
        for c in self.sum:
            trace = (self.sq[c] - float(self.sum[c] @ self.sum[c]) / self.n) / (self.n - 1)
            self.block_traces.setdefault(c, []).append(trace)
        self.sum, self.sq, self.n = {}, {}, 0

    def summary(self, config: str) -> dict:
        """Covariance trace, ratio to sequence-plain with its delta-method standard error over blocks, bias check."""
        a, b = self.block_traces[config], self.block_traces[PLAIN]
        k = len(a)
        ma, mb = sum(a) / k, sum(b) / k
        va = sum((x - ma) ** 2 for x in a) / (k - 1)
        vb = sum((x - mb) ** 2 for x in b) / (k - 1)
        cab = sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (k - 1)
        ratio = ma / mb
        se = ratio * math.sqrt(max(va / ma**2 + vb / mb**2 - 2 * cab / (ma * mb), 0.0) / k)
        n = self.count
        mean_diff = self.diff_total[config] / n
        diff_trace = (self.diff_sq[config] - float(self.diff_total[config] @ self.diff_total[config]) / n) / (n - 1)
        bias_check = float(mean_diff @ mean_diff) / (diff_trace / n) if diff_trace > 0 else 0.0
        return {"config": config, "total_trace": ma, "total_trace_se": math.sqrt(va / k), "total_ratio": ratio,
                "total_ratio_se": se, "bias_check": bias_check, "batches": n, "blocks": k}


def monte_carlo_rows(problem, model, ref_tok, factories, configs, state, group, batches, blocks, generator):
    params = list(model.parameters())
    losses = {c: factories[c]() for c in configs}
    acc = Blocks()
    per_block = batches // blocks
    start = time.perf_counter()
    for i in range(per_block * blocks):
        batch, _ = harness.sample_batch(problem, model, ref_tok, group, generator)
        acc.add({c: flat_grad(losses[c](model, batch), params) for c in configs})
        if (i + 1) % per_block == 0:
            acc.close_block()
            print(f"  state {state}: block {(i + 1) // per_block}/{blocks} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    return [{"state": state, **acc.summary(c)} for c in configs]


def trained_policy(problem: ToyProblem, config: str, seed: int, steps: int) -> torch.nn.Module:
    """The policy of the demo's quick training run of `config` from `seed` after `steps` optimizer steps."""
    from transformers import TrainerCallback

    trainer = trl_runner.make_trainer(problem, config, seed, run.QUICK)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= steps

    trainer.add_callback(Stop())
    trainer.train()
    return trainer.model


def trained_rows(problem: ToyProblem, configs: list[str], spec: str, args) -> tuple[list[dict], float]:
    """Monte Carlo rows at the policy `spec` = CONFIG:SEED:STEP (`trained_policy`), and its KL(pi || pi*)."""
    config, seed, steps = spec.split(":")
    model, factories, _ = loss_factories(problem, configs, int(seed))
    policy = trained_policy(problem, config, int(seed), int(steps))
    with torch.no_grad():
        ref_tok = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
        model.load_state_dict(policy.state_dict())
        kl_opt = ExactEvaluator(problem, ref_tok.double().sum(-1))(sequence_logprobs(problem, model))["kl_opt"]
    generator = torch.Generator().manual_seed(args.seed)
    return monte_carlo_rows(problem, model, ref_tok, factories, configs, spec, args.group, args.batches, args.blocks,
                            generator), kl_opt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, nargs="+", default=[40, 150, 400],
                        help="exact ascent steps on J before each measurement")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated; also {KL_FIT}")
    parser.add_argument("--group", type=int, default=2, help="G: 2 = exact over every pair; > 2 = Monte Carlo")
    parser.add_argument("--batches", type=int, default=800, help="Monte Carlo: batches per state")
    parser.add_argument("--blocks", type=int, default=20, help="Monte Carlo: blocks for the standard errors")
    parser.add_argument("--seed", type=int, default=0, help="Monte Carlo: sampling seed")
    parser.add_argument("--name", default=None, help="results go to bench/results/<name>.* (default "
                        "demo_gradient_variance[_g<G>|_trained])")
    parser.add_argument("--trained", action="append", default=[], metavar="CONFIG:SEED:STEP",
                        help="Monte Carlo at the policy of a demo training run instead of the ascent path")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    configs = args.configs.split(",")
    if PLAIN not in configs:
        raise SystemExit(f"--configs must include {PLAIN} (the reference of every ratio)")
    problem = ToyProblem()
    if args.trained:
        rows, kl_opt = [], {}
        for spec in args.trained:
            spec_rows, kl_opt[spec] = trained_rows(problem, configs, spec, args)
            rows += spec_rows
        return report_rows(rows, args, kl_opt, args.name or "demo_gradient_variance_trained")
    model, factories, scale = loss_factories(problem, configs)
    with torch.no_grad():
        ref_tok = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
    ref = ref_tok.double().sum(-1)
    evaluate = ExactEvaluator(problem, ref)
    generator = torch.Generator().manual_seed(args.seed)
    rows, done, kl_opt = [], 0, {}
    for state in sorted(args.states):
        gradient_check.ascended(problem, model, ref, state - done)
        done = state
        with torch.no_grad():
            kl_opt[state] = evaluate(sequence_logprobs(problem, model))["kl_opt"]
        if args.group == 2:
            exact = gradient_check.exact_kl_gradient(problem, model, ref)
            rows += exact_rows(problem, model, ref_tok, factories, scale, configs, state, exact)
        else:
            rows += monte_carlo_rows(problem, model, ref_tok, factories, configs, state, args.group, args.batches,
                                     args.blocks, generator)
    return report_rows(rows, args, kl_opt, args.name or (
        "demo_gradient_variance" if args.group == 2 else f"demo_gradient_variance_g{args.group}"))


def report_rows(rows: list[dict], args, kl_opt: dict, name: str) -> int:
    """Print the table; write bench/results/<name>.json (rows, settings, command) and <name>.txt."""
    text = table(rows, args, kl_opt)
    print(text)
    path = write_result_and_table(name, {
        "states": args.trained or args.states, "configs": args.configs.split(","), "rows": rows, "group": args.group,
        "kl_opt": kl_opt, "framework": "TRL 1.16 GRPOTrainer.compute_loss",
        **({} if args.group == 2 else {"batches": args.batches, "blocks": args.blocks, "seed": args.seed})}, text)
    print(f"wrote {path} and {path.with_suffix('.txt').name}")
    return 0


def table(rows: list[dict], args, kl_opt: dict) -> str:
    w = max(5, *(len(str(r["state"])) for r in rows))
    if args.group == 2:
        head = f"{'state':>{w}} {'KL(pi||pi*)':>11}  {'configuration':<16}{'KL bias':>9}{'KL var / plain':>16}" \
               f"{'task+KL var / plain':>21}"
        lines = ["Exact over every pair of completions (G = 2), TRL 1.16 GRPOTrainer.compute_loss", head]
        lines += [f"{r['state']:>{w}} {kl_opt[r['state']]:>11.4f}  {r['config']:<16}{r['kl_bias']:>9.0e}"
                  f"{r['kl_ratio']:>16.3f}{r['total_ratio']:>21.3f}" for r in rows]
        return "\n".join(lines)
    head = f"{'state':>{w}} {'KL(pi||pi*)':>11}  {'configuration':<16}{'task+KL var / plain':>24}{'bias check':>12}"
    lines = [f"Monte Carlo, G = {args.group}, {args.batches} batches per state (paired; {args.blocks} blocks for the "
             f"standard errors), seed {args.seed}, TRL 1.16 GRPOTrainer.compute_loss", head]
    lines += [f"{r['state']:>{w}} {kl_opt[r['state']]:>11.4f}  {r['config']:<16}"
              f"{r['total_ratio']:>15.3f} +- {r['total_ratio_se']:.3f}{r['bias_check']:>12.2f}" for r in rows]
    lines.append("bias check = |mean - mean(sequence-plain)|^2 / (tr Cov(difference) / batches): ~1 when both are "
                 "unbiased" + ("; state CONFIG:SEED:STEP = the policy of that demo training run after STEP steps"
                              if args.trained else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
