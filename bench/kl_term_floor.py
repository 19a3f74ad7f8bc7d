"""The floor a cheaper fit could reach: the KL term from the batch with the fit switched off, against the plain term.

Issue 36's target for the KL term whose statistics come from the loss's own batch is 3x `sequence-plain`. The fit
(`reductions.batch_statistics`) is one part of that cost; the statistics' inputs are the rest: the rows' returns from
t, the token-level regressions, the termination counts and the score weights, which any fit of these presets reads.
`ReductionConfig(fit=False)` computes every input and skips the fit (statistics all zero, the plain form's weights):
its cost is what `sequence` would cost with a fit that took no time at all. Configurations, on the batches of
bench/kl_term_cost.py (float32, 1 torch thread), alternated call by call (ABBA), kl_term + surrogate + backward:
  sequence-plain            the plain term
  sequence                  statistics from the batch (the fit as it is)
  sequence, fit off         the same with `ReductionConfig(fit=False)`: the inputs without the fit
  sequence, precomputed     statistics given (kl_statistics of the batch, computed once outside the timing)
Usage: .venvs/core/bin/python bench/kl_term_floor.py [--repeats 200] [--name kl_term_floor_cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from kl_term_cost import SHAPES, batch, configs, shape_name  # noqa: E402
from timing import alternating, compare, write_result_and_table  # noqa: E402

from kl_adapters.reductions import ReductionConfig, reduction_config  # noqa: E402


def without_fit(run):
    """`run` with the fit switched off (ReductionConfig(fit=False)): the statistics' inputs only."""
    def call():
        with reduction_config(ReductionConfig(fit=False)):
            run()
    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--name", default="kl_term_floor_cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, lines = {}, [f"{'shape':<20}{'configuration':<24}{'median ms':>11}{'/ plain':>9}{'paired':>8}"]
    for b, t, off_policy in SHAPES:
        terms = configs(*batch(b, t, "cpu"), off_policy)
        fns = {"sequence-plain": terms["sequence-plain"], "sequence": terms["sequence"],
               "sequence, fit off": without_fit(terms["sequence"]), "sequence, precomputed": terms["sequence+stats"]}
        times = alternating(fns, repeats=args.repeats)
        name = shape_name(b, t, off_policy)
        results[name] = {"median_ms": {c: 1e3 * statistics.median(v) for c, v in times.items()}}
        for config in fns:
            cmp = compare(times, "sequence-plain", config)
            results[name][config] = {"ratio": cmp["ratio"], "median_paired_ratio": cmp["median_paired_ratio"]}
            lines.append(f"{name:<20}{config:<24}{results[name]['median_ms'][config]:>11.2f}{cmp['ratio']:>9.2f}"
                         f"{cmp['median_paired_ratio']:>8.2f}")
    text = "\n".join(lines)
    print(text)
    write_result_and_table(args.name, {"torch": torch.__version__, "repeats": args.repeats, "results": results}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
