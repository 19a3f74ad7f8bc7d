"""Which of `sequence`'s reductions adds or removes variance of TRL's training gradient on the long-horizon problem.

Usage: .venvs/trl/bin/python bench/reduction_components.py [--horizon 32] [--step 200] [--groups 48] [--seed 0]
       (writes bench/results/reduction_components_T<horizon>_step<step>[_seed<seed>].{txt,json})

Trains `sequence-plain` with TRL's GRPOTrainer.train() on kl_adapters.demo's long-horizon problem (--seed, G = 32,
lr 3e-3, the settings of bench/long_horizon.py) for --step steps, then measures, over --groups groups of 32
completions of that policy (the same groups for every row), the trace of the covariance of the gradient TRL's
compute_loss takes (task + KL; `long_horizon_trl.gradient_variance`) for `sequence-plain` and for `sequence` with one
fitted statistic set to zero at a time (`KLStatistics` fields: cv_coef = a, the xi = pi_ref/pi - 1 control variate;
eos_coef = h, the termination control variate; past_coef = lambda, the prefix-KL baseline; baseline = m, the
per-position mean). Zeroing a statistic keeps the gradient exact (each term has zero mean for any coefficient), so
every row estimates the same gradient; only its variance changes.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_result_and_table  # noqa: E402
from zeroed_statistics import FIELDS, zeroed  # noqa: E402

from kl_adapters.demo.long_horizon_harness import LongSettings  # noqa: E402
from kl_adapters.demo.long_horizon_problem import LongHorizonProblem  # noqa: E402
from kl_adapters.demo.long_horizon_trl import gradient_variance, run_trl  # noqa: E402

ZEROED = ((), ("cv_coef",), ("eos_coef",), ("past_coef",), ("baseline",), FIELDS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, default=32)
    parser.add_argument("--step", type=int, default=200)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="the problem's and the run's seed (bench/long_horizon.py's)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    problem = LongHorizonProblem(horizon=args.horizon, beta=0.2, seed=args.seed)
    settings = LongSettings(steps=args.step, group=32, learning_rate=3e-3, eval_every=args.step, eval_samples=256,
                            final_samples=256)
    rows = []

    def measure(step: int, model: torch.nn.Module) -> None:
        if step != args.step:
            return
        for names in ZEROED:
            with zeroed(names):
                stats = gradient_variance(problem, model, ["sequence-plain", "sequence"], 32, args.groups, seed=step)
            rows.append({"zeroed": list(names), **stats})

    run_trl(problem, "sequence-plain", settings, None, measure)
    lines = [f"TRL compute_loss, task + KL, G = 32, T = {args.horizon}, policy after {args.step} steps of a "
             f"sequence-plain run (seed {args.seed}), {args.groups} groups; tr Cov (jackknife se) and the ratio to sequence-plain",
             f"{'sequence with zeroed':<44}{'tr Cov':>12}{'se':>10}{'ratio':>8}"]
    plain = rows[0]["sequence-plain"]
    lines.append(f"{'sequence-plain':<44}{plain['trace']:>12.4g}{plain['trace_se']:>10.2g}{1.0:>8.3f}")
    for r in rows:
        s = r["sequence"]
        lines.append(f"{', '.join(r['zeroed']) or '(nothing: the preset)':<44}{s['trace']:>12.4g}{s['trace_se']:>10.2g}"
                     f"{s['trace'] / plain['trace']:>8.3f}")
    text = "\n".join(lines)
    print(text)
    name = f"reduction_components_T{args.horizon}_step{args.step}" + (f"_seed{args.seed}" if args.seed else "")
    write_result_and_table(name, {"rows": rows, "horizon": args.horizon, "step": args.step, "groups": args.groups},
                           text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
