"""Summaries, the text table, the PNG plot and the JSON of a demo run."""

from __future__ import annotations

import json
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
