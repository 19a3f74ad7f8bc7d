"""Does `torch.compile` make the statistics cheap? `kl_statistics` eager against `torch.compile(kl_statistics)`.

A route to issue 36's cost targets (docs/benchmarks.md) would be one fused kernel for the fit; this measures the one
a user gets without writing it: `torch.compile(kl_statistics, dynamic=True)` as the package stands, on the batches of
bench/kl_term_cost.py (float32, 1 torch thread), the two alternated call by call (ABBA), after one untimed compiling
call per shape. Reported per shape: median ms of each, their ratio, the compile time, Dynamo's graphs and graph breaks
with their first distinct reasons, and the largest relative difference of each statistic from eager's (a compiled
kernel may round differently: any difference beyond 1e-12 would require re-running every result the fit enters).
Usage: .venvs/core/bin/python bench/kl_statistics_compile.py [--repeats 60] [--name kl_statistics_compile_cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from kl_term_cost import SHAPES, batch, shape_name  # noqa: E402
from timing import alternating, write_result_and_table  # noqa: E402

from kl_adapters import kl_statistics  # noqa: E402


def largest_relative_differences(a, b) -> dict[str, float]:
    """max |a - b| / max |a| per tensor field of two KLStatistics."""
    out = {}
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name).double(), getattr(b, field.name).double()
        out[field.name] = float((x - y).abs().max() / x.abs().max().clamp(min=1e-300))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--name", default="kl_statistics_compile_cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compiled = torch.compile(kl_statistics, dynamic=True)
    results, lines = {}, [f"{'shape':<20}{'eager ms':>10}{'compiled ms':>13}{'ratio':>8}{'compile s':>11}"
                          f"{'graphs':>8}{'breaks':>8}  largest relative difference"]
    reasons: list[str] = []
    for b, t, off_policy in SHAPES:
        logp, ref, old, mask, task, eos = batch(b, t, "cpu")
        kwargs = {"old_logp": old if off_policy else None, "task": task, "eos": eos}
        start = time.perf_counter()
        compiled_stats = compiled(logp, ref, mask, **kwargs)
        compile_s = time.perf_counter() - start
        explained = torch._dynamo.explain(kl_statistics)(logp, ref, mask, **kwargs)
        for reason in explained.break_reasons:
            first = str(reason.reason).splitlines()[0][:160]
            if first not in reasons:
                reasons.append(first)
        diff = largest_relative_differences(kl_statistics(logp, ref, mask, **kwargs), compiled_stats)
        times = alternating({"eager": lambda: kl_statistics(logp, ref, mask, **kwargs),
                             "compiled": lambda: compiled(logp, ref, mask, **kwargs)}, repeats=args.repeats)
        med = {c: 1e3 * statistics.median(v) for c, v in times.items()}
        name = shape_name(b, t, off_policy)
        results[name] = {"median_ms": med, "ratio": med["compiled"] / med["eager"], "compile_s": compile_s,
                         "graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
                         "largest_relative_difference": diff}
        worst = max(diff, key=diff.get)
        lines.append(f"{name:<20}{med['eager']:>10.2f}{med['compiled']:>13.2f}{med['compiled'] / med['eager']:>8.2f}"
                     f"{compile_s:>11.1f}{explained.graph_count:>8}{explained.graph_break_count:>8}  "
                     f"{diff[worst]:.1e} ({worst})")
    lines.append("graph breaks, first distinct reasons: " + "; ".join(reasons[:6]))
    text = "\n".join(lines)
    print(text)
    write_result_and_table(args.name, {"torch": torch.__version__, "repeats": args.repeats, "results": results,
                                       "graph_break_reasons": reasons}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
