"""Train `sequence` through TRL with some of its fitted statistics set to zero: which one a training excursion needs.

Usage: .venvs/trl/bin/python bench/zeroed_training.py [--horizon 128] [--seed 1] [--zero eos_coef past_coef ...]
       [--name NAME] (writes bench/results/zeroed_training_T<horizon>_seed<seed>.{txt,json}, or NAME.*)

Each --zero value is one variant: a `KLStatistics` field (cv_coef = a, the xi control variate; eos_coef = h, the
termination control variate; past_coef = lambda, the prefix-KL baseline; baseline = m, the per-position mean), several
joined by "+", or "none" (the preset). Zeroing a statistic keeps the gradient exact (bench/zeroed_statistics.py), so
every variant trains on the same expected gradient; only the noise, and with it the sampled trajectory, differs.
TRL's GRPOTrainer.train() on kl_adapters.demo's long-horizon problem with the settings of bench/long_horizon.py
(G = 32, 200 steps, lr 3e-3), J* - J and the mean completion length every 25 steps (256 samples).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
from timing import write_result_and_table  # noqa: E402
from zeroed_statistics import zeroed  # noqa: E402

from kl_adapters.demo.long_horizon_harness import LongSettings  # noqa: E402
from kl_adapters.demo.long_horizon_problem import LongHorizonProblem  # noqa: E402
from kl_adapters.demo.long_horizon_trl import run_trl  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1, help="the problem's and the run's seed (bench/long_horizon.py's)")
    parser.add_argument("--zero", nargs="+", default=["eos_coef", "past_coef", "baseline", "cv_coef"],
                        help="variants: a statistic, several joined by '+', or 'none'")
    parser.add_argument("--name", default=None, help="results go to bench/results/<name>.* "
                        "(default zeroed_training_T<horizon>_seed<seed>)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    problem = LongHorizonProblem(horizon=args.horizon, beta=0.2, seed=args.seed)
    settings = LongSettings(steps=200, group=32, learning_rate=3e-3, eval_every=25, eval_samples=256,
                            final_samples=256)
    rows = []
    for variant in args.zero:
        names = () if variant == "none" else tuple(variant.split("+"))
        with zeroed(names):
            history = run_trl(problem, "sequence", settings)["history"]
        rows.append({"zeroed": list(names), "history": [(h["step"], h["gap"], h["length"]) for h in history]})
        print(variant, [(s, round(g, 4), round(n)) for s, g, n in rows[-1]["history"]], flush=True)
    steps = [s for s, _, _ in rows[0]["history"]]
    lines = [f"TRL GRPOTrainer.train(), `sequence` with fitted statistics zeroed, long-horizon T = {args.horizon}, "
             f"seed {args.seed}: J* - J (256 samples) / mean completion length at each step",
             f"{'zeroed':<24}" + "".join(f"{s:>14}" for s in steps)]
    lines += [f"{'+'.join(r['zeroed']) or '(nothing: the preset)':<24}"
              + "".join(f"{g:>8.4f} /{n:>4.0f}" for _, g, n in r["history"]) for r in rows]
    text = "\n".join(lines)
    print(text)
    name = args.name or f"zeroed_training_T{args.horizon}_seed{args.seed}"
    write_result_and_table(name, {"rows": rows, "horizon": args.horizon, "seed": args.seed}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
