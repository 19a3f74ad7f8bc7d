"""Driver of the long-horizon benchmark (issue 22): runs (horizon, configuration, seed) one after another in this
process, one torch thread, and writes <out>/<name>.{jsonl.gz,txt,png,json,log}.

    <name>.jsonl.gz  one line per finished run (its command, settings, every evaluation row, each step's wall time, the
                  framework's own per-step metrics); a later invocation with the same --name and settings skips the
                  runs already there, so seeds and horizons can be added, and an interrupted job resumed
    <name>.txt    the commands, then per horizon the table of `long_horizon_report` (J* - J mean +- se over seeds,
                  the paired test against the best configuration, the baseline / best kl-adapters ratio per seed)
    <name>.png    J* - J against steps, one panel per horizon;  <name>.json: the summary and decisions
    <name>.log    everything the frameworks print; the terminal shows one progress line per evaluation

bench/long_horizon.py is the full benchmark (TRL, and verl's / OpenRLHF's loss code through the harness);
`kl-adapters demo --long-horizon` runs `QUICK`, its few-minute variant through TRL.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import long_horizon_report as report
from .long_horizon_harness import LongSettings, Progress
from .long_horizon_problem import LongHorizonProblem
from .output import append_run, environment, output_to, read_runs

#: (problem, configuration, settings, progress) -> {"history": [...], "step_seconds": [...], ...}
RunFn = Callable[[LongHorizonProblem, str, LongSettings, Progress], dict]
DEFAULT_OUT = "kl-adapters-demo"


@dataclass(frozen=True)
class Plan:
    name: str  # output stem
    framework: str  # for titles
    run: RunFn
    configs: dict[str, str]  # the named configurations and their descriptions (run may accept others)
    baseline: str  # the framework's default KL term
    candidates: tuple[str, ...]  # kl-adapters configurations, for the baseline / best ratio


#: `kl-adapters demo --long-horizon`: T = 128, the framework default against kl-adapters' `sequence-plain` (the preset
#: docs/long_horizon.md recommends at long completions), 2 seeds, 120 steps (a few minutes: docs/long_horizon.md)
QUICK = {"horizons": [128], "configs": ["trl-default", "sequence-plain"], "seeds": [0, 1],
         "settings": LongSettings(steps=120, group=32, learning_rate=3e-3, eval_every=40, eval_samples=256,
                                  final_samples=1024)}


def add_arguments(p: argparse.ArgumentParser, defaults: LongSettings) -> None:
    p.add_argument("--horizons", default="32,128,512", help="comma-separated T (32,128,512)")
    p.add_argument("--configs", required=True, help="comma-separated configurations")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (0,1,2)")
    p.add_argument("--steps", type=int, default=defaults.steps, help=f"optimizer steps per run ({defaults.steps})")
    p.add_argument("--group", type=int, default=defaults.group, help=f"completions per step G ({defaults.group})")
    p.add_argument("--lr", type=float, default=defaults.learning_rate,
                   help=f"Adam learning rate, decayed linearly to 0 ({defaults.learning_rate})")
    p.add_argument("--eval-every", type=int, default=defaults.eval_every,
                   help=f"evaluate every N steps ({defaults.eval_every})")
    p.add_argument("--eval-samples", type=int, default=defaults.eval_samples,
                   help=f"completions per evaluation ({defaults.eval_samples})")
    p.add_argument("--final-samples", type=int, default=defaults.final_samples,
                   help=f"completions of the final evaluation ({defaults.final_samples})")
    p.add_argument("--beta", type=float, default=LongHorizonProblem.beta, help=f"({LongHorizonProblem.beta})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder ({DEFAULT_OUT}/; committed: bench/results)")
    p.add_argument("--report", action="store_true", help="only rebuild <name>.txt/.png/.json from <name>.jsonl.gz")


def settings_from(args: argparse.Namespace) -> LongSettings:
    return LongSettings(steps=args.steps, group=args.group, learning_rate=args.lr, eval_every=args.eval_every,
                        eval_samples=args.eval_samples, final_samples=args.final_samples)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def execute(plan: Plan, args: argparse.Namespace, command: str) -> int:
    """Run every (horizon, configuration, seed) of the arguments not yet in <out>/<name>.jsonl.gz, then the report."""
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{plan.name}.jsonl.gz"
    settings = settings_from(args)
    key = {"settings": asdict(settings), "beta": args.beta}
    runs = read_runs(store)
    if any({k: r[k] for k in key} != key for r in runs):
        raise SystemExit(f"{store} holds runs with other settings than {key}: pass another --name")
    done = {(r["horizon"], r["config"], r["seed"]) for r in runs}
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    todo = [(t, c, s) for t in _ints(args.horizons) for c in configs for s in _ints(args.seeds)
            if (t, c, s) not in done]
    torch.set_num_threads(1)
    with output_to(out / f"{plan.name}.log") as say:
        if not args.report:
            say(f"{plan.framework}: {len(todo)} runs to do ({len(done)} already in {store}); {settings}; "
                f"frameworks' output -> {out / (plan.name + '.log')}")
        for k, (horizon, config, seed) in enumerate([] if args.report else todo, 1):
            problem = LongHorizonProblem(horizon=horizon, beta=args.beta, seed=seed)
            start = time.perf_counter()

            def progress(row: dict, tag=f"[{k}/{len(todo)}] T={horizon} {config} seed {seed}") -> None:
                say(f"  {tag} step {row['step']:>4}/{settings.steps}: J*-J {row['gap']:.4f} +- {row['gap_se']:.4f}"
                    f"  E[R] {row['reward']:.3f}  KL(pi||ref) {row['kl_ref']:.3f}  length {row['length']:.0f}"
                    f"  ({time.perf_counter() - start:.0f} s)")

            result = plan.run(problem, config, settings, progress)
            runs.append({"command": command, **key, "framework": plan.framework, "horizon": horizon,
                         "config": config, "seed": seed, "reference_success": problem.reference_success,
                         "j_star": problem.j_star, "wall_seconds": time.perf_counter() - start, **result})
            append_run(store, runs[-1])
        text = write_report(plan, runs, out)
        say("\n" + text + f"\n\nplot: {out / plan.name}.png   table: {plan.name}.txt   "
            f"every figure: {plan.name}.jsonl.gz")
    return 0


def write_report(plan: Plan, runs: list[dict], out: Path) -> str:
    """<name>.txt, .png and .json from the runs; returns the text."""
    if not runs:
        return "no runs"
    summary = report.summarize(runs)
    decided = report.decisions(summary, plan.baseline, list(plan.candidates))
    s = runs[0]["settings"]
    title = (f"{plan.framework} on the long-horizon problem (R = [no 'bb'], P_ref(R=1) = 0.25, beta={runs[0]['beta']},"
             f" G={s['group']}, {s['steps']} steps, lr {s['learning_rate']}; final J*-J from {s['final_samples']} "
             "samples, Rao-Blackwellized)")
    text = report.table(summary, decided, title)
    commands = list(dict.fromkeys(r["command"] for r in runs))
    (out / f"{plan.name}.txt").write_text("".join(f"$ {c}\n" for c in commands) + "\n" + text + "\n")
    (out / f"{plan.name}.json").write_text(json.dumps(
        {"commands": commands, "environment": environment(), "settings": s, "summary": summary,
         "decisions": decided}, indent=1) + "\n")
    report.plot(runs, out / f"{plan.name}.png", title)
    return text


def quick(out: str) -> int:
    """`kl-adapters demo --long-horizon`: `QUICK` through TRL's GRPOTrainer (a few minutes on 2 CPU cores)."""
    from .long_horizon_trl import CONFIGS, run_trl

    s: LongSettings = QUICK["settings"]
    args = argparse.Namespace(horizons=",".join(map(str, QUICK["horizons"])), configs=",".join(QUICK["configs"]),
                              seeds=",".join(map(str, QUICK["seeds"])), beta=LongHorizonProblem.beta, out=out,
                              report=False, **{k: v for k, v in asdict(s).items() if k != "learning_rate"},
                              lr=s.learning_rate)
    plan = Plan(name="long_horizon_trl_quick", framework="TRL 1.16 GRPOTrainer", run=run_trl, configs=CONFIGS,
                baseline="trl-default", candidates=("sequence-plain", "sequence", "full"))
    return execute(plan, args, f"kl-adapters demo --long-horizon --out {out}")
