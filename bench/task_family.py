"""The task benchmark's exploratory comparisons corrected for their number (issue 46, step 3): every paired test the
committed reports make, with its Holm-adjusted p-value and Benjamini-Hochberg q-value across the family.

Family 1, "versus best": the tests the reports print (bench/results/task/task_<setting>_<framework>.json,
`versus_best`): per (setting, framework, beta, lag) group and per score (in domain, out of domain), every
configuration against the group's best by the two-sided paired t-test on the seeds. Family 2, "versus default": every
configuration against the framework's own default KL term (TRL: `trl-default`, verl: `verl-default`, OpenRLHF:
`openrlhf-default-k3`) on the same seeds and scores, the comparison a user deciding to switch makes; it is corrected
over the union of both families (each distinct pair of configurations and score tested once). Nothing is re-run:
the per-seed finals in the reports' summaries are the data.

Usage: python bench/task_family.py [--results bench/results/task]   (any Python >= 3.10; no torch needed)
Writes <results>/exploratory_family.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kl_adapters.demo.long_horizon_report import paired_test  # noqa: E402

DEFAULTS = {"trl": "trl-default", "verl": "verl-default", "openrlhf": "openrlhf-default-k3"}
SCORES = ("id", "ood")


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input's order."""
    order = sorted(range(len(p)), key=p.__getitem__)
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def benjamini_hochberg(p: list[float]) -> list[float]:
    """Benjamini-Hochberg q-values (false discovery rate), in the input's order."""
    order = sorted(range(len(p)), key=p.__getitem__, reverse=True)
    out, running = [0.0] * len(p), 1.0
    for k, i in enumerate(order):
        running = min(running, len(p) * p[i] / (len(p) - k))
        out[i] = running
    return out


def tests(results: Path) -> list[dict]:
    """Every test of both families (versus best as the reports computed it; versus default recomputed)."""
    found, seen = [], set()
    for report in sorted(results.glob("task_*_*.json")):
        for group in json.loads(report.read_text())["groups"]:
            key, summary = group["key"], group["summary"]
            where = {"setting": key["setting"], "framework": key["framework"], "beta": key["rl"]["beta"],
                     "lag": key["rl"]["lag"]}
            for score, versus in group["versus_best"].items():
                for config, t in versus["versus"].items():
                    if t.get("p") is None or math.isnan(t["p"]):
                        continue
                    found.append({**where, "score": score, "family": "versus best", "config": config,
                                  "against": versus["best"], "difference": t["difference"], "p": t["p"]})
                    seen.add((*where.values(), score, *sorted((config, versus["best"]))))
            default = DEFAULTS[key["framework"]]
            if default not in summary:
                continue
            for score in SCORES:
                for config, row in summary.items():
                    pair = (*where.values(), score, *sorted((config, default)))
                    if config == default or pair in seen or score not in row:
                        continue
                    seeds = [s for s in row["seeds"] if s in summary[default]["seeds"]]
                    a = [row[score]["per_seed"][row["seeds"].index(s)] for s in seeds]
                    b = [summary[default][score]["per_seed"][summary[default]["seeds"].index(s)] for s in seeds]
                    difference, p = paired_test(a, b)
                    if math.isnan(p):
                        continue
                    seen.add(pair)
                    found.append({**where, "score": score, "family": "versus default", "config": config,
                                  "against": default, "difference": difference, "p": p})
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / "task")
    args = p.parse_args(argv)
    rows = tests(args.results)
    best = [r for r in rows if r["family"] == "versus best"]
    for subset, name in ((best, "report"), (rows, "union")):
        ps = [r["p"] for r in subset]
        for r, h, q in zip(subset, holm(ps), benjamini_hochberg(ps)):
            r[f"holm_{name}"], r[f"bh_{name}"] = h, q
    head = (f"{'setting':<8}{'fw':<9}{'beta':>5}{'lag':>4} {'score':<4} {'configuration':<28}{'against':<28}"
            f"{'diff':>7}{'p':>8}{'Holm':>7}{'BH q':>7}{'Holm*':>7}")
    lines = ["# python bench/task_family.py",
             f"# exploratory: {len(best)} tests the reports print (versus the group's best) and {len(rows) - len(best)} "
             f"more versus the framework's default; p: two-sided paired t-test on the seeds (uncorrected); Holm / BH q: "
             f"corrected over the reports' {len(best)} tests; Holm*: over all {len(rows)}",
             f"# uncorrected p < 0.05: {sum(r['p'] < 0.05 for r in best)} of {len(best)} (reports), "
             f"{sum(r['p'] < 0.05 for r in rows)} of {len(rows)} (all); Holm < 0.05: "
             f"{sum(r['holm_report'] < 0.05 for r in best)} (reports), {sum(r['holm_union'] < 0.05 for r in rows)} (all)",
             head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: r["p"]):
        report = (f"{r['holm_report']:>7.3f}{r['bh_report']:>7.3f}" if "holm_report" in r else f"{'-':>7}{'-':>7}")
        lines.append(f"{r['setting']:<8}{r['framework']:<9}{r['beta']:>5g}{r['lag']:>4} {r['score']:<4} "
                     f"{r['config']:<28}{r['against']:<28}{100 * r['difference']:>+7.1f}{r['p']:>8.3f}{report}"
                     f"{r['holm_union']:>7.3f}")
    (args.results / "exploratory_family.txt").write_text("\n".join(lines) + "\n")
    (args.results / "exploratory_family.json").write_text(json.dumps({"tests": rows}, indent=1) + "\n")
    print("\n".join(lines[:3] + lines[3:15]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
