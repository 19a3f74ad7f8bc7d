"""Driver of the task benchmark: builds (or finds) the reference, then runs (beta, lag, configuration, seed) jobs in
worker processes and writes <out>/<name>.{jsonl.gz,txt,json,png,log}.

    <name>.jsonl.gz  one line per finished run: its command, key (framework, setting, scale, RL settings, reference and
                  proxy keys), configuration, seed, evaluation rows, per-step metrics, wall time; a later invocation
                  with the same --name skips the runs already there (seeds, configurations and betas can be added,
                  an interrupted job resumed)
    <name>.txt    the commands, then per (beta, lag) the table of `report.table` (<name>.md: as markdown)
    <name>.json   the summaries and paired tests;  <name>.png: score against KL(pi || pi_ref) per configuration
    <name>.log    everything the frameworks print; the terminal shows one line per finished run

bench/task.py is its command line; `kl-adapters demo --task` runs `QUICK`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..output import append_run, environment, output_to, read_runs
from . import arithmetic, report
from .settings import SCALES, SETTINGS, RLSettings

DEFAULT_OUT = "kl-adapters-demo"


@dataclass(frozen=True)
class Prepared:
    """What every run of a setting shares: the reference (and proxy) folders, prompts, scorers."""

    setting: str
    format: str
    reference: Path
    proxy: Path | None
    train: list[arithmetic.Example]
    tests: dict[str, list[arithmetic.Example]]
    max_new_tokens: int
    reward: str  # the scorer RL optimises

    def scorers(self) -> dict:
        from .trl_run import verifier

        if self.proxy is None:
            return {"accuracy": verifier}
        from .proxy import Proxy

        return {"gold": verifier, "proxy": Proxy.load(self.proxy)}


def prepare(setting: str, scale: str, eval_prompts: int, cache: Path | None, say: Callable[[str], None]) -> Prepared:
    from . import proxy, reference

    if setting not in SETTINGS:
        raise SystemExit(f"unknown setting {setting!r}; valid: {', '.join(SETTINGS)}")
    spec = SCALES[scale]
    if setting == "long" and spec.long_reference is None:
        raise SystemExit(f"setting 'long' has no reference at scale {scale!r}: its design (protocol step 1, "
                         "bench/long_design.py) has not chosen one yet" if scale == "cpu" else
                         f"setting 'long' runs at scale 'cpu' (the protocol's reference), not {scale!r}")
    folder = reference.build(spec.long_reference if setting == "long" else spec.reference, cache, say)
    fmt = "short" if setting == "proxy" else setting
    proxy_folder = proxy.build(folder, spec.proxy, say) if setting == "proxy" else None
    splits = arithmetic.SPLITS[fmt]
    train = arithmetic.draw(splits["id"], 4096, seed=0, test=False)
    tests = {part: arithmetic.draw(split, eval_prompts, seed=0, test=True) for part, split in splits.items()}
    return Prepared(setting, fmt, folder, proxy_folder, train, tests, spec.max_new_tokens[fmt],
                    "proxy" if setting == "proxy" else "accuracy")


def _worker_init() -> None:
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # one process per core: tiny models are overhead-bound


#: (prepared, configuration, RL settings, seed) -> {"history": evaluation rows, "step_seconds": [...], "trl" or
#: "steps": per-step metrics with "grad_norm", "finite": bool}; module-level, so that worker processes can unpickle it
Runner = Callable[[Prepared, str, RLSettings, int], dict]


def run_trl(prepared: Prepared, config: str, rl: RLSettings, seed: int) -> dict:
    """TRL's GRPOTrainer.train() (`trl_run.run`)."""
    from .trl_run import run

    return run(prepared.reference, config, rl, seed, prepared.max_new_tokens, prepared.train, prepared.tests,
               prepared.scorers(), prepared.reward)


def run_job(runner: Runner, prepared: Prepared, rl: RLSettings, config: str, seed: int) -> dict:
    """One run (in a worker process). A run that raises is recorded with its traceback ("error") and counts as a
    collapse (`report.collapsed`): a failure is a result, never a missing row."""
    start = time.perf_counter()
    try:
        result = runner(prepared, config, rl, seed)
    except Exception:  # noqa: BLE001 -- recorded, reported, and counted as a collapse
        import traceback

        result = {"history": [], "error": traceback.format_exc()}
    return {**result, "wall_seconds": time.perf_counter() - start}


def key_of(framework: str, prepared: Prepared, scale: str, rl: RLSettings) -> dict:
    return {"framework": framework, "setting": prepared.setting, "scale": scale, "rl": asdict(rl),
            "reference": prepared.reference.name, "proxy": prepared.proxy.name if prepared.proxy else None}


def budget_config(runs: list[dict], key: dict, of: str) -> str:
    """The protocol's KL budget (docs/task.md): "sequence+kl_target=K", K = the mean over its seeds of `of`'s final
    in-domain KL(pi || pi_ref) in the runs with this key, to two significant digits. Refused until `of` has run."""
    values = [r["history"][-1]["id"]["kl"] for r in runs if r["key"] == key and r["config"] == of and r.get("history")]
    if not values:
        raise SystemExit(f"configuration 'budget' needs the runs of {of!r} with the same settings first (its mean "
                         "final KL is the target): run them, then the budget")
    return f"sequence+kl_target={float(f'{sum(values) / len(values):.2g}')!r}"


def execute(args: argparse.Namespace, command: str, runners: dict[str, Runner] | None = None) -> int:
    """Every (beta, lag, configuration, seed) of the arguments not yet in <out>/<name>.jsonl.gz, then the report.
    `runners`: framework name -> Runner (default: TRL only)."""
    runners = runners or {"trl": run_trl}
    if args.framework not in runners:
        raise SystemExit(f"unknown framework {args.framework!r}; valid: {', '.join(runners)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{args.name}.jsonl.gz"
    runs = read_runs(store)
    base = SCALES[args.scale].rl
    given = {"steps": args.steps, "learning_rate": args.lr, "prompts_per_step": args.prompts,
             "eval_prompts": args.eval_prompts}
    base = replace(base, **{k: v for k, v in given.items() if v is not None})
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.report:  # the tables and plot from the store alone: no reference, no log
        print(write_report(runs, out, args.name))
        return 0
    with output_to(out / f"{args.name}.log") as say:
        prepared = prepare(args.setting, args.scale, base.eval_prompts, args.cache, say)
        done = {(json.dumps(r["key"], sort_keys=True), r["config"], r["seed"]) for r in runs}
        todo = []
        for beta in _floats(args.beta):
            for lag in _ints(args.lag):
                rl = replace(base, beta=beta, lag=lag)
                key = key_of(args.framework, prepared, args.scale, rl)
                resolved = [budget_config(runs, key, args.budget_of) if c == "budget" else c for c in configs]
                todo += [(key, rl, c, s) for c in resolved for s in _ints(args.seeds)
                         if (json.dumps(key, sort_keys=True), c, s) not in done]
        say(f"{args.framework}, setting {args.setting}: {len(todo)} runs to do ({len(runs)} in {store}); "
            f"frameworks' output -> {out / (args.name + '.log')}")
        _run_all(args, runners[args.framework], prepared, todo, runs, store, command, say)
        text = write_report(runs, out, args.name)
        say("\n" + text + f"\n\ntable: {out / args.name}.txt   plot: {args.name}.png   "
            f"every figure: {args.name}.jsonl.gz")
    return 0


def _run_all(args, runner: Runner, prepared: Prepared, todo: list, runs: list, store: Path, command: str,
             say) -> None:
    start, env = time.perf_counter(), environment()
    pool = None if args.workers == 0 else ProcessPoolExecutor(
        args.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
    with pool or contextlib.nullcontext():
        if pool is None:
            _worker_init()
            results = ((job, run_job(runner, prepared, job[1], job[2], job[3])) for job in todo)
        else:
            futures = [(job, pool.submit(run_job, runner, prepared, job[1], job[2], job[3])) for job in todo]
            results = ((job, future.result()) for job, future in futures)
        for k, ((key, rl, config, seed), result) in enumerate(results, 1):
            runs.append({"command": command, "environment": env, "key": key, "config": config, "seed": seed,
                         **result})
            append_run(store, runs[-1])
            tag = f"  [{k}/{len(todo)}] beta {rl.beta:g} lag {rl.lag} {config:<28} seed {seed}:"
            if "error" in result:
                say(f"{tag} FAILED ({result['error'].strip().splitlines()[-1]}; traceback in {store})")
                continue
            first, last = result["history"][0]["id"], result["history"][-1]["id"]
            score = report.score_name(runs[-1])
            say(f"{tag} in-domain {score} {100 * first[score]:.1f} -> {100 * last[score]:.1f} %, KL {last['kl']:.2f}"
                f"  ({result['wall_seconds']:.0f} s; {time.perf_counter() - start:.0f} s so far)")


def write_report(runs: list[dict], out: Path, name: str) -> str:
    """<name>.txt / .json / .png from the runs; returns the text."""
    if not runs:
        return "no runs"
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(json.dumps(r["key"], sort_keys=True), []).append(r)
    texts, markdowns, summaries, points = [], [], [], {}
    for key_text, group in groups.items():
        key = json.loads(key_text)
        rl = key["rl"]
        score = report.score_name(group[0])
        summary = report.summarize(group)
        title = (f"{key['framework']}, setting {key['setting']} (scale {key['scale']}): beta {rl['beta']:g}, lag "
                 f"{rl['lag']}, {rl['steps']} steps x {rl['prompts_per_step']} prompts x G={rl['group']}, lr "
                 f"{rl['learning_rate']:g}; final evaluation on {rl['eval_prompts']} held-out prompts per split")
        texts.append(report.table(summary, title, "gold reward" if score == "gold" else score))
        markdowns.append(f"**{title}**\n\n" + report.markdown(summary, "gold reward" if score == "gold" else score))
        summaries.append({"key": key, "summary": summary,
                          "versus_best": {m: report.versus_best(summary, m) for m in ("id", "ood")
                                          if all(m in r for r in summary.values())}})
        if rl["lag"] == 1:  # the frontier: on-policy runs across betas
            for config, row in summary.items():
                family = "budget (sequence + kl_target)" if "+kl_target=" in config else config
                points.setdefault(family, []).append({"beta": rl["beta"], "kl": row["kl"], "id": row["id"],
                                                      "ood": row.get("ood")})
    by_lag: dict[tuple, dict[int, dict]] = {}
    for entry in summaries:
        rl = entry["key"]["rl"]
        by_lag.setdefault((rl["beta"], json.dumps({**entry["key"], "rl": {**rl, "lag": 0}}, sort_keys=True)),
                          {})[rl["lag"]] = entry["summary"]
    for (beta, _), lags in by_lag.items():
        if len(lags) > 1:
            texts.append(report.lag_table(lags, f"asynchronous lag at beta {beta:g}: steps_per_generation = lag "
                                                "(rollouts 0 .. lag - 1 optimizer steps stale)"))
    commands = list(dict.fromkeys(r["command"] for r in runs))
    text = "\n\n".join(texts)
    (out / f"{name}.txt").write_text("".join(f"$ {c}\n" for c in commands) + "\n" + text + "\n")
    (out / f"{name}.md").write_text("\n\n".join(markdowns) + "\n")
    # the runs' environments (each run records the one it ran in) and the report's own (the process writing these files)
    run_environments = list({json.dumps(r["environment"], sort_keys=True): r["environment"]
                             for r in runs if "environment" in r}.values())
    (out / f"{name}.json").write_text(json.dumps({"commands": commands, "run_environments": run_environments,
                                                  "report_environment": environment(), "groups": summaries},
                                                 indent=1) + "\n")
    report.plot_frontier(points, out / f"{name}.png", f"{name}: final score against KL(pi || pi_ref), "
                         "mean +- se over seeds, one point per beta")
    return text


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setting", choices=SETTINGS, required=True,
                   help="short: short answers; scratch: answers after a worked scratchpad; proxy: RL on a learned "
                   "proxy reward, gold = the verifier")
    p.add_argument("--configs", required=True, help="comma-separated configurations (trl-default, k3-loss, token, "
                   "sequence, sequence-plain, full, beta=0, any preset, '+field=value' options; budget: sequence with "
                   "kl_target = the mean final KL of --budget-of's runs)")
    p.add_argument("--budget-of", default="trl-default", help="the configuration whose KL the budget matches "
                   "(trl-default)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (0,1,2,3,4)")
    p.add_argument("--beta", default=str(RLSettings.beta), help=f"KL coefficient(s), comma-separated ({RLSettings.beta})")
    p.add_argument("--lag", default="1", help="optimizer steps per generation, comma-separated (1: on-policy)")
    p.add_argument("--scale", choices=SCALES, default="cpu", help="model, prompts and steps (cpu)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (the scale's)")
    p.add_argument("--lr", type=float, help="learning rate (the scale's)")
    p.add_argument("--prompts", type=int, help="prompts per optimizer step (the scale's)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per split and evaluation (the scale's)")
    p.add_argument("--framework", default="trl", help="trl (GRPOTrainer.train()); bench/task.py adds verl and "
                   "openrlhf (their loss code through kl_adapters.demo.task.harness)")
    p.add_argument("--workers", type=int, default=2, help="parallel processes, one torch thread each (2; 0: here)")
    p.add_argument("--cache", type=Path, help="where the reference is cached (reference.default_cache())")
    p.add_argument("--name", help="output stem (task_<setting>_<framework>)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder ({DEFAULT_OUT}/; committed: bench/results)")
    p.add_argument("--report", action="store_true", help="only rebuild <name>.txt/.json/.png from <name>.jsonl.gz (no "
                   "reference, no run, the log untouched)")


#: `kl-adapters demo --task`: short-answer addition from the "quick" scale's reference (trained here on the short
#: splits only), the framework's default KL against kl-adapters' sequence and no KL, 2 seeds (docs/task.md)
QUICK = {"setting": "short", "scale": "quick", "configs": "beta=0,trl-default,sequence", "seeds": "0,1"}


def quick(out: str) -> int:
    """`kl-adapters demo --task`: `QUICK` through TRL's GRPOTrainer (a few minutes on 2 CPU cores)."""
    args = argparse.Namespace(**QUICK, beta=str(RLSettings.beta), lag="1", steps=None, lr=None, prompts=None,
                              budget_of="trl-default",
                              eval_prompts=None, framework="trl", workers=2, cache=None, name="task_quick", out=out,
                              report=False)
    code = execute(args, f"kl-adapters demo --task --out {out}")
    print("\nThe quick variant (a reference trained on short answers only, 100 steps, 2 seeds) shows the pipeline, not "
          "the evidence:\nthe benchmark's results (3 settings, 5 seeds, TRL, verl, OpenRLHF) and their commands are in "
          "docs/task.md.")
    return code
