"""Summaries, the text table, the PNG plot and the JSON of a demo run."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

METRICS = ("gap", "kl_opt")  # J* - J and KL(pi || pi*)
LABELS = {"gap": "J* - J", "kl_opt": "KL(pi || pi*)"}


def summarize(histories: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Per configuration: final value and area under the curve (mean over steps) of each metric, over seeds."""
    out = {}
    for config, runs in histories.items():
        row = {"seeds": len(runs)}
        for m in METRICS + ("reward", "kl_ref"):
            finals = [run[-1][m] for run in runs]
            aucs = [statistics.fmean(h[m] for h in run) for run in runs]
            row[m] = {"final_mean": statistics.fmean(finals), "final_std": _std(finals), "final_per_seed": finals,
                      "auc_mean": statistics.fmean(aucs), "auc_std": _std(aucs)}
        out[config] = row
    return out


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def ratios(summary: dict, baseline: str, candidate: str) -> list[float]:
    """Per-seed KL(pi||pi*) ratio baseline / candidate at the final step (the issue's 5x target)."""
    b, c = summary[baseline]["kl_opt"]["final_per_seed"], summary[candidate]["kl_opt"]["final_per_seed"]
    return [x / y for x, y in zip(b, c)]


def wilcoxon_signed_rank(differences: list[float]) -> tuple[float, float, int]:
    """(W+, exact two-sided p, n) of the Wilcoxon signed-rank test of a zero median of paired differences.

    Zero differences are dropped; tied |d| get their average rank; the null distribution of W+ (the rank sum of the
    positive differences) is enumerated exactly over the 2^n equally likely sign patterns, by dynamic programming over
    doubled ranks (so average ranks stay integers). p = min(1, 2 min(P(W+ <= w), P(W+ >= w))). Pinned by
    tests/trl/test_demo.py::test_wilcoxon_signed_rank.
    """
    d = [x for x in differences if x != 0]
    n = len(d)
    if n == 0:
        return 0.0, 1.0, 0
    order = sorted(range(n), key=lambda i: abs(d[i]))
    doubled = [0] * n  # 2 x rank
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            doubled[order[k]] = i + j + 2  # 2 x the average of ranks i + 1 .. j + 1
        i = j + 1
    counts = [1] + [0] * sum(doubled)  # counts[s]: sign patterns whose positive doubled ranks sum to s
    for r in doubled:
        counts = [c + (counts[s - r] if s >= r else 0) for s, c in enumerate(counts)]
    w2 = sum(r for r, x in zip(doubled, d) if x > 0)
    total = 2**n
    below, above = sum(counts[: w2 + 1]) / total, sum(counts[w2:]) / total
    return w2 / 2, min(1.0, 2 * min(below, above)), n


def paired_comparison(summary: dict, candidate: str, reference: str, metric: str = "kl_opt") -> dict:
    """The final-step `metric` of two configurations paired by seed: per-seed values, the geometric mean of
    candidate / reference, the Wilcoxon signed-rank test (`wilcoxon_signed_rank`) and the paired t-test
    (`long_horizon_report.paired_test`) on log(candidate) - log(reference), and the arithmetic means' paired
    difference candidate - reference with its standard error and paired t-test; the two runs of a seed share the
    initial policy (= pi_ref) and the reward, not the sampled batches."""
    from .long_horizon_report import paired_test, standard_error

    c, r = summary[candidate][metric]["final_per_seed"], summary[reference][metric]["final_per_seed"]
    logs = [math.log(x) - math.log(y) for x, y in zip(c, r)]
    w, p, n = wilcoxon_signed_rank(logs)
    difference, difference_p = paired_test(c, r)
    return {"candidate": candidate, "reference": reference, "metric": metric, "candidate_per_seed": c,
            "reference_per_seed": r, "geometric_mean_ratio": math.exp(statistics.fmean(logs)),
            "candidate_lower_on": sum(x < 0 for x in logs), "seeds": len(logs), "wilcoxon_w_plus": w,
            "wilcoxon_p_two_sided": p, "wilcoxon_n": n,
            "paired_t_log_p_two_sided": paired_test([math.log(x) for x in c], [math.log(y) for y in r])[1],
            "mean_difference": difference, "mean_difference_se": standard_error([x - y for x, y in zip(c, r)]),
            "mean_difference_p_two_sided": difference_p}


def seeds_text(summary: dict, comparison: dict | None) -> str:
    """Final KL(pi || pi*) per configuration over seeds (mean +- standard error, geometric mean, per seed) and the
    paired comparison, as text."""
    width = max(14, *(len(c) + 2 for c in summary))
    lines = ["Final KL(pi||pi*) over seeds: mean +- standard error (std / sqrt(seeds)), geometric mean, per seed",
             f"{'configuration':<{width}}{'mean +- se':>22}{'geo. mean':>11}  per seed"]
    for config, row in summary.items():
        finals = row["kl_opt"]["final_per_seed"]
        se = _std(finals) / math.sqrt(len(finals))
        geo = math.exp(statistics.fmean(math.log(x) for x in finals))
        lines.append(f"{config:<{width}}{f'{statistics.fmean(finals):.4f} +- {se:.4f}':>22}{geo:>11.4f}  "
                     + " ".join(f"{x:.4f}" for x in finals))
    if comparison:
        k = comparison
        lines.append(f"{k['candidate']} vs {k['reference']}, paired by seed: geometric-mean ratio "
                     f"{k['geometric_mean_ratio']:.3f}, lower on {k['candidate_lower_on']} of {k['seeds']} seeds; "
                     f"Wilcoxon signed-rank on log KL (exact, two-sided): W+ = {k['wilcoxon_w_plus']:g}, "
                     f"n = {k['wilcoxon_n']}, p = {k['wilcoxon_p_two_sided']:.3g}; paired t on log KL: "
                     f"p = {k['paired_t_log_p_two_sided']:.3g}; arithmetic means: difference "
                     f"{k['mean_difference']:+.5f} +- {k['mean_difference_se']:.5f} (paired t, two-sided: "
                     f"p = {k['mean_difference_p_two_sided']:.3g})")
    return "\n".join(lines)


def table(summary: dict, title: str) -> str:
    width = max(14, *(len(c) + 2 for c in summary))
    head = (f"{'configuration':<{width}}{'J*-J final':>20}{'J*-J AUC':>20}{'KL(pi||pi*) final':>22}"
            f"{'KL(pi||pi*) AUC':>20}{'E[r] final':>12}{'KL(pi||ref)':>12}")
    lines = [title, head, "-" * len(head)]
    for config, row in summary.items():
        cell = lambda m, k: f"{row[m][k + '_mean']:.4f} +- {row[m][k + '_std']:.4f}"  # noqa: E731
        lines.append(f"{config:<{width}}{cell('gap', 'final'):>20}{cell('gap', 'auc'):>20}{cell('kl_opt', 'final'):>22}"
                     f"{cell('kl_opt', 'auc'):>20}{row['reward']['final_mean']:>12.4f}{row['kl_ref']['final_mean']:>12.4f}")
    return "\n".join(lines)


def _merge_identical(histories: dict[str, list[list[dict]]]) -> dict[str, list[list[dict]]]:
    """One entry per distinct set of runs; configurations with identical runs share it, labelled "a = b"."""
    merged: dict[str, list[list[dict]]] = {}
    for config, runs in histories.items():
        twin = next((label for label, other in merged.items() if other == runs), None)
        if twin is None:
            merged[config] = runs
        else:
            merged[f"{twin} = {config}"] = merged.pop(twin)
    return merged


def plot(histories: dict[str, list[list[dict]]], path: Path, title: str) -> None:
    """J* - J and KL(pi || pi*) against steps: mean over seeds and min-max band (identical runs drawn once)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, (config, runs) in enumerate(_merge_identical(histories).items()):
        for ax, m in zip(axes, METRICS):
            curves = [[h[m] for h in run] for run in runs]
            steps = range(len(curves[0]))
            mean = [statistics.fmean(c[i] for c in curves) for i in steps]
            line, = ax.plot(steps, mean, label=config, lw=1.5, ls=("-", "--", ":", "-.")[k % 4])
            ax.fill_between(steps, [min(c[i] for c in curves) for i in steps],
                            [max(c[i] for c in curves) for i in steps], alpha=0.15, color=line.get_color())
    for ax, m in zip(axes, METRICS):
        ax.set(yscale="log", xlabel="optimizer step", ylabel=f"{LABELS[m]}  (exact)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out_dir: Path, name: str, doc: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
