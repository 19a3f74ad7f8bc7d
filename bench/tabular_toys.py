"""Tabular reproduction of the papers' toy findings, with sampled gradients and exact evaluation.

A tabular autoregressive softmax policy over every sequence of V tokens (incl. EOS) and length <= T
(kl_adapters.audit.sequence_space); pi_ref has random logits, r(y) is a random reward in [0, 1). Each step samples a
batch from pi, takes one Adam step (learning rate decayed linearly to 0) on
    task:  -(1/B) sum_i (r_i - mean_{j != i} r_j) log pi(y_i)        (leave-one-out baseline: unbiased for grad E[r])
    KL:    kl_surrogate(..., preset)                                  (or none, for beta = 0)
and evaluates exactly, by enumeration: KL(pi || pi*) with pi* = pi_ref exp(r/beta) / Z, J* - J = beta KL(pi || pi*),
and KL(pi || pi_ref). Findings checked (Tang & Munos 2025; Shah et al. 2025): unbiased configurations (sequence,
reward) converge to pi*; biased ones converge away from it (token = per-token k2 gradient, k3-loss = forward KL);
k1 as a loss does not regularize (it tracks beta = 0); k3 in the reward regularizes far too weakly (its bias pushes
the forward KL up: KL(pi || pi_ref) ends well above pi*'s).
Usage: .venvs/core/bin/python bench/tabular_toys.py [--steps 3000] [--seeds 5] [--beta 0.1]
Writes bench/results/tabular_toys.json and bench/results/tabular_toys.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
from timing import RESULTS, write_result  # noqa: E402

from kl_adapters import kl_surrogate  # noqa: E402
from kl_adapters.audit import SequenceSpace, sequence_space, token_logps  # noqa: E402

CONFIGS = ("sequence", "reward", "sequence-plain", "token", "k3-loss", "k1-loss", "k3-reward", "beta=0")


def problem(space: SequenceSpace, seed: int, ref_scale: float) -> tuple[Tensor, Tensor]:
    """(pi_ref's logits [nodes, V] ~ N(0, ref_scale^2), rewards [sequences] ~ U[0, 1)) of one random problem."""
    gen = torch.Generator().manual_seed(1000 + seed)
    ref_logits = ref_scale * torch.randn(len(space.nodes), space.vocab, generator=gen, dtype=torch.float64)
    return ref_logits, torch.rand(space.num_sequences, generator=gen, dtype=torch.float64)


def log_optimum(space: SequenceSpace, ref_logits: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """[sequences] log pi*(y), pi* = pi_ref exp(r / beta) / Z."""
    ref_seq = token_logps(space, ref_logits).sum(-1)
    return ref_seq + rewards / beta - torch.logsumexp(ref_seq + rewards / beta, 0)


def run(config: str, seed: int, a: argparse.Namespace) -> dict[str, list[float]]:
    space = sequence_space(a.vocab, a.horizon)
    ref_logits, rewards = problem(space, seed, a.ref_scale)
    ref_seq = token_logps(space, ref_logits).sum(-1)
    log_opt = log_optimum(space, ref_logits, rewards, a.beta)
    theta = ref_logits.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=a.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / a.steps)  # linear decay, as TRL's default
    sampler = torch.Generator().manual_seed(seed)
    out = {"kl_opt": [], "kl_ref": [], "gap": []}
    for step in range(a.steps + 1):
        lp = token_logps(space, theta)
        with torch.no_grad():
            seq = lp.sum(-1)
            p = seq.exp()
            out["kl_opt"].append(float((p * (seq - log_opt)).sum()))
            out["kl_ref"].append(float((p * (seq - ref_seq)).sum()))
            out["gap"].append(a.beta * out["kl_opt"][-1])
        if step == a.steps:
            break
        idx = torch.multinomial(p, a.batch, replacement=True, generator=sampler)
        r = rewards[idx]
        advantage = r - (r.sum() - r) / (a.batch - 1)
        loss = -(advantage * lp[idx].sum(-1)).mean()
        if config != "beta=0":
            loss = loss + kl_surrogate(lp[idx], token_logps(space, ref_logits)[idx], space.mask[idx],
                                       preset=config, beta=a.beta)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=5)
    p.add_argument("--horizon", type=int, default=4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--ref-scale", type=float, default=1.0, help="std of pi_ref's logits")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seeds", type=int, default=5)
    a = p.parse_args()
    runs = {c: [run(c, s, a) for s in range(a.seeds)] for c in CONFIGS}
    tail = max(1, a.steps // 10)
    summary = {}
    for c, rs in runs.items():
        final = [sum(r["kl_opt"][-tail:]) / tail for r in rs]
        summary[c] = {"kl_opt_final_mean": sum(final) / len(final), "kl_opt_final_per_seed": final,
                      "kl_ref_final_mean": sum(r["kl_ref"][-1] for r in rs) / len(rs)}
    print(f"{'config':<15} KL(pi||pi*) over the last {tail} steps, per seed")
    for c, s in summary.items():
        print(f"{c:<15} mean {s['kl_opt_final_mean']:.4f}  seeds " + " ".join(f"{v:.4f}" for v in s["kl_opt_final_per_seed"]))
    write_result("tabular_toys", {"settings": vars(a), "summary": summary,
                                  "curves": {c: [r["kl_opt"] for r in rs] for c, rs in runs.items()}})
    plot(runs, a)


def plot(runs: dict, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (c, rs) in enumerate(runs.items()):
        for ax, key in zip(axes, ("kl_opt", "kl_ref")):
            curves = torch.tensor([r[key] for r in rs])
            mean = curves.mean(0)
            line, = ax.plot(mean, label=c, lw=1.5, ls=("-", "--", ":", "-.")[i % 4])
            ax.fill_between(range(len(mean)), curves.min(0).values, curves.max(0).values, alpha=0.15,
                            color=line.get_color())
    axes[0].set(yscale="log", xlabel="step", ylabel="KL(pi || pi*)  (exact)",
                title=f"distance to the optimum (V={a.vocab}, T={a.horizon}, beta={a.beta})")
    axes[1].set(xlabel="step", ylabel="KL(pi || pi_ref)  (exact)", title="distance to the reference")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tabular policy, {a.batch} samples/step, Adam lr {a.lr} decayed linearly; mean and min-max over "
                 f"{a.seeds} seeds (sequence and reward coincide: same samples, same per-sample gradient on-policy)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "tabular_toys.png", dpi=110)


if __name__ == "__main__":
    main()
