"""`kl-adapters measure`'s output: a short table for people, one verdict line per judged configuration, the JSON
document (`--json`) and the plot (`--plot`)."""

from __future__ import annotations

import math

from .crossfit import Interval
from .measurement import Measurement, Row

#: JSON schema version of `document`
SCHEMA = 1


def _pct(x: Interval) -> str:
    def p(v: float) -> str:
        if math.isnan(v):
            return "-"
        if v >= 0.1:
            return f"{100 * v:.0f}%"
        if v == 0:
            return "0%"
        return f"{100 * v:.1f}%" if v >= 0.001 else f"{100 * v:.2f}%" if v >= 1e-4 else "<0.01%"
    return f"{p(x.estimate)} [{p(max(x.low, 0.0))}, {p(x.high)}]" if not math.isnan(x.low) else p(x.estimate)


def _num(x: Interval, fmt: str = ".3f") -> str:
    def f(v: float) -> str:
        return "-" if math.isnan(v) else format(v, fmt)
    return f"{f(x.estimate)} [{f(x.low)}, {f(x.high)}]" if not math.isnan(x.low) else f(x.estimate)


def _steps(x: Interval) -> str:
    def f(v: float) -> str:
        if math.isnan(v):
            return "-"
        return "never" if math.isinf(v) else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"
    return f"{f(x.estimate)} [{f(x.low)}, {f(x.high)}]"


def verdict(row: Row, m: Measurement) -> str:
    """One line: whether the bias is resolved, how large, and, with a reward, after how many steps it matters."""
    level = f"{100 * m.confidence:g}%"
    if math.isnan(row.bias.low):
        return (f"{row.name}: not measurable here: the exact KL gradient is not resolved from zero with these samples "
                "(is the policy its own reference?)")
    if row.bias.high == 0:
        return f"{row.name}: unbiased (its gradient is the exact estimator's)"
    if row.bias.low > 0:
        text = f"{row.name}: biased, {_pct(row.bias)} of the exact KL gradient ({level} interval)"
    else:
        text = (f"{row.name}: no bias resolved with {m.groups * m.group_size:,} completions: at most "
                f"{100 * row.bias.high:.2g}% of the exact KL gradient")
    if row.horizon is not None and not math.isnan(row.horizon.low):
        steps = f"{m.step_groups * m.group_size:g}-completion steps"
        if row.bias.low > 0 and not math.isinf(row.horizon.estimate):
            text += (f"; it outweighs the noise of training after about {_steps(row.horizon)} {steps} "
                     "(bias adds up as n b, noise as sqrt(n) sigma)")
        else:
            text += f"; if it exists it outweighs the noise of training only after more than {row.horizon.low:,.0f} {steps}"
    return text


def format_table(m: Measurement, header: list[str], others: list[Measurement] = ()) -> str:
    """The table: header lines, every configuration's bias and cosine (and, with a reward, against the trained
    gradient and one step's noise), the judged configurations at the other betas (`others`, the same samples), the
    first judged configuration by completion length, and the verdicts."""
    level = f"{100 * m.confidence:g}%"
    lines = [*header, f"exact KL gradient: |E g| = {_num(m.exact_norm, '.3g')} ({level} intervals below; "
                      f"{m.folds} folds of {m.groups // m.folds}-{-(-m.groups // m.folds)} prompt groups)", ""]
    task = m.trained_norm is not None
    head = f"{'configuration':<26}{'preset':<15}{'bias vs exact KL grad':<26}{'cosine':<25}"
    if task:
        head += f"{'beta bias / trained grad':<27}{'/ one step noise':<25}{'steps until bias > noise'}"
    lines += [head, "-" * len(head)]
    for r in m.rows:
        name = r.name + (" *" if r.judged else "")
        line = f"{name:<26}{r.preset:<15}{_pct(r.bias):<26}{_num(r.cosine):<25}"
        if task:
            line += f"{_pct(r.trained):<27}{_pct(r.noise):<25}{_steps(r.horizon)}"
        lines.append(line)
    lines.append("* judged; bias = |E g - grad KL_seq| / |grad KL_seq|, cosine = cos(E g, grad KL_seq)")
    if task and others:
        lines += ["", f"{'judged at beta':<26}{'':<15}{'beta bias / trained grad':<27}{'/ one step noise':<25}"
                      "steps until bias > noise"]
        for other in others:
            for r in other.rows:
                if r.judged:
                    lines.append(f"{r.name + f' @ {other.beta:g}':<41}{_pct(r.trained):<27}{_pct(r.noise):<25}"
                                 f"{_steps(r.horizon)}")
    if len(m.by_length) > 1:
        judged = next(r for r in m.rows if r.judged)
        lines += ["", f"{judged.name} by completion length (tokens, EOS included):",
                  f"{'tokens':<10}{'completions':<13}{'bias in the bin':<26}{'share of |grad KL|'}"]
        for b in m.by_length:
            lines.append(f"{f'{b.low}-{b.high - 1}':<10}{100 * b.completions:>10.0f}%  {_pct(b.bias):<26}"
                         f"{_pct(b.share)}")
    lines += [""] + [verdict(r, m) for r in m.rows if r.judged]
    return "\n".join(lines)


def document(m: Measurement, context: dict, others: list[Measurement] = ()) -> dict:
    """The `--json` document: {"schema", "context" (inputs and sampling), "measurement" (Measurement.as_dict),
    "verdicts", "other_betas" (the measurement at each further beta)}."""
    return {"schema": SCHEMA, "context": context, "measurement": m.as_dict(),
            "verdicts": [verdict(r, m) for r in m.rows if r.judged], "other_betas": [o.as_dict() for o in others]}


def plot(m: Measurement, path: str, title: str) -> None:
    """Bias per configuration with its interval, and the judged configuration's bias by completion length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    names = [r.name for r in m.rows]
    est = [100 * r.bias.estimate for r in m.rows]
    err = [[100 * (r.bias.estimate - max(r.bias.low, 0)) for r in m.rows],
           [100 * (r.bias.high - r.bias.estimate) for r in m.rows]]
    axes[0].barh(names, est, xerr=err, color=["tab:red" if r.judged else "tab:gray" for r in m.rows])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("bias: |E g - grad KL_seq| / |grad KL_seq| (%)")
    if m.by_length:
        mid = [(b.low + b.high - 1) / 2 for b in m.by_length]
        axes[1].errorbar(mid, [100 * b.bias.estimate for b in m.by_length],
                         yerr=[[100 * (b.bias.estimate - max(b.bias.low, 0)) for b in m.by_length],
                               [100 * (b.bias.high - b.bias.estimate) for b in m.by_length]], marker="o", capsize=3)
        axes[1].set_xlabel("completion length (tokens)")
        axes[1].set_ylabel(f"bias of {next(r.name for r in m.rows if r.judged)} in the bin (%)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
