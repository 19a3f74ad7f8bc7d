"""The task benchmark (issue 35): does the exact KL gradient help a model learn a task, in domain and out of domain,
against a proxy reward, and under asynchronous lag? Protocol, results and the commands that made them: docs/task.md.

Usage (one line per finished run on the terminal, the frameworks' output in <out>/<name>.log):
  .venvs/trl/bin/python bench/task.py --setting short --configs beta=0,trl-default,sequence --seeds 0,1,2,3,4 \\
      [--beta 0.05[,0.2,...]] [--lag 1[,4,16]] [--scale cpu|gpu|smoke] [--workers 2] --out bench/results
        TRL's real GRPOTrainer.train() from the cached reference (kl_adapters.demo.task)  -> <out>/task_short_trl.*
  .venvs/verl/bin/python bench/task.py --framework verl --setting short \\
      --configs beta=0,verl-default,k3+,kl_adapters:sequence ...
        verl 0.9.1's real ppo_loss (bench/task_verl.py) on rounds the task harness samples -> <out>/task_short_verl.*
  .venvs/openrlhf/bin/python bench/task.py --framework openrlhf --setting short \\
      --configs beta=0,openrlhf-default-k3,unbiased_gradient,kl_adapters:sequence ...
        OpenRLHF 0.11.2's real training_step (bench/task_openrlhf.py)                  -> <out>/task_short_openrlhf.*
  (verl and OpenRLHF: kl_adapters.demo.task.harness; beta means TRL's in every framework: docs/task.md)
The reference (and the proxy reward model of --setting proxy) is trained on first use and cached
(kl_adapters.demo.task.reference.default_cache(), or --cache).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

from kl_adapters.demo.task.driver import add_arguments, execute, run_trl  # noqa: E402


def run_verl(prepared, config: str, rl, seed: int) -> dict:
    """driver.Runner of --framework verl (bench/task_verl.py, imported in the worker: verl's environment only)."""
    import task_verl

    return task_verl.run(prepared, config, rl, seed)


def run_openrlhf(prepared, config: str, rl, seed: int) -> dict:
    """driver.Runner of --framework openrlhf (bench/task_openrlhf.py, imported in the worker: it puts OpenRLHF's CPU
    import stubs on sys.path, which only OpenRLHF's environment may see)."""
    import task_openrlhf

    return task_openrlhf.run(prepared, config, rl, seed)


RUNNERS = {"trl": run_trl, "verl": run_verl, "openrlhf": run_openrlhf}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.name = args.name or f"task_{args.setting}_{args.framework}"
    given = sys.argv[1:] if argv is None else argv
    return execute(args, " ".join(["python bench/task.py", *map(shlex.quote, given)]), RUNNERS)


if __name__ == "__main__":
    raise SystemExit(main())
