"""`kl-adapters measure` on the task benchmark's policies (issue 44): how far the KL gradient of TRL's default and of
the `k3` loss is from the exact one on the policies RL actually reached, against completion length and beta, and
whether a larger measured bias goes with the larger score gaps docs/task.md reports.

For each setting (short answers, scratchpads, the proxy reward) and each configuration trained: the policy after
--steps GRPO steps through TRL's real GRPOTrainer.train() from the task reference (the protocol of docs/task.md: its
RL settings, seed --seed, the setting's beta), saved under --work; then the command a user runs,

    kl-adapters measure --policy <trained> --reference <task reference> --prompts <256 in-domain test prompts>
        -G 8 --max-new-tokens <the setting's> --reward <the reward RL optimised> --beta <the setting's>,0.2,... --json

in this Python (a subprocess, timed). The cost target: the same command on the reference policy itself (--policy =
--reference; every KL gradient is then zero, so only its time is read), 256 prompts x G = 8, <= 2 minutes on 2 cores.

Usage: .venvs/trl/bin/python bench/measure_task.py [--settings short,scratch,proxy] [--configs trl-default,k3-loss]
           [--steps 150] [--seed 0] [--prompts 256] [--work ~/.cache/kl-adapters/measure-task] [--out bench/results]
Writes <out>/measure_task.{txt,json} (every measurement's JSON document, the table) and <out>/measure_task_cost.txt.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

from kl_adapters.demo.output import environment, output_to  # noqa: E402
from kl_adapters.demo.task.driver import prepare  # noqa: E402
from kl_adapters.demo.task.settings import SCALES  # noqa: E402

#: each setting's beta in the task protocol (docs/task.md), first in the --beta list (long: the beta of the
#: confirmatory protocol's design policies, step 3)
BETA = {"short": 0.05, "scratch": 0.05, "proxy": 0.5, "long": 0.05}
#: the further betas measured from the same samples (the frontier's; long: the rest of step 3's list)
MORE_BETAS = {"short": (0.2, 0.5), "scratch": (0.2, 0.5), "proxy": (0.2, 1.0),
              "long": (0.01, 0.02, 0.1, 0.2, 0.5, 1.0)}
REWARD_MODULE = '''"""Reward functions of TRL's signature for kl-adapters measure on the task (written by bench/measure_task.py)."""
from kl_adapters.demo.task import arithmetic


def verifier(prompts, completions, completion_ids, answer, **kwargs):
    return [arithmetic.reward(c, a) for c, a in zip(completions, answer)]


_PROXY = {}


def proxy(prompts, completions, completion_ids, answer, **kwargs):
    from kl_adapters.demo.task.proxy import Proxy

    if "model" not in _PROXY:
        _PROXY["model"] = Proxy.load(%r)
    return _PROXY["model"](completions, [arithmetic.Example(p, a) for p, a in zip(prompts, answer)])
'''


def train(prepared, config: str, steps: int, seed: int, folder: Path, say) -> Path:
    """The policy after `steps` GRPO steps of `config` (cached in `folder`)."""
    if (folder / "config.json").exists():
        return folder
    from dataclasses import replace

    from kl_adapters.demo.task.reference import tokenizer
    from kl_adapters.demo.task.trl_run import as_trl_reward, make_trainer

    rl = replace(SCALES["cpu"].rl, steps=steps, beta=BETA[prepared.setting])
    reward = as_trl_reward(prepared.scorers()[prepared.reward], prepared.reward)
    start = time.perf_counter()
    trainer = make_trainer(prepared.reference, config, rl, seed, prepared.max_new_tokens, prepared.train, [reward])
    trainer.train()
    trainer.save_model(str(folder))
    tokenizer().save_pretrained(folder)
    say(f"  trained {config} on {prepared.setting} for {steps} steps in {time.perf_counter() - start:.0f} s")
    return folder


def measure_inputs(prepared, work: Path, prompts: int) -> Path:
    """Write the reward module and the setting's first `prompts` in-domain test prompts into `work`; the prompts'
    file (the command's --prompts)."""
    (work / "task_reward.py").write_text(REWARD_MODULE % str(prepared.proxy))
    path = work / f"{prepared.setting}_id.jsonl"
    path.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n"
                            for e in prepared.tests["id"][:prompts]))
    return path


def measure(policy: Path, prepared, prompts: Path, reward: str, work: Path, group: int) -> tuple[dict, float, str]:
    """The measure command's JSON document, its wall time and the command."""
    betas = ",".join(f"{b:g}" for b in (BETA[prepared.setting], *MORE_BETAS[prepared.setting]))
    argv = ["--policy", str(policy), "--reference", str(prepared.reference), "--prompts", str(prompts), "-G",
            str(group), "--max-new-tokens", str(prepared.max_new_tokens), "--reward", f"{work / 'task_reward.py'}:"
            f"{reward}", "--beta", betas, "--config", "trl-default", "--config", "k3-loss", "--json"]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kl_adapters.cli", "measure", *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"kl-adapters measure failed: {out.stderr.strip()}")
    return json.loads(out.stdout), seconds, shlex.join(["kl-adapters", "measure", *argv])


def _pct(interval: dict | None) -> str:
    if interval is None or interval["estimate"] is None:
        return "-"
    low, high = interval["low"], interval["high"]
    inf = "inf"
    return (f"{100 * interval['estimate']:.1f}% [{100 * max(low, 0):.1f}, {100 * high:.1f}]"
            if low is not None and high != inf else f"{100 * interval['estimate']:.1f}%")


def _steps(interval: dict | None) -> str:
    if interval is None:
        return "-"
    def f(v):
        return "never" if v in (None, "inf") else f"{v:,.0f}"
    return f"{f(interval['estimate'])} [{f(interval['low'])}, {f(interval['high'])}]"


def table(results: list[dict]) -> list[str]:
    head = (f"{'setting':<9}{'trained':<13}{'length':>7}  {'judged':<12}{'beta':>5}  {'bias vs exact KL grad':<24}"
            f"{'beta bias / trained grad':<26}{'/ one step noise':<22}{'steps until bias > noise'}")
    lines = [head, "-" * len(head)]
    for r in results:
        doc = r["document"]
        length = doc["context"]["mean_length"]
        for m in [doc["measurement"], *doc["other_betas"]]:
            for row in m["rows"]:
                if row["judged"]:
                    lines.append(f"{r['setting']:<9}{r['config']:<13}{length:>7.1f}  {row['name']:<12}"
                                 f"{m['beta']:>5g}  {_pct(row['bias']):<24}{_pct(row['trained']):<26}"
                                 f"{_pct(row['noise']):<22}{_steps(row['horizon'])}")
    return lines


def run_all(args: argparse.Namespace, say) -> tuple[list[dict], list[str]]:
    """Train (or find) each policy and measure it; the results and the cost lines."""
    results, cost = [], []
    for setting in args.settings.split(","):
        prepared = prepare(setting, "cpu", args.prompts, None, say)
        prompts = measure_inputs(prepared, args.work, args.prompts)
        reward = "proxy" if setting == "proxy" else "verifier"
        if not cost:  # the cost target: the reference policy itself
            doc, seconds, cmd = measure(prepared.reference, prepared, prompts, reward, args.work, args.group)
            cost.append(f"{cmd}\n  {seconds:.1f} s wall (the reference policy; {doc['context']['completions']} "
                        f"completions, mean length {doc['context']['mean_length']:.1f}, "
                        f"{doc['context']['parameters']:,} parameters)")
            say(cost[-1])
        for config in args.configs.split(","):
            policy = train(prepared, config, args.steps, args.seed,
                           args.work / f"{setting}_{config}_s{args.seed}_{args.steps}", say)
            doc, seconds, cmd = measure(policy, prepared, prompts, reward, args.work, args.group)
            results.append({"setting": setting, "config": config, "steps": args.steps, "seed": args.seed,
                            "seconds": seconds, "command": cmd, "document": doc})
            cost.append(f"{cmd}\n  {seconds:.1f} s wall (trained {config}, {setting})")
            say(f"  measured in {seconds:.0f} s:\n" + "\n".join(table(results[-1:])[2:]))
    return results, cost


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="short,scratch,proxy")
    p.add_argument("--configs", default="trl-default,k3-loss")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("-G", "--group", type=int, default=8)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "kl-adapters" / "measure-task")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    command = "python bench/measure_task.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with output_to(args.out / "measure_task.log") as say:
        results, cost = run_all(args, say)
    env = environment()
    (args.out / "measure_task.json").write_text(json.dumps({"command": command, "environment": env,
                                                             "results": results}, indent=1) + "\n")
    (args.out / "measure_task.txt").write_text("\n".join(
        [f"# {command}", f"# {json.dumps(env)}", "# each row: kl-adapters measure on the policy after "
         f"{args.steps} GRPO steps (seed {args.seed}) of `trained`, its in-domain test prompts, G = {args.group}; "
         "95% intervals", *table(results), ""]))
    (args.out / "measure_task_cost.txt").write_text("\n".join(
        [f"# {command}", f"# {json.dumps(env)}", *cost, ""]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
