"""Tables, paired tests, collapse and spike counts, and the frontier plot of the task benchmark's runs.

A run (one line of the benchmark's .jsonl.gz) holds its evaluation rows ("history": per split "id" / "ood", the scorers'
means and standard errors, "kl", "length") and TRL's or the harness's per-step metrics. The definitions below are the
protocol's (docs/task.md), fixed before any comparison ran:

  collapse   a non-finite loss or gradient norm at any step, or a final in-domain score (accuracy; gold reward in
             the proxy setting) more than COLLAPSE_POINTS below the reference's (the run's step-0 evaluation), or a
             final in-domain mean completion length outside LENGTH_RANGE times the reference's
  spike      a step whose gradient norm exceeds SPIKE_FACTOR times the median gradient norm of the run

Comparisons are paired by seed (seed s of every configuration shares the reference, the prompt order and the
evaluation's random numbers): the mean difference to the best configuration with the two-sided paired t-test
(`long_horizon_report.paired_test`); p >= 0.05 is reported as a tie.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from ..long_horizon_report import paired_test, standard_error

COLLAPSE_POINTS = 0.10
LENGTH_RANGE = (0.5, 2.0)
SPIKE_FACTOR = 10.0
SIGNIFICANCE = 0.05


def score_name(run: dict) -> str:
    """The in-domain score of a run's setting: "gold" in the proxy setting, else "accuracy"."""
    return "gold" if run["key"]["setting"] == "proxy" else "accuracy"


def final(run: dict, split: str, metric: str) -> float:
    return run["history"][-1][split][metric]


def collapsed(run: dict) -> bool:
    first, last, score = run["history"][0]["id"], run["history"][-1]["id"], score_name(run)
    low, high = LENGTH_RANGE
    return (not run.get("finite", True) or last[score] < first[score] - COLLAPSE_POINTS
            or not low * first["length"] <= last["length"] <= high * first["length"])


def spikes(run: dict) -> int:
    norms = [row["grad_norm"] for row in run.get("trl", run.get("steps", [])) if "grad_norm" in row]
    if not norms:
        return 0
    median = statistics.median(norms)
    return sum(n > SPIKE_FACTOR * median for n in norms)


def metrics_of(run: dict) -> dict[str, float]:
    """The run's final numbers that the tables compare."""
    score = score_name(run)
    out = {"id": final(run, "id", score), "ood": final(run, "ood", score) if "ood" in run["history"][-1] else None,
           "kl": final(run, "id", "kl"), "kl_ood": final(run, "ood", "kl") if "ood" in run["history"][-1] else None,
           "length": final(run, "id", "length"), "collapse": float(collapsed(run)), "spikes": float(spikes(run))}
    if score == "gold":
        out["proxy"] = final(run, "id", "proxy")
    ess = [row["kl_adapters/is_ess"] for row in run.get("trl", run.get("steps", [])) if "kl_adapters/is_ess" in row]
    if ess:
        out["is_ess"] = statistics.fmean(ess)  # the training batches' full-sequence importance-weight ESS (1 on-policy)
    return {k: v for k, v in out.items() if v is not None}


def summarize(runs: Iterable[dict]) -> dict[str, dict]:
    """configuration -> {"seeds": [...], "failed_seeds": [...], metric: {"mean", "se", "per_seed"}} over its runs
    (sorted by seed); a failed run (it raised: driver.run_job) is listed in failed_seeds and counted as a collapse."""
    by_config: dict[str, list[dict]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        by_config.setdefault(run["config"], []).append(run)
    out = {}
    for config, everything in by_config.items():
        group = [r for r in everything if r.get("history")]  # a failed run has none (driver.run_job)
        if not group:
            continue
        rows = [metrics_of(r) for r in group]
        entry = {"seeds": [r["seed"] for r in group], "reference": metrics_of_reference(group),
                 "failed_seeds": [r["seed"] for r in everything if not r.get("history")]}
        for metric in rows[0]:
            values = [row[metric] for row in rows]
            entry[metric] = {"mean": statistics.fmean(values), "se": standard_error(values), "per_seed": values}
        out[config] = entry
    return out


def metrics_of_reference(runs: list[dict]) -> dict[str, float]:
    """The step-0 evaluation (the reference itself), averaged over the runs' seeds (every configuration of a seed
    evaluates the reference with the same random numbers)."""
    score = score_name(runs[0])
    firsts = [r["history"][0] for r in runs]
    return {split: statistics.fmean(f[split][score] for f in firsts) for split in ("id", "ood") if split in firsts[0]}


def versus_best(summary: dict[str, dict], metric: str, higher: bool = True) -> dict:
    """The configuration with the best mean `metric`, and each other's paired difference to it on the seeds both ran."""
    best = (max if higher else min)(summary, key=lambda c: summary[c][metric]["mean"])
    out = {"best": best, "versus": {}}
    for config, row in summary.items():
        common = [s for s in row["seeds"] if s in summary[best]["seeds"]]
        if config == best or len(common) < 2:
            continue
        a = [row[metric]["per_seed"][row["seeds"].index(s)] for s in common]
        b = [summary[best][metric]["per_seed"][summary[best]["seeds"].index(s)] for s in common]
        difference, p = paired_test(a, b)
        out["versus"][config] = {"difference": difference, "p": p,
                                 "significant": bool(p < SIGNIFICANCE) if not math.isnan(p) else False}
    return out


def _cell(entry: dict, scale: float = 1.0, digits: int = 1) -> str:
    mean, se = entry["mean"] * scale, entry["se"] * scale
    return f"{mean:.{digits}f} +- {se:.{digits}f}" if not math.isnan(se) else f"{mean:.{digits}f}"


def _versus_text(test: dict | None, scale: float = 1.0) -> str:
    if test is None:
        return "best"
    word = "significant" if test["significant"] else "tie"
    return f"{test['difference'] * scale:+.1f} (p = {test['p']:.3f}, {word})"


def table(summary: dict[str, dict], title: str, score: str = "accuracy") -> str:
    """One row per configuration: in-domain and out-of-domain score (percent), KL(pi || pi_ref) per sequence on the
    in-domain and out-of-domain prompts, length, collapses and spikes, and the paired test against the best in-domain
    and out-of-domain configuration."""
    tests = {m: versus_best(summary, m) for m in ("id", "ood") if all(m in r for r in summary.values())}
    proxy = all("proxy" in r for r in summary.values())
    head = (f"{'configuration':<28} {'seeds':>5}  {'in-domain ' + score + ' %':>20}  {'vs best':<28} "
            f"{'out-of-domain %':>16}  {'vs best':<28} {'KL(pi||ref) id':>15} {'KL ood':>14} {'length':>7} "
            f"{'collapses':>9} {'spikes':>6}" + (f" {'proxy reward %':>16}" if proxy else ""))
    lines = [title, head, "-" * len(head)]
    order = sorted(summary, key=lambda c: -summary[c]["id"]["mean"])
    for config in order:
        row = summary[config]
        line = (f"{config:<28} {len(row['seeds']):>5}  {_cell(row['id'], 100):>20}  "
                f"{_versus_text(tests['id']['versus'].get(config) if config != tests['id']['best'] else None, 100):<28} ")
        if "ood" in tests:
            line += (f"{_cell(row['ood'], 100):>16}  "
                     f"{_versus_text(tests['ood']['versus'].get(config) if config != tests['ood']['best'] else None, 100):<28} ")
        line += (f"{_cell(row['kl'], 1, 2):>15} {_cell(row['kl_ood'], 1, 2) if 'kl_ood' in row else '':>14} "
                 f"{row['length']['mean']:>7.1f} {int(sum(row['collapse']['per_seed'])) + len(row['failed_seeds']):>5} / {len(row['seeds']) + len(row['failed_seeds']):<1} "
                 f"{statistics.fmean(row['spikes']['per_seed']):>6.1f}")
        if proxy:
            line += f" {_cell(row['proxy'], 100):>16}"
        lines.append(line)
    reference = next(iter(summary.values()))["reference"]
    lines.append(f"reference (step 0, mean over the seeds' evaluations): in-domain {100 * reference['id']:.1f} %"
                 + (f", out-of-domain {100 * reference['ood']:.1f} %" if "ood" in reference else ""))
    return "\n".join(lines)


def markdown(summary: dict[str, dict], score: str = "accuracy") -> str:
    """The table of `table` as markdown (docs/task.md): score in and out of domain with the paired test against the
    best, KL(pi || pi_ref) per sequence, collapses."""
    tests = {m: versus_best(summary, m) for m in ("id", "ood") if all(m in r for r in summary.values())}
    proxy = all("proxy" in r for r in summary.values())
    columns = ["configuration", f"in-domain {score} %", "vs best"] + (["out-of-domain %", "vs best"] if "ood" in tests
                                                                        else [])
    columns += ["KL(pi \\|\\| pi_ref) in domain", "out of domain", "collapses"] + (["proxy reward %"] if proxy else [])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for config in sorted(summary, key=lambda c: -summary[c]["id"]["mean"]):
        row = summary[config]
        cells = [f"`{config}`", _cell(row["id"], 100), _markdown_versus(tests["id"], config)]
        if "ood" in tests:
            cells += [_cell(row["ood"], 100), _markdown_versus(tests["ood"], config)]
        cells += [_cell(row["kl"], 1, 2), _cell(row["kl_ood"], 1, 2) if "kl_ood" in row else "",
                  f"{int(sum(row['collapse']['per_seed'])) + len(row['failed_seeds'])} / "
                  f"{len(row['seeds']) + len(row['failed_seeds'])}"]
        if proxy:
            cells.append(_cell(row["proxy"], 100))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown_versus(test: dict, config: str) -> str:
    if config == test["best"]:
        return "**best**"
    entry = test["versus"].get(config)
    if entry is None:
        return ""
    p = "n/a" if math.isnan(entry["p"]) else f"{entry['p']:.3f}"
    return f"{100 * entry['difference']:+.1f} (p {p}{', significant' if entry['significant'] else ''})"


def lag_table(summaries: dict[int, dict[str, dict]], title: str) -> str:
    """The lag study: one row per (configuration, lag) with the in-domain and out-of-domain score, the KL, collapses,
    spikes and the mean importance-weight ESS of the training batches (kl-adapters presets only)."""
    configs = [c for c in dict.fromkeys(c for rows in summaries.values() for c in rows)
               if sum(c in rows for rows in summaries.values()) > 1]  # the configurations run at several lags
    w = max([16, *map(len, configs)])
    head = (f"{'configuration':<{w}} {'lag':>3}  {'in-domain %':>13}  {'out-of-domain %':>15}  {'KL(pi||ref)':>12}  "
            f"{'collapses':>9}  {'spikes':>6}  {'is_ess':>6}")
    lines = [title, head, "-" * len(head)]
    for config in configs:
        for lag, rows in sorted(summaries.items()):
            row = rows.get(config)
            if row is None:
                continue
            n = len(row["seeds"]) + len(row["failed_seeds"])
            ess = f"{row['is_ess']['mean']:.3f}" if "is_ess" in row else "--"
            lines.append(f"{config:<{w}} {lag:>3}  {_cell(row['id'], 100):>13}  {_cell(row['ood'], 100):>15}  "
                         f"{_cell(row['kl'], 1, 2):>12}  {int(sum(row['collapse']['per_seed'])) + len(row['failed_seeds']):>5} / {n}  "
                         f"{statistics.fmean(row['spikes']['per_seed']):>6.1f}  {ess:>6}")
    return "\n".join(lines)


def plot_frontier(points: dict[str, list[dict]], path: Path, title: str) -> None:
    """Final score against the final in-domain KL(pi || pi_ref), in domain and out of domain (two panels): per
    configuration family one point per beta (mean +- se over seeds), joined in order of KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("id", "in-domain score")] + ([("ood", "out-of-domain score")] if any(
        p["ood"] for rows in points.values() for p in rows) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (split, label) in zip(axes[0], panels):
        for family, rows in points.items():
            rows = sorted((r for r in rows if r[split]), key=lambda r: r["kl"]["mean"])
            if not rows:
                continue
            ax.errorbar([r["kl"]["mean"] for r in rows], [100 * r[split]["mean"] for r in rows],
                        xerr=[r["kl"]["se"] for r in rows], yerr=[100 * r[split]["se"] for r in rows], marker="o",
                        capsize=3, label=family, alpha=0.85)
            if family != "beta=0":
                for r in rows:
                    ax.annotate(f"{r['beta']:g}", (r["kl"]["mean"], 100 * r[split]["mean"]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("KL(pi || pi_ref) per sequence, in-domain prompts (nats, log scale)")
        ax.set_ylabel(label + " (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
