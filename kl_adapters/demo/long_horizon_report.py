"""Summaries, significance, the text table and the plot of the long-horizon benchmark.

Per horizon and configuration, over seeds: the final J* - J (its mean, standard error = std / sqrt(n), and per-seed
values, each itself an estimate with its own evaluation standard error), E[R], KL(pi || pi_ref), KL(pi || pi*), and
the wall time per optimizer step. The seeds are paired -- seed s is the same problem (pi_ref, pi*) and the same
initial policy under every configuration, evaluated with the same random numbers -- so two configurations are
compared by a paired t-test on the per-seed differences of the final J* - J (two-sided; "significant" at p < 0.05,
otherwise a tie at the standard errors shown).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from ..student_t import two_sided_p as student_t_p

#: one run: {"horizon", "config", "seed", "history": [evaluation rows], "step_seconds": [...], ...}
Run = dict


def final(run: Run, metric: str = "gap") -> float:
    return run["history"][-1][metric]


def summarize(runs: Iterable[Run]) -> dict[int, dict[str, dict]]:
    """{horizon: {config: summary}} with, per metric of the final evaluation, mean, se and per-seed values (seed
    order), and the mean seconds per step."""
    grouped: dict[int, dict[str, list[Run]]] = {}
    for run in runs:
        grouped.setdefault(run["horizon"], {}).setdefault(run["config"], []).append(run)
    out: dict[int, dict[str, dict]] = {}
    for horizon in sorted(grouped):
        out[horizon] = {}
        for config, group in grouped[horizon].items():
            group = sorted(group, key=lambda r: r["seed"])
            row = {"seeds": [r["seed"] for r in group], "step_seconds": statistics.fmean(
                statistics.fmean(r["step_seconds"]) for r in group)}
            for metric in ("gap", "kl_opt", "reward", "kl_ref", "length"):
                values = [final(r, metric) for r in group]
                row[metric] = {"mean": statistics.fmean(values), "se": standard_error(values), "per_seed": values,
                               "eval_se": [final(r, metric + "_se") for r in group]}
            out[horizon][config] = row
    return out


def standard_error(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


def paired_test(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean of a - b, two-sided p-value of the paired t-test); p = nan with fewer than 2 pairs or no spread."""
    diffs = [x - y for x, y in zip(a, b)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2 or statistics.stdev(diffs) == 0:
        return mean, float("nan")
    t = mean / (statistics.stdev(diffs) / math.sqrt(len(diffs)))
    return mean, student_t_p(t, len(diffs) - 1)


def decisions(summary: dict[int, dict[str, dict]], baseline: str, candidates: list[str]) -> dict[int, dict]:
    """Per horizon: the configuration with the lowest mean final J* - J ("best"), each other configuration's
    difference to it with the paired p-value (on the seeds both ran: "seeds" names them where that is not all of
    either's), and the per-seed ratio J* - J[baseline] / J* - J[candidate] for the
    best of `candidates` (the kl-adapters configurations) run on the baseline's seeds."""
    out = {}
    for horizon, rows in summary.items():
        best = min(rows, key=lambda c: rows[c]["gap"]["mean"])
        versus = {}
        for config, row in rows.items():
            common = [s for s in row["seeds"] if s in rows[best]["seeds"]]
            if config != best and common:
                diff, p = paired_test(*(_on_seeds(r, common) for r in (row, rows[best])))
                versus[config] = {"difference": diff, "p": p, "significant": p < 0.05,
                                  "seeds": None if common == row["seeds"] == rows[best]["seeds"] else common}
        entry = {"best": best, "versus_best": versus}
        ours = [c for c in candidates if c in rows and baseline in rows and rows[c]["seeds"] == rows[baseline]["seeds"]]
        if ours:
            candidate = min(ours, key=lambda c: rows[c]["gap"]["mean"])
            entry["ratio"] = {"baseline": baseline, "candidate": candidate, "per_seed": [
                x / y for x, y in zip(rows[baseline]["gap"]["per_seed"], rows[candidate]["gap"]["per_seed"])]}
        out[horizon] = entry
    return out


def _on_seeds(row: dict, seeds: list[int]) -> list[float]:
    """A configuration's final J* - J on the given seeds (a subset of its own)."""
    return [row["gap"]["per_seed"][row["seeds"].index(s)] for s in seeds]


def table(summary: dict[int, dict[str, dict]], decided: dict[int, dict], title: str) -> str:
    """One block per horizon: a row per configuration (final J* - J mean +- se over seeds, per seed, E[R],
    KL(pi||ref), length, s/step, and the paired test against the best), then the baseline / best ratio per seed."""
    width = max(16, *(len(c) + 2 for rows in summary.values() for c in rows))
    head = (f"{'configuration':<{width}}{'J*-J final (mean +- se)':>26}  {'per seed':<26}{'E[R]':>7}{'KL(pi||ref)':>12}"
            f"{'length':>8}{'s/step':>8}  vs best (paired t-test)")
    lines = [title]
    for horizon, rows in summary.items():
        entry = decided[horizon]
        lines += ["", f"T = {horizon}", head, "-" * (len(head) + 12)]
        for config, row in sorted(rows.items(), key=lambda kv: kv[1]["gap"]["mean"]):
            gap = row["gap"]
            seeds = ", ".join(f"{x:.4f}" for x in gap["per_seed"])
            test = "best" if config == entry["best"] else _versus(entry["versus_best"].get(config))
            spread = f"+- {gap['se']:<7.4f}" if len(gap["per_seed"]) > 1 else f"{'(1 seed)':<10}"
            lines.append(f"{config:<{width}}{gap['mean']:>15.4f} {spread}  {seeds:<26}"
                         f"{row['reward']['mean']:>7.3f}{row['kl_ref']['mean']:>12.3f}{row['length']['mean']:>8.0f}"
                         f"{row['step_seconds']:>8.2f}  {test}")
        if "ratio" in entry:
            r = entry["ratio"]
            lines.append(f"J*-J {r['baseline']} / {r['candidate']}, per seed: "
                         + ", ".join(f"{x:.1f}x" for x in r["per_seed"]))
    return "\n".join(lines)


def _versus(test: dict | None) -> str:
    if test is None:
        return "(other seeds)"
    on = "" if test.get("seeds") is None else f"; seeds {','.join(map(str, test['seeds']))}"
    if math.isnan(test["p"]):
        return f"+{test['difference']:.4f} (one seed: no test{on})"
    verdict = "significant" if test["significant"] else "tie"
    return f"+{test['difference']:.4f}, p = {test['p']:.3f} ({verdict}{on})"


def plot(runs: Iterable[Run], path, title: str) -> None:
    """J* - J against optimizer steps, one panel per horizon (each with its legend; a configuration has the same
    colour and line style in every panel): mean over seeds and the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped: dict[int, dict[str, list[Run]]] = {}
    for run in runs:
        grouped.setdefault(run["horizon"], {}).setdefault(run["config"], []).append(run)
    names = sorted({config for configs in grouped.values() for config in configs})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = {c: (colours[k % len(colours)], ("-", "--", ":", "-.")[k % 4]) for k, c in enumerate(names)}  # per name
    fig, axes = plt.subplots(1, len(grouped), figsize=(5.5 * len(grouped), 4.5), squeeze=False)
    for ax, (horizon, configs) in zip(axes[0], sorted(grouped.items())):
        for config, group in sorted(configs.items()):
            steps = [row["step"] for row in group[0]["history"]]
            curves = [[row["gap"] for row in run["history"]] for run in group]
            mean = [statistics.fmean(c[i] for c in curves) for i in range(len(steps))]
            colour, dashes = style[config]
            ax.plot(steps, mean, label=f"{config} ({len(group)} seeds)", lw=1.5, ls=dashes, color=colour)
            ax.fill_between(steps, [min(c[i] for c in curves) for i in range(len(steps))],
                            [max(c[i] for c in curves) for i in range(len(steps))], alpha=0.15, color=colour)
        ax.set(yscale="log", xlabel="optimizer step", ylabel="J* - J", title=f"T = {horizon}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
