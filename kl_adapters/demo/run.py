"""`kl-adapters demo`, and the shared driver of every framework's run of the exact-objective benchmark.

A benchmark first runs the exact gradient check (`gradient_check`: the expected KL gradient of the framework's real
loss under each configuration, every completion enumerated, against grad KL(pi || pi_ref)), then trains the toy
problem's policy under each KL configuration with the framework's real code (TRL's GRPOTrainer here; verl's and
OpenRLHF's loss code in bench/demo_verl.py and bench/demo_openrlhf.py through `harness`), evaluating the objective
exactly after every step. `run_benchmark` runs every (configuration, seed) pair in worker processes and writes
<out>/<name>.{json,png,txt,log}: the check, per-step exact E[r], KL(pi||pi_ref), J, J* - J and KL(pi||pi*) for every
run, the summary (final value and area under the curve, mean and spread over seeds), the per-seed ratio
KL(pi||pi*)[baseline] / KL(pi||pi*)[candidate] at the final step, and (.log) everything the frameworks print. The
terminal shows one line per run, the tables and the paths.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import gradient_check, report
from .harness import TrainSettings
from .output import environment, output_to
from .problem import REWARD_KINDS, ToyProblem

#: (problem, configuration, seed, settings) -> (per-step exact metrics, the framework's own per-step metrics or None)
RunFn = Callable[[ToyProblem, str, int, TrainSettings], tuple[list[dict], object]]
#: (problem, configurations) -> (model, {configuration: (loss, batch rows)}, KL scale) for `gradient_check.check`
CheckFn = Callable[[ToyProblem, list[str]], tuple]
#: default output folder (git-ignored); committed results are written with --out bench/results
DEFAULT_OUT = "kl-adapters-demo"
#: KL(pi||pi*) ratio baseline / candidate the quick run must reach on every seed, and --long
TARGET_QUICK, TARGET_LONG = 3.0, 5.0

#: `kl-adapters demo` without --long: a few minutes on 2 cores (too short for the configurations to converge)
QUICK = TrainSettings()
#: the committed long benchmark: the quick settings run 2.5x longer, so that the unbiased configurations approach pi*
#: (every configuration x 3 seeds on 2 workers, measured: TRL 10.5 min of training, verl 1.9, OpenRLHF 1.2)
LONG = TrainSettings(steps=300, group=256, learning_rate=6e-3)


@dataclass(frozen=True)
class Benchmark:
    name: str  # output stem
    framework: str  # for titles
    run: RunFn  # module-level, so that worker processes can unpickle it
    configs: dict[str, str]  # configuration -> description
    baseline: str  # the framework's default KL configuration
    candidate: str  # kl-adapters' sequence preset under that framework's flag
    check: CheckFn | None = None  # the exact gradient check through the framework's loss
    target: float = TARGET_QUICK  # ratio baseline / candidate to reach on every seed


def add_arguments(p: argparse.ArgumentParser, configs: dict[str, str], defaults: TrainSettings) -> None:
    p.add_argument("--steps", type=int, help=f"optimizer steps per run ({defaults.steps})")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (3)")
    p.add_argument("--group", type=int, help=f"completions per step ({defaults.group})")
    p.add_argument("--lr", type=float, help=f"Adam learning rate, decayed linearly to 0 ({defaults.learning_rate})")
    p.add_argument("--beta", type=float, default=ToyProblem.beta, help=f"KL coefficient ({ToyProblem.beta})")
    p.add_argument("--horizon", type=int, default=ToyProblem.horizon,
                   help=f"maximum completion length T ({ToyProblem.horizon})")
    p.add_argument("--chars", default=ToyProblem.chars, help=f"non-EOS tokens ('{ToyProblem.chars}')")
    p.add_argument("--reward", default=ToyProblem.reward_kind, choices=REWARD_KINDS,
                   help=f"reward: 'answer' (1 for one full-length answer, {ToyProblem.partial_credit} otherwise) or "
                   f"'random' (U(0, 1) per sequence) ({ToyProblem.reward_kind})")
    p.add_argument("--no-check", action="store_true", help="skip the exact gradient check")
    p.add_argument("--configs", default=",".join(configs),
                   help="comma-separated subset of: " + "; ".join(f"{k} ({v})" for k, v in configs.items()))
    p.add_argument("--workers", type=int, default=2, help="parallel processes, one torch thread each (2; 0: in "
                   "this process)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder ({DEFAULT_OUT}/; the committed results: "
                   "--out bench/results)")


def settings_from(args: argparse.Namespace, base: TrainSettings) -> TrainSettings:
    """`base` with the --steps/--group/--lr given on the command line (add_arguments leaves the others None)."""
    given = {"steps": args.steps, "group": args.group, "learning_rate": args.lr}
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def _worker_init() -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # one process per core: tiny models are overhead-bound


def _timed(run: RunFn, problem: ToyProblem, config: str, seed: int, settings: TrainSettings):
    start = time.perf_counter()
    history, extras = run(problem, config, seed, settings)
    return history, extras, time.perf_counter() - start


def run_benchmark(bench: Benchmark, args: argparse.Namespace, settings: TrainSettings, command: str) -> int:
    """The check, then every (configuration, seed) pair of `bench`; prints the tables, writes <out>/<bench.name>.*.

    The frameworks' own output (log dicts, progress bars, warnings) goes to <out>/<bench.name>.log."""
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in bench.configs]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; valid: {', '.join(bench.configs)}")
    problem = ToyProblem(chars=args.chars, horizon=args.horizon, beta=args.beta, reward_kind=args.reward)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{bench.name}.log"
    with output_to(log) as say:
        try:
            return _run(bench, args, settings, command, chosen, problem, out, say)
        except BaseException:
            say(f"failed (traceback below); the frameworks' output is in {log}")
            raise


def _run(bench, args, settings, command, chosen, problem, out, say) -> int:
    say(f"toy problem: {problem.space.num_sequences} sequences, reward {problem.reward_kind!r}, beta={problem.beta}; "
        f"{bench.framework}; frameworks' output -> {out / (bench.name + '.log')}")
    check_text, check_rows = "", []
    if bench.check is not None and not args.no_check:
        start = time.perf_counter()
        check_rows = run_check(bench, problem, [c for c in chosen if c != "beta=0"])
        check_text = gradient_check.table(check_rows, bench.framework) + f"\n({time.perf_counter() - start:.0f} s)"
        say("\n" + check_text + "\n")
    say(f"training: {len(chosen)} configurations x {args.seeds} seeds x {settings.steps} steps, G={settings.group}, "
        f"{args.workers} workers")
    start = time.perf_counter()
    histories, extras, runtimes = ({c: [None] * args.seeds for c in chosen} for _ in range(3))
    pairs = [(c, s) for s in range(args.seeds) for c in chosen]
    pool = None if args.workers == 0 else ProcessPoolExecutor(
        args.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
    with pool or contextlib.nullcontext():
        if pool is None:
            results = ((pair, _timed(bench.run, problem, *pair, settings)) for pair in pairs)
        else:
            jobs = [(pair, pool.submit(_timed, bench.run, problem, *pair, settings)) for pair in pairs]
            results = ((pair, job.result()) for pair, job in jobs)
        for k, ((c, s), (history, extra, seconds)) in enumerate(results, 1):
            histories[c][s], extras[c][s], runtimes[c][s] = history, extra, seconds
            say(f"  [{k:>2}/{len(pairs)}] {c:<34} seed {s}: KL(pi||pi*) {history[0]['kl_opt']:.3f} -> "
                f"{history[-1]['kl_opt']:.4f}   ({seconds:.0f} s; {time.perf_counter() - start:.0f} s so far)")
    elapsed = time.perf_counter() - start
    summary = report.summarize(histories)
    title = (f"{bench.framework} on the exact toy problem ({problem.space.num_sequences} sequences, "
             f"reward {problem.reward_kind!r}, beta={problem.beta}, G={settings.group}, {settings.steps} steps, "
             f"{args.seeds} seeds)")
    text = report.table(summary, title)
    ratio = report.ratios(summary, bench.baseline, bench.candidate) if {bench.baseline, bench.candidate} <= set(
        chosen) else None
    if ratio:
        text += (f"\n\nKL(pi||pi*) at the final step, {bench.baseline} / {bench.candidate}, per seed: "
                 + ", ".join(f"{r:.1f}x" for r in ratio) + f"   (target >= {bench.target:g}x on every seed: "
                 f"{'met' if min(ratio) >= bench.target else 'NOT met'})")
    floor = bench.candidate + "-plain"  # the unreduced form of the candidate preset, the floor it must beat
    comparison = (report.paired_comparison(summary, bench.candidate, floor)
                  if args.seeds >= 2 and {bench.candidate, floor} <= set(chosen) else None)
    if args.seeds >= 2:
        text += "\n\n" + report.seeds_text(summary, comparison)
    text += "\n\nconfigurations:\n" + "\n".join(f"  {c}: {bench.configs[c]}" for c in chosen)
    text += (f"\n\ntraining wall time {elapsed:.0f} s ({args.workers} workers); seconds per run: "
             + ", ".join(f"{c} {sum(runtimes[c]) / len(runtimes[c]):.0f}" for c in chosen))
    say("\n" + text)
    report.write(out, bench.name, {
        "command": command, "environment": environment(), "framework": bench.framework,
        "problem": {"chars": problem.chars, "horizon": problem.horizon, "beta": problem.beta,
                    "reward": problem.reward_kind, "sequences": problem.space.num_sequences},
        "settings": asdict(settings), "seeds": args.seeds, "workers": args.workers,
        "configurations": {c: bench.configs[c] for c in chosen}, "gradient_check": [asdict(r) for r in check_rows],
        "wall_time_s": elapsed, "runtime_s": runtimes, "summary": summary,
        "ratio": {"baseline": bench.baseline, "candidate": bench.candidate, "per_seed": ratio,
                  "target": bench.target}, "paired_comparison": comparison, "histories": histories,
        "framework_metrics": extras})
    report.plot(histories, out / f"{bench.name}.png", title)
    (out / f"{bench.name}.txt").write_text(f"$ {command}\n" + (f"{check_text}\n\n" if check_text else "") + f"{text}\n")
    say(f"\nplot: {out / bench.name}.png   table: {bench.name}.txt   every figure: {bench.name}.json   "
        f"framework logs: {bench.name}.log")
    return 0


def run_check(bench: Benchmark, problem: ToyProblem, configs: list[str]) -> list[gradient_check.CheckRow]:
    """The exact gradient check of `configs` through the framework's loss, at the seed-0 policy (one torch thread)."""
    import torch

    from .problem import completion_logprobs, enumerated_input_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, losses, scale = bench.check(problem, configs)
        with torch.no_grad():
            ref = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
        return gradient_check.check(problem, model, ref, losses, scale)
    finally:
        torch.set_num_threads(threads)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """`kl-adapters demo`'s command line: the shared arguments with the quick defaults, plus --long."""
    from .trl_runner import CONFIGS

    add_arguments(p, CONFIGS, QUICK)
    add_long_argument(p, "demo_trl")
    p.add_argument("--long-horizon", action="store_true", help="instead, the long-horizon benchmark's quick variant "
                   "(T = 128, trl-default vs sequence-plain, 2 seeds, 120 steps, a few minutes; "
                   "kl_adapters.demo.long_horizon_run.QUICK): writes long_horizon_trl_quick.* to --out; the other "
                   "options do not apply")
    p.add_argument("--task", action="store_true", help="instead, the task benchmark's quick variant (short-answer "
                   "addition from a reference trained here, beta = 0 vs TRL's default KL vs sequence, 2 seeds, a few "
                   "minutes; kl_adapters.demo.task.driver.QUICK, docs/task.md): writes task_quick.* to --out; the "
                   "other options do not apply")


def add_long_argument(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--long", action="store_true", help=f"the long benchmark: --steps {LONG.steps} --group "
                   f"{LONG.group} --lr {LONG.learning_rate} unless given, target >= {TARGET_LONG:g}x; writes "
                   f"{name}.* (without: {name}_quick.*)")


def main(args: argparse.Namespace) -> int:
    """`kl-adapters demo`: TRL's GRPOTrainer; demo_trl_quick.* by default, demo_trl.* with --long."""
    from .trl_runner import CONFIGS, check_losses, run_trl

    settings = settings_from(args, LONG if args.long else QUICK)
    bench = Benchmark(name="demo_trl" if args.long else "demo_trl_quick", framework="TRL 1.16 GRPOTrainer",
                      run=run_trl, configs=CONFIGS, baseline="trl-default", candidate="sequence", check=check_losses,
                      target=TARGET_LONG if args.long else TARGET_QUICK)
    command = " ".join(["kl-adapters demo", *(shlex.quote(a) for a in sys.argv[2:])])
    return run_benchmark(bench, args, settings, command)
