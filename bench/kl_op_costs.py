"""Where the KL term's CPU time goes: elementwise op costs, page faults per statistics call, termination increments.

Three measurements on the [B, T] batches of bench/kl_term_cost.py (float32, 1 torch thread):
  ops        median time of one op over an 8 x 4096 float32 tensor, relative to a multiplication: which passes are
             expensive (comparisons, torch.where, bool -> float conversions, transcendental functions)
  faults     minor page faults and median time per `kl_statistics` call (8 x 4096, task + eos), in a child process
             with glibc's default malloc settings and with MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ raised (freed
             memory kept: no page faults)
  eta        the termination increments' float32 error against float64 (largest absolute and relative error) and their
             time beside the whole KL term with precomputed statistics
Run it against another checkout with PYTHONPATH=<checkout> to compare library versions (it uses public functions and
`reductions.termination_increments` only).
Usage: .venvs/core/bin/python bench/kl_op_costs.py [--repeats 200]
       .venvs/core/bin/python bench/kl_op_costs.py --compare CHECKOUT... [--rounds 8] [--name NAME]  (faults only)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from kl_term_cost import batch  # noqa: E402
from timing import write_result_and_table  # noqa: E402

from kl_adapters import kl_statistics, kl_term  # noqa: E402
from kl_adapters.reductions import termination_increments  # noqa: E402

#: glibc settings under which freed memory is kept by the process (no page faults on the next call)
NO_FAULTS = {"MALLOC_MMAP_THRESHOLD_": "30000000", "MALLOC_TRIM_THRESHOLD_": "300000000"}


def median_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def op_costs(repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(8, 4096, generator=gen) * 0.5
    m = torch.rand(8, 4096, generator=gen) > 0.3
    mf = m.float()
    ops = {
        "x * mask (float)": lambda: x * mf,
        "x - y": lambda: x - mf,
        "x.clamp(min=...)": lambda: x.clamp(min=0.1),
        "x > c": lambda: x > 0.2,
        "torch.where(mask, x, 0)": lambda: torch.where(m, x, 0.0),
        "bool.to(float32)": lambda: m.to(torch.float32),
        "bool.view(uint8).to(float32)": lambda: m.view(torch.uint8).to(torch.float32),
        "torch.log1p": lambda: torch.log1p(x),
        "torch.expm1": lambda: torch.expm1(x),
        "cumsum": lambda: x.cumsum(-1),
        "isfinite & mask, any": lambda: (~torch.isfinite(x) & m).any(),
        "aminmax": lambda: torch.aminmax(x),
        "sum(-1, dtype=float64) of [8, 5, 4096]": lambda: x.expand(5, 8, 4096).transpose(0, 1).sum(
            -1, dtype=torch.float64),
    }
    return {name: median_us(fn, repeats) for name, fn in ops.items()}


def faults_child(repeats: int) -> dict[str, float]:
    """Run in the child process: minor page faults and median time per kl_statistics call."""
    logp, ref, _, mask, task, eos = batch(8, 4096, "cpu")

    def call():
        kl_statistics(logp, ref, mask, task=task, eos=eos)

    for _ in range(10):
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ms = median_us(call, repeats) / 1e3
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (repeats + 10)
    return {"ms_per_call": ms, "minor_faults_per_call": faults}


MODES = (("glibc defaults", {}), ("freed memory kept (" + " ".join(f"{k}={v}" for k, v in NO_FAULTS.items()) + ")",
                                    NO_FAULTS))


def child_run(repeats: int, extra: dict[str, str], checkout: str | None = None) -> dict[str, float]:
    """`faults_child` in a fresh process with the environment `extra` (and kl-adapters from `checkout`, if given)."""
    env = {k: v for k, v in os.environ.items() if k not in NO_FAULTS} | extra
    if checkout is not None:
        env["PYTHONPATH"] = checkout
    child = subprocess.run([sys.executable, __file__, "--child", str(repeats)], env=env, check=True,
                           capture_output=True, text=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def faults(repeats: int) -> dict[str, dict[str, float]]:
    return {label: child_run(repeats, extra) for label, extra in MODES}


def compare(checkouts: list[str], rounds: int, repeats: int, name: str) -> None:
    """`faults` of several checkouts, their child runs interleaved round by round (each checkout, then each mode), so
    that drift in the machine's state hits them alike: medians and ranges over the rounds."""
    runs = {c: {label: [] for label, _ in MODES} for c in checkouts}
    for _ in range(rounds):
        for c in checkouts:
            for label, extra in MODES:
                runs[c][label].append(child_run(repeats, extra, c))
    lines = [f"{'checkout':30s} {'malloc':15s} {'ms/call median (range)':>24s} {'faults/call median (range)':>28s}"]
    for c in checkouts:
        for label, _ in MODES:
            ms = [r["ms_per_call"] for r in runs[c][label]]
            fl = [r["minor_faults_per_call"] for r in runs[c][label]]
            lines.append(f"{c:30s} {label.split(' (')[0]:15s} {statistics.median(ms):8.2f} ({min(ms):.2f}-{max(ms):.2f})"
                         f"{statistics.median(fl):14.0f} ({min(fl):.0f}-{max(fl):.0f})")
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_result_and_table(name, {'rounds': rounds, 'repeats': repeats, 'runs': runs}, text)}")


def eta(repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    for b, t in ((8, 4096), (64, 512)):
        logp, ref, _, mask, task, eos = batch(b, t, "cpu")
        mf = mask.float()
        exact = termination_increments(eos, mf.double(), torch.float64)
        single = termination_increments(eos, mf, torch.float32).double()
        err = (single - exact).abs()
        stats = kl_statistics(logp, ref, mask, task=task, eos=eos)

        def term():
            kl_term(logp.detach().requires_grad_(True), ref, mask, statistics=stats, eos=eos).surrogate(0.05).backward()

        out[f"{b}x{t}"] = {"max_abs_error_float32": float(err.max()),
                           "max_rel_error_float32": float((err / exact.abs().clamp(min=1e-3)).max()),
                           "eta_us": median_us(lambda: termination_increments(eos, mf, torch.float32), repeats),
                           "kl_term_precomputed_us": median_us(term, repeats // 4)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs="+", metavar="CHECKOUT", help="only the page-fault measurement, of these "
                        "checkouts' kl-adapters, interleaved over --rounds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--name", default="kl_op_costs_cpu_compare", help="result name with --compare")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child is not None:
        print(json.dumps(faults_child(args.child)))
        return 0
    if args.compare:
        compare(args.compare, args.rounds, args.repeats, args.name)
        return 0
    ops = op_costs(args.repeats)
    page = faults(args.repeats // 4)
    inc = eta(args.repeats)
    base = ops["x * mask (float)"]
    lines = [f"{'op over 8 x 4096 float32':45s} {'us':>8s} {'x mul':>7s}"]
    lines += [f"{name:45s} {us:8.1f} {us / base:7.1f}" for name, us in ops.items()]
    lines += ["", f"{'kl_statistics, 8 x 4096, task + eos':60s} {'ms/call':>8s} {'faults/call':>12s}"]
    lines += [f"{label:60s} {r['ms_per_call']:8.2f} {r['minor_faults_per_call']:12.0f}" for label, r in page.items()]
    lines += ["", f"{'termination increments':24s} {'f32 max abs err':>16s} {'max rel err':>12s} {'eta us':>8s} "
                  f"{'KL term (precomputed) us':>25s}"]
    lines += [f"{shape:24s} {r['max_abs_error_float32']:16.2e} {r['max_rel_error_float32']:12.2e} {r['eta_us']:8.0f} "
              f"{r['kl_term_precomputed_us']:25.0f}" for shape, r in inc.items()]
    text = "\n".join(lines)
    print(text)
    path = write_result_and_table("kl_op_costs_cpu", {"repeats": args.repeats, "ops_us": ops, "page_faults": page,
                                                      "termination_increments": inc}, text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
