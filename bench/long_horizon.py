"""The long-horizon benchmark (issue 22): which KL configuration ends closest to pi* at T = 32 ... 1024?

The problem (`kl_adapters.demo.long_horizon_problem`): a tiny GPT-2 whose reference is a position-dependent Markov
chain over {EOS, a, b}, the reward R = 1 if the completion never holds "bb" (P_ref(R = 1) = 0.25 at every T), beta 0.2;
pi*, J* and log Z by dynamic programming, KL(pi || pi*) = (J* - J) / beta of the trained policy estimated from N
completions with exact per-position KLs. Every run writes its evaluations to <out>/<name>.jsonl.gz as it finishes (a
re-run with the same --name and settings skips what is there); the driver is `kl_adapters.demo.long_horizon_run`.

Usage (one process, one thread; long runs: nohup nice -n 10 ... &):
  .venvs/trl/bin/python bench/long_horizon.py --configs trl-default,token,k3-loss,sequence-plain,beta=0 \\
      [--horizons 32,128,512] [--seeds 0,1,2] [--steps 400] [--group 32] [--lr 3e-3] --out bench/results
        TRL 1.16's real GRPOTrainer.train() (kl_adapters.demo.long_horizon_trl: configuration names, or any preset,
        with "+field=value" KLGRPOConfig options, e.g. sequence+kl_is_clip=2.0)  -> long_horizon_trl.*
  .venvs/verl/bin/python bench/long_horizon.py --framework verl --horizons 512 \\
      --configs verl-default,kl_adapters:sequence-plain,beta=0 --out bench/results
        verl 0.9.1's real ppo_loss (bench/demo_verl.py's VerlLoss) on groups the harness samples -> long_horizon_verl.*
  .venvs/openrlhf/bin/python bench/long_horizon.py --framework openrlhf --horizons 512 \\
      --configs openrlhf-default-k3,kl_adapters:sequence-plain,beta=0 --out bench/results
        OpenRLHF 0.11.2's real ActorPPOTrainer.training_step (bench/demo_openrlhf.py) -> long_horizon_openrlhf.*
  .venvs/trl/bin/python bench/long_horizon.py --variance --configs trl-default,token,k3-loss,sequence-plain,beta=0 \\
      --horizons 32,128,512 --out bench/results
        the variance of the gradient TRL's compute_loss takes (task + KL) at the training G, over --batches groups,
        at policies along a `--variance-policy` training run (seed 0), at --variance-steps -> long_horizon_variance.*
`kl-adapters demo --long-horizon` (= `bash scripts/demo.sh trl --long-horizon`) is the few-minute variant.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

from kl_adapters.demo.long_horizon_harness import LongSettings, train  # noqa: E402
from kl_adapters.demo.long_horizon_problem import LongHorizonProblem  # noqa: E402
from kl_adapters.demo.long_horizon_run import Plan, add_arguments, execute, settings_from  # noqa: E402

DEFAULTS = LongSettings(steps=400, group=32, learning_rate=3e-3, eval_every=50, eval_samples=256, final_samples=2048)


def run_verl(problem, config, settings, progress):
    """verl's ppo_loss under one configuration (bench/demo_verl.py), on groups `long_horizon_harness.train` samples."""
    import demo_verl

    loss = demo_verl.VerlLoss(problem, config, settings.group)
    return {**train(problem, loss, settings, progress), "verl": loss.metrics}


def run_openrlhf(problem, config, settings, progress):
    """OpenRLHF's ActorPPOTrainer.training_step under one configuration (bench/demo_openrlhf.py), on groups
    `long_horizon_harness.train` samples; kl-adapters' per-process activation is reset around the run."""
    import demo_openrlhf

    import kl_adapters

    kl_adapters.disable()
    try:
        loss = demo_openrlhf.OpenRLHFLoss(problem, config, settings.group)
        return {**train(problem, loss, settings, progress), "openrlhf": loss.metrics}
    finally:
        kl_adapters.disable()


def plan_for(framework: str) -> Plan:
    if framework == "trl":
        from kl_adapters.demo.long_horizon_trl import CONFIGS, run_trl

        return Plan("long_horizon_trl", "TRL 1.16 GRPOTrainer.train()", run_trl, CONFIGS, "trl-default",
                    ("sequence-plain", "sequence", "full"))
    if framework == "verl":
        import demo_verl

        return Plan("long_horizon_verl", demo_verl.FRAMEWORK, run_verl, demo_verl.CONFIGS, demo_verl.BASELINE,
                    ("kl_adapters:sequence-plain", "kl_adapters:sequence", "kl_adapters:reward (reward path)"))
    import demo_openrlhf

    return Plan("long_horizon_openrlhf", demo_openrlhf.FRAMEWORK, run_openrlhf, demo_openrlhf.CONFIGS,
                demo_openrlhf.BASELINE, ("kl_adapters:sequence-plain", "kl_adapters:sequence"))


def variance(args: argparse.Namespace, command: str) -> int:
    """Gradient variance of each configuration at policies along a training run (module docstring)."""
    import torch

    from kl_adapters.demo.output import output_to
    from kl_adapters.demo.long_horizon_trl import gradient_variance, run_trl

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or "long_horizon_variance"
    settings = settings_from(args)
    wanted = {int(s) for s in args.variance_steps.split(",")}
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    rows = []
    torch.set_num_threads(1)
    with output_to(out / f"{name}.log") as say:
        for horizon in [int(t) for t in args.horizons.split(",")]:
            problem = LongHorizonProblem(horizon=horizon, beta=args.beta, seed=0)

            def measure(step, model, problem=problem):
                if step in wanted:
                    start = time.perf_counter()
                    stats = gradient_variance(problem, model, configs, settings.group, args.batches, seed=step)
                    rows.append({"horizon": horizon, "step": step, "policy": args.variance_policy, **{
                        "gap": history[-1]["gap"] if history else None}, "configs": stats})
                    say(f"  T={horizon} step {step}: {len(configs)} configurations x {args.batches} groups "
                        f"({time.perf_counter() - start:.0f} s)")

            history: list[dict] = []
            run_trl(problem, args.variance_policy, settings, history.append, measure)
        text = variance_table(rows, configs, args, command)
        (out / f"{name}.txt").write_text(f"$ {command}\n\n{text}\n")
        (out / f"{name}.json").write_text(json.dumps({"command": command, "settings": vars(args) | {
            "steps": settings.steps}, "rows": rows}, indent=1) + "\n")
        say("\n" + text)
    return 0


def variance_table(rows: list[dict], configs: list[str], args, command: str) -> str:
    """tr Cov of the training gradient per configuration (+- jackknife se), and relative to the first configuration."""
    base = configs[0]
    lines = [f"Variance of TRL's training gradient (task + KL, compute_loss, G = {args.group}), {args.batches} groups "
             f"per policy, policies along a {args.variance_policy} run (seed 0); ratio = tr Cov / tr Cov({base})",
             f"{'T':>5}{'step':>6}{'J*-J':>8}  {'configuration':<18}{'tr Cov':>12}{'+- se':>10}{'ratio':>8}"
             f"{'|mean g|':>10}"]
    for row in rows:
        for config in configs:
            s = row["configs"][config]
            ratio = s["trace"] / row["configs"][base]["trace"]
            lines.append(f"{row['horizon']:>5}{row['step']:>6}{row['gap']:>8.4f}  {config:<18}{s['trace']:>12.4g}"
                         f"{s['trace_se']:>10.2g}{ratio:>8.3f}{s['mean_norm']:>10.4g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, DEFAULTS)
    parser.add_argument("--framework", choices=("trl", "verl", "openrlhf"), default="trl")
    parser.add_argument("--name", help="output stem (long_horizon_<framework>, --variance: long_horizon_variance)")
    parser.add_argument("--variance", action="store_true", help="measure the gradient variance (module docstring)")
    parser.add_argument("--variance-policy", default="sequence-plain", help="the run whose policies are measured")
    parser.add_argument("--variance-steps", default="50,400", help="steps of that run to measure at (multiples of "
                        "--eval-every, or the last)")
    parser.add_argument("--batches", type=int, default=32, help="--variance: groups per policy (32)")
    args = parser.parse_args(argv)
    command = " ".join(shlex.quote(str(a)) for a in [
        Path(sys.executable).relative_to(ROOT) if Path(sys.executable).is_relative_to(ROOT) else sys.executable,
        Path(__file__).resolve().relative_to(ROOT), *(sys.argv[1:] if argv is None else argv)])
    if args.variance:
        return variance(args, command)
    plan = plan_for(args.framework)
    if args.name:
        plan = Plan(args.name, plan.framework, plan.run, plan.configs, plan.baseline, plan.candidates)
    return execute(plan, args, command)


if __name__ == "__main__":
    raise SystemExit(main())
