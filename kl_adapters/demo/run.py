"""`kl-adapters demo`: train the toy problem under each KL configuration with a real trainer, evaluate exactly.

Runs every (configuration, seed) pair in `--workers` processes, then writes <out>/demo_<framework>.{json,png,txt}:
per-step exact E[r], KL(pi||pi_ref), J, J* - J and KL(pi||pi*) for every run, a summary (final value and area under
the curve, mean and spread over seeds), and the per-seed ratio KL(pi||pi*)[trl-default] / KL(pi||pi*)[sequence].
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from . import report
from .problem import ToyProblem
from .trl_runner import CONFIGS, TrainSettings, run_trl


def _worker_init() -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(1)  # one process per core: tiny models are overhead-bound


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    p.add_argument("--group", type=int, default=256, help="completions per step, one prompt (default 256)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate, decayed linearly (default 0.01)")
    p.add_argument("--beta", type=float, default=0.2, help="KL coefficient of the objective (default 0.2)")
    p.add_argument("--horizon", type=int, default=5, help="maximum completion length T (default 5)")
    p.add_argument("--chars", default="ab", help="non-EOS tokens (default 'ab': 63 sequences with T=5)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--workers", type=int, default=2, help="parallel processes (default 2)")
    p.add_argument("--out", default="bench/results", help="output folder (default bench/results)")


def main(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",")]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; valid: {', '.join(CONFIGS)}")
    problem = ToyProblem(chars=args.chars, horizon=args.horizon, beta=args.beta)
    settings = TrainSettings(steps=args.steps, group=args.group, learning_rate=args.lr)
    print(f"toy problem: {problem.space.num_sequences} sequences, beta={problem.beta}; TRL GRPOTrainer, "
          f"{len(configs)} configurations x {args.seeds} seeds x {settings.steps} steps, {args.workers} workers",
          flush=True)
    start = time.perf_counter()
    histories: dict[str, list] = {c: [None] * args.seeds for c in configs}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_worker_init) as pool:
        jobs = {pool.submit(run_trl, problem, c, s, settings): (c, s) for s in range(args.seeds) for c in configs}
        for job, (c, s) in jobs.items():
            histories[c][s] = job.result()
            print(f"  {c:<12} seed {s}: KL(pi||pi*) {histories[c][s][0]['kl_opt']:.3f} -> "
                  f"{histories[c][s][-1]['kl_opt']:.4f}   ({time.perf_counter() - start:.0f} s)", flush=True)
    summary = report.summarize(histories)
    title = (f"TRL GRPOTrainer on the exact toy problem ({problem.space.num_sequences} sequences, beta={problem.beta}, "
             f"G={settings.group}, {settings.steps} steps, {args.seeds} seeds)")
    text = report.table(summary, title)
    ratio = report.ratios(summary, "trl-default", "sequence") if {"trl-default", "sequence"} <= set(configs) else None
    if ratio:
        text += ("\n\nKL(pi||pi*) at the final step, trl-default / sequence, per seed: "
                 + ", ".join(f"{r:.1f}x" for r in ratio) + f"   (target: >= 5x on every seed: "
                 f"{'met' if min(ratio) >= 5 else 'NOT met'})")
    elapsed = time.perf_counter() - start
    text += f"\n\nwall time {elapsed:.0f} s"
    print("\n" + text)
    out = Path(args.out)
    command = "kl-adapters demo " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    report.write(out, "demo_trl", {"command": command, "problem": {"chars": problem.chars, "horizon": problem.horizon,
                                   "beta": problem.beta, "sequences": problem.space.num_sequences},
                                   "settings": asdict(settings), "seeds": args.seeds, "wall_time_s": elapsed,
                                   "summary": summary, "ratio_trl_default_over_sequence": ratio,
                                   "histories": histories})
    report.plot(histories, out / "demo_trl.png", title)
    (out / "demo_trl.txt").write_text(f"$ {command}\n{text}\n")
    print(f"\nwrote {out}/demo_trl.json, demo_trl.png, demo_trl.txt")
    return 0
