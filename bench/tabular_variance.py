"""Task + KL gradient variance on random tabular problems: a problem the reductions were not tuned on (issue 20).

Problem (the one of bench/tabular_toys.py): a tabular autoregressive softmax policy over every sequence of V tokens
(the last is EOS) of length <= T (`kl_adapters.audit.sequence_space`), pi_ref's logits ~ N(0, ref_scale^2) per
prefix, and a reward r(y) ~ U[0, 1) drawn per whole sequence (no per-token structure: credit over the whole
completion); one problem per seed. pi* = pi_ref exp(r / beta) / Z. Policies: the exact ascent on
J = E[r] - beta KL(pi || pi_ref) from pi_ref (Adam on the objective computed by enumeration), at the given steps;
each reports KL(pi || pi*) exactly.

At each policy, `--batches` batches of G completions sampled from pi, and on each the gradient a GRPO trainer takes
(dr_grpo, scale_rewards none: advantages A_i = r_i - the batch mean) with respect to the logits:

    g = (1/G) sum_i sum_t (A_i - beta c_{i,t}) (e_{y_t} - pi(. | y_<t))    at the logits of prefix y_<t

with c the preset's weights (`kl_coefficients`; the reduced presets leave-one-out within the batch, fitted with
TaskAdvantages(A, beta) and the policy's end-of-sequence probabilities, as the adapters pass them). Reported per
(problem, policy, G): tr Cov[g] over the batches relative to `sequence-plain`'s on the same batches (the plain form:
the floor a reduction must beat), with its delta-method standard error, and |mean g - exact| in standard errors of the
mean (an unbiased preset shows ~1), exact = (1 - 1/G) grad E[r] - beta grad KL(pi || pi_ref) by enumeration.
Usage: .venvs/core/bin/python bench/tabular_variance.py [--seeds 0 1 2] [--steps 0 10 30 100 1000] [--groups 16 64]
Writes bench/results/tabular_variance.{json,txt} (--name).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
from tabular_toys import log_optimum, problem  # noqa: E402
from timing import write_result_and_table  # noqa: E402
from variance import Moments, Progress, ratio_with_se  # noqa: E402

from kl_adapters import EndOfSequence, TaskAdvantages, kl_coefficients  # noqa: E402
from kl_adapters.audit import DTYPE, SequenceSpace, kl_seq, sequence_space, token_logps  # noqa: E402
from kl_adapters.presets import get_preset  # noqa: E402

PLAIN = "sequence-plain"


def ascent_path(space: SequenceSpace, ref: Tensor, rewards: Tensor, beta: float, steps: list[int], lr: float
                ) -> dict[int, Tensor]:
    """The policy's logits after each of `steps` Adam steps of exact ascent on E[r] - beta KL(pi || pi_ref)."""
    theta = ref.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    out = {}
    for step in range(max(steps) + 1):
        if step in steps:
            out[step] = theta.detach().clone()
        seq = token_logps(space, theta).sum(-1)
        loss = -(seq.exp() * rewards).sum() + beta * kl_seq(space, theta, ref)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


def distance_to_optimum(space: SequenceSpace, logits: Tensor, ref: Tensor, rewards: Tensor, beta: float) -> float:
    """KL(pi || pi*) exactly, pi* = pi_ref exp(r / beta) / Z."""
    seq = token_logps(space, logits).sum(-1)
    return float((seq.exp() * (seq - log_optimum(space, ref, rewards, beta))).sum())


def exact_gradient(space: SequenceSpace, logits: Tensor, ref: Tensor, rewards: Tensor, beta: float, group: int
                   ) -> Tensor:
    """(1 - 1/G) grad E[r] - beta grad KL(pi || pi_ref), flattened: the expected batch gradient of an unbiased preset
    (the batch-mean baseline scales the task term by 1 - 1/G)."""
    theta = logits.clone().requires_grad_(True)
    seq = token_logps(space, theta).sum(-1)
    objective = (1 - 1 / group) * (seq.exp() * rewards).sum() - beta * kl_seq(space, theta, ref)
    return torch.autograd.grad(objective, theta)[0].flatten()


def batch_gradients(space: SequenceSpace, logits: Tensor, ref: Tensor, rewards: Tensor, idx: Tensor, group: int,
                    beta: float, presets: list[str]) -> dict[str, Tensor]:
    """{preset: [K, nodes * V] the trainer's gradient on each of K = len(idx) / G consecutive batches}."""
    rows = idx.shape[0]
    batches = rows // group
    mask = space.mask[idx]
    logp, ref_logp = token_logps(space, logits)[idx], token_logps(space, ref)[idx]
    batch_id = torch.arange(batches).repeat_interleave(group)
    r = rewards[idx].view(batches, group)
    adv = (r - r.mean(-1, keepdim=True)).flatten()
    probs = torch.softmax(logits, -1)
    node, token = space.node_of_token[idx], space.token[idx]
    eos = EndOfSequence(probs[node, space.eos] * mask, (token == space.eos) & mask)
    key = (batch_id[:, None] * len(space.nodes) + node)[mask]
    out = {}
    for name in presets:
        extra = ({"group": batch_id, "task": TaskAdvantages(adv, beta), "eos": eos}
                 if get_preset(name).uses_batch_statistics else {})
        c = kl_coefficients(logp, ref_logp, mask, preset=name, **extra)
        w = ((adv[:, None] - beta * c) / group)[mask]
        onehot = torch.zeros(batches * len(space.nodes) * space.vocab, dtype=DTYPE).index_add_(
            0, key * space.vocab + token[mask], w)
        per_node = torch.zeros(batches * len(space.nodes), dtype=DTYPE).index_add_(0, key, w)
        g = onehot.view(batches, len(space.nodes), space.vocab) - per_node.view(batches, -1, 1) * probs
        out[name] = g.flatten(1)
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    space = sequence_space(args.vocab, args.horizon)
    presets = [PLAIN] + [p for p in args.presets if p != PLAIN]
    progress = Progress(len(args.seeds) * len(args.steps) * len(args.groups), "tabular variance")
    rows = []
    for seed in args.seeds:
        ref, rewards = problem(space, seed, args.ref_scale)
        path = ascent_path(space, ref, rewards, args.beta, args.steps, args.ascent_lr)
        for step, logits in path.items():
            gap = distance_to_optimum(space, logits, ref, rewards, args.beta)
            seq_p = token_logps(space, logits).sum(-1).exp()
            for group in args.groups:
                sampler = torch.Generator().manual_seed(10_000 * seed + 100 * step + group)
                target = exact_gradient(space, logits, ref, rewards, args.beta, group)
                moments = {p: Moments(target) for p in presets}
                for start in range(0, args.batches, args.batches_per_call):
                    k = min(args.batches_per_call, args.batches - start)
                    idx = torch.multinomial(seq_p, k * group, replacement=True, generator=sampler)
                    for p, g in batch_gradients(space, logits, ref, rewards, idx, group, args.beta, presets).items():
                        moments[p].add(g)
                plain = torch.cat(moments[PLAIN].dist)
                cells = {}
                for p, m in moments.items():
                    s = m.summary()
                    ratio, se = ratio_with_se(torch.cat(m.dist), plain)
                    cells[p] = {"trace": s["trace"], "ratio": ratio, "ratio_se": se,
                                "bias_in_se": s["bias"] / s["bias_se"] if s["bias_se"] > 0 else float("nan")}
                rows.append({"seed": seed, "step": step, "kl_to_optimum": gap, "group": group,
                             "batches": args.batches, "presets": cells})
                progress.step(1, f"seed {seed} step {step} G={group}")
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    presets = list(rows[0]["presets"])
    head = (f"Task + KL gradient variance, random tabular problems (V = {args.vocab} incl. EOS, T = {args.horizon}, "
            f"reward ~ U[0, 1) per sequence, beta = {args.beta}, GRPO advantages r - batch mean), {args.batches} "
            f"batches per cell; ratio = tr Cov[g] / tr Cov[g of {PLAIN}] on the same batches (+- se); "
            "bias = |mean g - exact| in standard errors")
    lines = [head, f"{'seed':>4} {'step':>5} {'KL(pi||pi*)':>11} {'G':>3} | "
             + " ".join(f"{p:>22}" for p in presets)]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        cells = " ".join(f"{c['ratio']:>8.3f} +- {c['ratio_se']:.3f} ({c['bias_in_se']:3.1f})"
                         for c in r["presets"].values())
        lines.append(f"{r['seed']:>4} {r['step']:>5} {r['kl_to_optimum']:>11.4f} {r['group']:>3} | {cells}")
    reduced = [(r, c) for r in rows for p, c in r["presets"].items() if p == "sequence"]
    if reduced:
        above = [(r, c) for r, c in reduced if c["ratio"] > 1]
        lines.append(f"sequence above {PLAIN}: {len(above)} of {len(reduced)} cells"
                     + (f" (largest {max(c['ratio'] for _, c in above):.3f}; by > 2 se: "
                        f"{sum(c['ratio'] - 1 > 2 * c['ratio_se'] for _, c in above)})" if above else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4)
    ap.add_argument("--horizon", type=int, default=6)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--ref-scale", type=float, default=1.0, help="std of pi_ref's logits")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, nargs="+", default=[0, 10, 30, 100, 1000],
                    help="ascent steps of the measured policies")
    ap.add_argument("--ascent-lr", type=float, default=0.05)
    ap.add_argument("--groups", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batches", type=int, default=2048, help="batches per (policy, G)")
    ap.add_argument("--batches-per-call", type=int, default=256)
    ap.add_argument("--presets", nargs="+", default=[PLAIN, "sequence", "token"])
    ap.add_argument("--name", default="tabular_variance")
    args = ap.parse_args()
    rows = measure(args)
    text = table(rows, args)
    print(text)
    path = write_result_and_table(args.name, {"settings": vars(args), "rows": rows}, text)
    print(f"wrote {path} and {path.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
