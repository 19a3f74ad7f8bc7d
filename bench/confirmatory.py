"""The confirmatory family of bench/results/task/confirmatory/protocol.md (issue 46), analysed as registered.

Reads the run stores of that folder (bench/task.py --out bench/results/task/confirmatory --name confirm_<setting>_<fw>,
seeds 200-209), and for each hypothesis of `FAMILY`: the per-seed differences A - B of the final score (percentage
points) on the seeds where both finished (L4 and H7: the mean of the verl and the OpenRLHF difference per seed), their
mean with a 95% t-interval, the two-sided paired t-test's p, Holm's step-down adjusted p over the whole family (a
hypothesis not run yet counts with p = 1, which only makes the others' adjustment conservative), the decision
(confirmed: adjusted p < 0.05 and the mean in the registered direction), and the exact sign-flip permutation p.
A hypothesis whose seeds have not all run yet (for every configuration, finished or failed) is reported as running,
with its interim figures, and counts in Holm's correction as not run: decisions are taken on the full ten seeds.
The run time: every run's wall time summed, per store and in all. The long setting's betas are read from
design_long.txt (its line "chosen betas (...): b1, b2, b3").

Usage: python bench/confirmatory.py [--folder bench/results/task/confirmatory]   (writes confirmatory.{txt,json})
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
from task_family import DEFAULTS, holm  # noqa: E402
from kl_adapters.demo.long_horizon_report import paired_test  # noqa: E402
from kl_adapters.demo.output import read_runs  # noqa: E402
from kl_adapters.demo.task.report import final, score_name  # noqa: E402
from kl_adapters.student_t import quantile  # noqa: E402

SEEDS = tuple(range(200, 210))
DEFAULT_K3 = {fw: DEFAULTS[fw] for fw in ("verl", "openrlhf")}


@dataclass(frozen=True)
class Hypothesis:
    id: str
    setting: str
    frameworks: tuple[str, ...]  # more than one: one harness, the per-seed differences averaged
    beta: float | str  # a number, or "beta_1" / "beta_2" / "beta_3" of the long setting's design
    split: str  # "id" | "ood"
    a: str
    b: str  # "default-k3": each framework's k3 default


FAMILY = (
    Hypothesis("L1", "scratch", ("trl",), 0.05, "ood", "sequence-plain", "trl-default"),
    Hypothesis("L2", "proxy", ("trl",), 0.5, "id", "sequence-plain", "k3-loss"),
    Hypothesis("L3", "proxy", ("trl",), 0.5, "id", "sequence", "k3-loss"),
    Hypothesis("L4", "short", ("verl", "openrlhf"), 0.05, "ood", "kl_adapters:sequence-plain", "default-k3"),
    *(Hypothesis(f"H{i}", "long", ("trl",), f"beta_{i}", "ood", "sequence-plain", "trl-default") for i in (1, 2, 3)),
    *(Hypothesis(f"H{i + 3}", "long", ("trl",), f"beta_{i}", "id", "sequence-plain", "trl-default") for i in (1, 2, 3)),
    Hypothesis("H7", "long", ("verl", "openrlhf"), "beta_2", "ood", "kl_adapters:sequence-plain", "default-k3"),
)


def long_betas(folder: Path) -> dict[str, float]:
    """beta_1 < beta_2 < beta_3 of protocol step 3: the design file's `chosen betas (...): b1, b2, b3` line
    (bench/long_design.py writes it; {} before it exists)."""
    design = folder / "design_long.txt"
    if not design.exists():
        return {}
    for line in design.read_text().splitlines():
        if line.startswith("chosen betas"):
            values = [float(x) for x in line.rsplit(":", 1)[1].split(",")]
            return {f"beta_{i + 1}": v for i, v in enumerate(values)}
    return {}


def scores(folder: Path, h: Hypothesis, framework: str, beta: float
           ) -> tuple[dict[str, dict[int, float]], dict[str, set[int]]]:
    """({configuration: {seed: final score}}, {configuration: seeds run, failed ones included}) of the runs of this
    setting, framework and beta (lag 1)."""
    store = folder / f"confirm_{h.setting}_{framework}.jsonl.gz"
    out: dict[str, dict[int, float]] = {}
    ran: dict[str, set[int]] = {}
    for run in read_runs(store) if store.exists() else []:
        key = run["key"]
        if key["rl"]["beta"] != beta or key["rl"]["lag"] != 1:
            continue
        ran.setdefault(run["config"], set()).add(run["seed"])
        if run.get("history"):
            out.setdefault(run["config"], {})[run["seed"]] = 100 * final(run, h.split, score_name(run))
    return out, ran


def run_time(folder: Path) -> dict[str, tuple[int, float]]:
    """{store name: (runs, wall seconds summed)} over the folder's confirm_*.jsonl.gz."""
    return {store.name.removesuffix(".jsonl.gz"): (len(runs), sum(r.get("wall_seconds") or 0.0 for r in runs))
            for store in sorted(folder.glob("confirm_*.jsonl.gz")) for runs in [read_runs(store)]}


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided permutation p of the mean difference over every sign pattern."""
    observed = abs(statistics.fmean(diffs))
    extreme = sum(abs(statistics.fmean(s * d for s, d in zip(signs, diffs))) >= observed - 1e-12
                  for signs in itertools.product((1, -1), repeat=len(diffs)))
    return extreme / 2 ** len(diffs)


def analyse(folder: Path) -> list[dict]:
    betas = long_betas(folder)
    rows = []
    for h in FAMILY:
        beta = betas.get(h.beta) if isinstance(h.beta, str) else h.beta
        per_framework, complete = [], beta is not None
        for fw in h.frameworks:
            if beta is None:
                break
            data, ran = scores(folder, h, fw, beta)
            b = DEFAULT_K3[fw] if h.b == "default-k3" else h.b
            both = sorted(set(data.get(h.a, {})) & set(data.get(b, {})) & set(SEEDS))
            per_framework.append({s: data[h.a][s] - data[b][s] for s in both})
            complete &= set(SEEDS) <= ran.get(h.a, set()) & ran.get(b, set())
        seeds = sorted(set.intersection(*(set(d) for d in per_framework))) if per_framework else []
        diffs = [statistics.fmean(d[s] for d in per_framework) for s in seeds]
        row = {"id": h.id, "setting": h.setting, "frameworks": list(h.frameworks), "beta": beta, "split": h.split,
               "a": h.a, "b": h.b, "seeds": seeds, "n": len(diffs), "complete": complete}
        if len(diffs) >= 2:
            mean, p = paired_test(diffs, [0.0] * len(diffs))
            se = statistics.stdev(diffs) / math.sqrt(len(diffs))
            half = quantile(0.975, len(diffs) - 1) * se
            row.update(difference=mean, low=mean - half, high=mean + half, p=p, permutation_p=sign_flip_p(diffs))
        rows.append(row)
    adjusted = holm([r["p"] if r["complete"] and "p" in r and not math.isnan(r["p"]) else 1.0 for r in rows])
    for r, a in zip(rows, adjusted):
        r["holm"] = a
        r["decision"] = ("not run yet" if not r["n"] else
                         f"running: {r['n']} of {len(SEEDS)} seeds (interim, no decision)" if not r["complete"] else
                         "no test (fewer than two seeds finished)" if "p" not in r else
                         "confirmed" if a < 0.05 and r["difference"] > 0 else
                         "significant, opposite direction" if a < 0.05 else "not confirmed")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "task" / "confirmatory")
    args = p.parse_args(argv)
    rows = analyse(args.folder)
    head = (f"{'id':<4}{'setting':<8}{'framework':<15}{'beta':>6} {'score':<5}{'A - B':<46}{'n':>3}"
            f"{'diff (pp) [95% CI]':>24}{'p':>8}{'Holm':>7}{'perm p':>8}  decision")
    lines = ["# python bench/confirmatory.py  (protocol: bench/results/task/confirmatory/protocol.md)", head,
             "-" * len(head)]
    for r in rows:
        ci = (f"{r['difference']:+.1f} [{r['low']:+.1f}, {r['high']:+.1f}]" if "difference" in r else "-")
        nums = (f"{r['p']:>8.3f}{r['holm']:>7.3f}{r['permutation_p']:>8.3f}" if "p" in r else f"{'-':>8}{'-':>7}{'-':>8}")
        beta = "-" if r["beta"] is None else f"{r['beta']:g}"
        lines.append(f"{r['id']:<4}{r['setting']:<8}{'+'.join(r['frameworks']):<15}{beta:>6} {r['split']:<5}"
                     f"{r['a'] + ' - ' + r['b']:<46}{r['n']:>3}{ci:>24}{nums}  {r['decision']}")
    times = run_time(args.folder)
    lines += ["", "run time (every run's wall time, one torch thread each, on the 2-core development machine):"]
    lines += [f"  {name:<28}{runs:>4} runs {seconds / 3600:>7.2f} h" for name, (runs, seconds) in times.items()]
    lines.append(f"  {'all':<28}{sum(n for n, _ in times.values()):>4} runs "
                 f"{sum(t for _, t in times.values()) / 3600:>7.2f} h")
    (args.folder / "confirmatory.txt").write_text("\n".join(lines) + "\n")
    (args.folder / "confirmatory.json").write_text(json.dumps(
        {"hypotheses": rows, "run_time": {k: {"runs": n, "wall_seconds": t} for k, (n, t) in times.items()}},
        indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
