"""Exact variance of TRL's training gradient on the demo's toy problem, KL term alone and task + KL (issue 16: measure
whether `full` helps).

At policies on the exact ascent path from pi_ref towards pi* (`gradient_check.ascended`, Adam on the enumerated J), for
each configuration, every unordered pair of completions is fed through TRL 1.16 GRPOTrainer's real `compute_loss`
(the demo's settings, `kl_adapters.demo.trl_runner`), with
  kl    zero advantages: the KL term's gradient alone;
  total GRPO advantages of the pair (r_i - mean of the two): the gradient a training step takes, task + KL,
and the mean and covariance trace of the gradient of a batch of 2 are computed exactly (probability p_i p_j, twice for
i != j). Reported: each configuration's trace relative to `sequence-plain` at the same state (and the relative bias
of the KL-only mean against grad KL, which must be ~1e-6 for the unbiased presets). Batches of 2 make the
leave-one-out statistics of the reduced presets as noisy as they get; the demo trains with groups of 256.
"total" can rank the configurations differently from "kl": the KL term's noise is correlated with the reward's (at
pi*, r(y) - beta log(pi/pi_ref)(y) is the same for every y).
Usage: .venvs/trl/bin/python bench/demo_gradient_variance.py [--states 40 150 400] [--configs ...]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from timing import write_result  # noqa: E402

from kl_adapters.demo import gradient_check, trl_runner  # noqa: E402
from kl_adapters.demo.problem import ToyProblem, completion_logprobs, enumerated_input_ids  # noqa: E402

CONFIGS = ("sequence-plain", "sequence", "full", "trl-default")


def moments(problem: ToyProblem, model, ref_tok: torch.Tensor, loss_fn, scale, with_task: bool):
    """Exact (mean, covariance trace) of the batch-of-2 gradient, flattened, float64."""
    mean, second = 0.0, 0.0
    for weight, g in gradient_check.batch_gradients(problem, model, ref_tok, loss_fn, scale, 2, with_task=with_task):
        mean, second = mean + weight * g, second + weight * float(g @ g)
    return mean, second - float(mean @ mean)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, nargs="+", default=[40, 150, 400],
                        help="exact ascent steps on J before each measurement")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    configs = args.configs.split(",")
    problem = ToyProblem()
    model, losses, scale = trl_runner.check_losses(problem, configs)
    with torch.no_grad():
        ref_tok = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
    ref = ref_tok.double().sum(-1)
    rows, done = [], 0
    for state in sorted(args.states):
        gradient_check.ascended(problem, model, ref, state - done)
        done = state
        exact = gradient_check.exact_kl_gradient(problem, model, ref)
        for config in configs:
            make, _ = losses[config]
            kl_mean, kl_var = moments(problem, model, ref_tok, make(), scale, with_task=False)
            _, total_var = moments(problem, model, ref_tok, make(), scale, with_task=True)
            rows.append({"state": state, "config": config, "kl_bias": float((kl_mean - exact).norm() / exact.norm()),
                         "kl_trace": kl_var, "total_trace": total_var})
            print(f"  state {state}: {config} done", flush=True)
    lines = [f"{'state':>5}  {'configuration':<16}{'KL bias':>9}{'KL var / plain':>16}{'task+KL var / plain':>21}"]
    for r in rows:
        plain = next(p for p in rows if p["state"] == r["state"] and p["config"] == "sequence-plain")
        r["kl_ratio"], r["total_ratio"] = r["kl_trace"] / plain["kl_trace"], r["total_trace"] / plain["total_trace"]
        lines.append(f"{r['state']:>5}  {r['config']:<16}{r['kl_bias']:>9.0e}{r['kl_ratio']:>16.3f}"
                     f"{r['total_ratio']:>21.3f}")
    print("\n".join(lines))
    path = write_result("demo_gradient_variance", {"states": args.states, "configs": configs, "rows": rows,
                                                    "batch_rows": 2, "framework": "TRL 1.16 GRPOTrainer.compute_loss"})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
