"""Command line of bench/demo_verl.py and bench/demo_openrlhf.py (the exact-objective benchmark, issue 6).

Each framework script supplies `run(problem, config, seed, settings) -> (history, framework_metrics)`, which calls
`kl_adapters.demo.harness.train` with a loss function built on that framework's real loss code. Everything else --
arguments, worker processes, table, plot, JSON (with every per-step figure and the per-seed ratio
KL(pi||pi*)[framework default] / KL(pi||pi*)[kl_adapters:sequence]) -- is `kl_adapters.demo.run`'s, shared with
`kl-adapters demo`, and so are the defaults: the quick run (`run.QUICK`, <name>_quick.*), `--long` for `run.LONG`
(<name>.*). `check(problem, configs)` supplies the exact gradient check through the same loss code.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kl_adapters.demo.run import (LONG, QUICK, TARGET_LONG, TARGET_QUICK, Benchmark, CheckFn, RunFn, add_arguments,
                                  add_long_argument, run_benchmark, settings_from)

ROOT = Path(__file__).resolve().parent.parent
CANDIDATE = "kl_adapters:sequence"


def main(*, name: str, framework: str, run: RunFn, configs: dict[str, str], baseline: str, notes: str,
         check: CheckFn | None = None, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=notes, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, configs, QUICK)
    add_long_argument(parser, name)
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (the plot needs it: fail before the runs, not after)
    except ImportError:
        raise SystemExit(f"matplotlib is missing in {sys.prefix}: pip install matplotlib") from None
    interpreter, script = Path(sys.executable), Path(sys.argv[0]).resolve()
    shown = [p.relative_to(ROOT) if p.is_relative_to(ROOT) else p for p in (interpreter, script)]
    command = " ".join(shlex.quote(str(a)) for a in [*shown, *(sys.argv[1:] if argv is None else argv)])
    settings = settings_from(args, LONG if args.long else QUICK)
    bench = Benchmark(name=name if args.long else f"{name}_quick", framework=framework, run=run, configs=configs,
                      baseline=baseline, candidate=CANDIDATE, check=check,
                      target=TARGET_LONG if args.long else TARGET_QUICK)
    return run_benchmark(bench, args, settings, command)
