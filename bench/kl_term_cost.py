"""Core cost of the KL term: kl_term + surrogate + backward, plain vs variance-reduced presets, on [B, T] batches.

Configurations (float32 inputs, the shapes of a long and a wide micro-batch; off-policy: old_logp given, as with PPO
epochs or async rollouts; on-policy: no old_logp, as in TRL's default num_iterations=1):
  sequence-plain / reward-plain     today's estimators
  sequence / reward                 reduced, statistics computed from the batch itself (leave-one-out over its rows),
                                    fitted with the task advantages and end-of-sequence probabilities an adapter passes
  sequence+stats                    reduced, statistics precomputed by kl_statistics (the rollout-time path; the loss
                                    still applies the own rows' termination control variate)
All configurations of one shape alternate call by call (ABBA); medians and the ratio to the plain preset are reported.
No framework is involved (framework-level overheads: bench/*_overhead.py).
Usage: .venvs/core/bin/python bench/kl_term_cost.py [--repeats 60] [--device cpu|cuda] [--note TEXT] [--name NAME]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402

from kl_adapters import EndOfSequence, TaskAdvantages, kl_statistics, kl_term  # noqa: E402

#: (B, T, off-policy)
SHAPES = [(8, 4096, True), (64, 512, True), (8, 4096, False)]


def shape_name(b: int, t: int, off_policy: bool) -> str:
    """A shape's row name in the results of this script and the scripts built on its batches."""
    return f"{b}x{t}" + ("" if off_policy else " on-policy")


def batch(b: int, t: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    logp = -torch.rand(b, t, generator=gen, device=device) * 2
    ref = logp + 0.1 * torch.randn(b, t, generator=gen, device=device)
    old = logp + 0.05 * torch.randn(b, t, generator=gen, device=device)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen, device=device)
    mask = torch.arange(t, device=device)[None] < lengths[:, None]
    task = TaskAdvantages(torch.randn(b, generator=gen, device=device), 0.05, normalized=True)
    ends = mask & ~torch.roll(mask, -1, 1)  # the last real token; an EOS where the row stops before t
    eos = EndOfSequence(0.01 * torch.rand(b, t, generator=gen, device=device), ends & (lengths < t)[:, None], t)
    return logp, ref, old, mask, task, eos


def configs(logp, ref, old, mask, task, eos, off_policy: bool):
    old = old if off_policy else None
    stats = kl_statistics(logp, ref, mask, old_logp=old, task=task, eos=eos)

    def step(preset, **kw):
        def run():
            x = logp.detach().requires_grad_(True)
            kl_term(x, ref, mask, preset=preset, old_logp=old, **kw).surrogate(0.05).backward()
        return run

    return {"sequence-plain": step("sequence-plain"), "sequence": step("sequence", task=task, eos=eos),
            "sequence+stats": step("sequence", statistics=stats, eos=eos), "reward-plain": step("reward-plain"),
            "reward": step("reward", task=task, eos=eos)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--note", default="", help="measurement conditions (e.g. other work running)")
    parser.add_argument("--name", default=None, help="result file name under bench/results (default kl_term_cost_<device>)")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
    if sync is None:
        torch.set_num_threads(1)  # as the other benchmarks: reproducible, and fair on a shared machine
    results = {}
    for b, t, off_policy in SHAPES:
        times = alternating(configs(*batch(b, t, args.device), off_policy), repeats=args.repeats, sync=sync)
        row = {"median_ms": {c: 1e3 * statistics.median(v) for c, v in times.items()}}
        for plain, reduced in (("sequence-plain", "sequence"), ("sequence-plain", "sequence+stats"),
                               ("reward-plain", "reward")):
            cmp = compare(times, plain, reduced)
            row[f"{reduced}/{plain}"] = {"ratio": cmp["ratio"], "median_paired_ratio": cmp["median_paired_ratio"]}
        name = shape_name(b, t, off_policy)
        results[name] = row
        cells = "  ".join(f"{c} {ms:.2f} ms" for c, ms in row["median_ms"].items())
        print(f"{name}: {cells}")
        for k, v in row.items():
            if k != "median_ms":
                print(f"    {k}: ratio of medians {v['ratio']:.2f}, median paired ratio {v['median_paired_ratio']:.2f}")
    path = write_result(args.name or f"kl_term_cost_{args.device.split(':')[0]}",
                        {"device": args.device, "repeats": args.repeats, "note": args.note, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
