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
Writes <results>/exploratory_family.{txt,json}, and <results>/exploratory_tables.md: the reports' tables with each
configuration's difference from the group's best and from the framework's default, each p-value beside its
Holm-adjusted one (over the union of both families).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
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


def tables(results: Path, rows: list[dict]) -> str:
    """Markdown: per (setting, framework, beta, lag) group of the reports, every configuration's final scores (mean +-
    se over seeds) with its difference from the group's best and from the framework's default, each as `diff (p; Holm
    adjusted over the union)` from `rows` (both families, with holm_union), its KL(pi || pi_ref) in and out of domain
    and its collapses."""
    test = {(r["setting"], r["framework"], r["beta"], r["lag"], r["score"], r["config"], r["against"]): r for r in rows}

    def versus(where: tuple, score: str, config: str, other: str) -> str:
        if config == other:
            return "--"
        t, sign = test.get((*where, score, config, other)), 1
        if t is None:
            t, sign = test.get((*where, score, other, config)), -1
        return "n/a" if t is None else (f"{sign * 100 * t['difference']:+.1f} (p {t['p']:.3f}; Holm "
                                        f"{t['holm_union']:.3f})")

    out = [f"Exploratory (5 seeds per configuration): final score % (mean +- se over seeds) and each configuration "
           f"against the group's best and against the framework's default: difference in points (two-sided paired "
           f"t-test p, uncorrected; Holm: adjusted over all {len(rows)} tests of exploratory_family.txt; n/a: no "
           f"test, the per-seed values being identical). Made by `python bench/task_family.py`."]
    for report in sorted(results.glob("task_*_*.json")):
        for group in json.loads(report.read_text())["groups"]:
            key, summary = group["key"], group["summary"]
            where = (key["setting"], key["framework"], key["rl"]["beta"], key["rl"]["lag"])
            best = {score: v["best"] for score, v in group["versus_best"].items()}
            default = DEFAULTS[key["framework"]]
            score = "gold reward in domain" if key["setting"] == "proxy" else "in domain"
            out += ["", f"**{key['setting']}, {key['framework']}, beta {key['rl']['beta']:g}, lag {key['rl']['lag']}** "
                    f"(`{report.name}`)", "",
                    f"| configuration | {score} % | vs best | vs `{default}` | out of domain % | vs best | vs "
                    f"`{default}` | KL(pi \\|\\| pi_ref) in domain | out of domain | collapses |",
                    "|---|---|---|---|---|---|---|---|---|---|"]
            for config, row in summary.items():
                cells = []
                for split in SCORES:
                    if split not in row:
                        cells += ["n/a"] * 3
                        continue
                    mean = f"{100 * row[split]['mean']:.1f} +- {100 * row[split]['se']:.1f}"
                    top = "**best**" if best.get(split) == config else versus(where, split, config, best.get(split))
                    cells += [mean, top, versus(where, split, config, default) if default in summary else "n/a"]
                kl = [f"{row[m]['mean']:.2f} +- {row[m]['se']:.2f}" if m in row else "n/a" for m in ("kl", "kl_ood")]
                collapses = f"{round(row['collapse']['mean'] * len(row['seeds']))} / {len(row['seeds'])}"
                out.append(f"| `{config}` | " + " | ".join(cells + kl + [collapses]) + " |")
    return "\n".join(out) + "\n"


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
    (args.results / "exploratory_tables.md").write_text(tables(args.results, rows))
    print("\n".join(lines[:3] + lines[3:15]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
