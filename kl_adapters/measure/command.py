"""`kl-adapters measure`: arguments, the checks made before any sampling, the run, the output.

Every bad input ends the command with one line and exit 2 before a completion is sampled: folders and tokenizers
(`models.check_models`), prompts (`models.load_prompts`, `prompt_ids`), the reward function, the configurations
(`plan.configuration`, or the doctor's reading of a launch configuration), the numbers (G >= 2, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from .plan import PlanError

#: the default measured-parameter count above which the gradient is count-sketched (`--sketch auto`)
EXACT_UP_TO = 1 << 17
#: the sketch's size under `--sketch auto`
AUTO_SKETCH = 1 << 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    i = p.add_argument_group("models and prompts")
    i.add_argument("--policy", required=True, help="the policy: a transformers checkpoint folder or a PEFT adapter")
    i.add_argument("--base", help="the base model of an adapter policy (default: the adapter's base_model_name_or_path)")
    i.add_argument("--reference", help="pi_ref's checkpoint folder (default for an adapter: its base, the adapter off)")
    i.add_argument("--behaviour", help="sample from this checkpoint instead of the policy (off-policy: a stale "
                                       "policy, as after several optimizer steps on one rollout)")
    i.add_argument("--prompts", required=True, help="JSONL ({\"prompt\": ...} per line), text (one per line), JSON, "
                                                     "a saved datasets folder, parquet or CSV")
    i.add_argument("--num-prompts", type=int, default=256, help="use the first N prompts (default 256)")
    s = p.add_argument_group("sampling (as the trainer samples)")
    s.add_argument("-G", "--group-size", type=int, default=8, help="completions per prompt (default 8)")
    s.add_argument("--max-new-tokens", type=int, default=256, help="(default 256)")
    s.add_argument("--temperature", type=float, default=1.0, help="(default 1.0; pi = softmax(logits / T))")
    s.add_argument("--seed", type=int, default=0)
    k = p.add_argument_group("the KL configuration judged")
    k.add_argument("--config", action="append", metavar="NAME",
                   help="a native configuration (trl-default, trl-k3-loss, trl-rloo, verl-default, verl:<kl_loss_type>, "
                        "verl-reward:<kl_penalty>, openrlhf-default-k3, openrlhf:<estimator>, "
                        "openrlhf:unbiased_gradient, openrlhf-reward:<estimator>) or a preset; repeatable "
                        "(default trl-default). Every preset is measured beside it.")
    k.add_argument("--beta", help="the KL coefficient as the framework states it (per token, relative to the task "
                                   "loss; default: the launch configuration's, else 1 when there is no reward); a "
                                   "list like 0.05,0.2,0.5 also reports the judged configurations at the others "
                                   "(from the same samples; `sequence` stays fitted at the first)")
    k.add_argument("--reward", metavar="MODULE:FUNCTION", help="a TRL reward function (module:function or "
                                                                "file.py:function): adds the task gradient")
    k.add_argument("--scale-rewards", choices=("group", "none"), default="group",
                   help="GRPO advantages divided by the group's std (default, TRL's and verl's) or not")
    k.add_argument("--step-batch", type=int, default=64, help="completions per optimizer step (default 64)")
    g = p.add_argument_group("the measurement")
    g.add_argument("--params", default="trainable",
                   help="measured parameters: trainable (default: every weight; an adapter's LoRA weights) or last:N")
    g.add_argument("--sketch", default="auto", help=f"auto (exact up to {EXACT_UP_TO:,} parameters, else a count "
                                                     f"sketch of {AUTO_SKETCH:,}), 0 (exact), or a size")
    g.add_argument("--folds", type=int, default=16, help="independent folds of prompt groups (default 16)")
    g.add_argument("--length-bins", default="4", help="N quantile bins of completion length, or edges like 32,64,128")
    g.add_argument("--confidence", type=float, default=0.95)
    g.add_argument("--micro-batch", type=int, default=64, help="sequences per forward (default 64)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="the JSON document on stdout (kl_adapters.measure.report)")
    o.add_argument("--plot", metavar="FILE.png", help="bias per configuration and by completion length")
    o.add_argument("--launch", nargs=argparse.REMAINDER, metavar="FRAMEWORK ARGS",
                   help="last: judge the KL configuration of a launch, read as `kl-adapters doctor FRAMEWORK ARGS` "
                        "reads it (trl, verl or openrlhf arguments, a config file or a launch script)")


class Refusal(Exception):
    """One line for the user; exit 2."""


def _numbers(args: argparse.Namespace) -> None:
    checks = (
        (args.group_size >= 2, f"-G must be >= 2 (a prompt's completions share a baseline), got {args.group_size}"),
        (args.num_prompts >= 3, f"--num-prompts must be >= 3 (prompt groups are the independent units), got "
                                f"{args.num_prompts}"),
        (args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.temperature > 0, f"--temperature must be > 0, got {args.temperature}"),
        (args.folds >= 3, f"--folds must be >= 3 (the jackknife), got {args.folds}"),
        (0 < args.confidence < 1, f"--confidence must be in (0, 1), got {args.confidence}"),
        (args.micro_batch >= 1, f"--micro-batch must be >= 1, got {args.micro_batch}"),
        (args.step_batch >= args.group_size, f"--step-batch ({args.step_batch}) must hold at least one group "
                                             f"(-G {args.group_size})"),
    )
    for ok, message in checks:
        if not ok:
            raise Refusal(message)


def _betas(text: str | None) -> tuple[float, ...]:
    if text is None:
        return ()
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(v > 0 for v in values):
        raise Refusal(f"--beta must be a number > 0 or a list of them like 0.05,0.2, got {text!r}")
    return values


def _bins(text: str) -> int | tuple[int, ...]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if len(values) == 1 and "," not in text and values[0] >= 1:
        return values[0]
    if len(values) >= 1 and all(v > 1 for v in values) and values == sorted(set(values)):
        return tuple(values)
    raise Refusal(f"--length-bins must be a number of bins or ascending edges > 1 like 32,64,128, got {text!r}")


def _sketch(text: str, numel: int) -> int | None:
    if text == "auto":
        return None if numel <= EXACT_UP_TO else AUTO_SKETCH
    if text.isdigit():
        return None if int(text) == 0 else int(text)
    raise Refusal(f"--sketch must be auto, 0 or a size, got {text!r}")


def configurations(args: argparse.Namespace):
    """The judged configurations, the beta of a launch configuration (None when not read from one) and the doctor's
    notes on it (an off-policy regime this measurement does not sample, its warnings)."""
    from .plan import configuration, of_native

    judged = [configuration(n) for n in args.config or ([] if args.launch else ["trl-default"])]
    beta, notes = None, []
    if args.launch:
        from ..doctor import DoctorError, diagnose

        framework, rest = args.launch[0], args.launch[1:]
        try:
            report = diagnose(framework, rest)
        except DoctorError as err:
            raise Refusal(f"cannot read this {framework} launch configuration: {err}") from None
        if report.verdict == "refused":
            raise Refusal("kl-adapters refuses this launch configuration: "
                          + "; ".join(h.message for h in report.hazards if h.severity == "refused"))
        if not report.paths:
            raise Refusal(f"this {framework} launch configuration has no KL term: nothing to measure")
        for path in report.paths:
            judged.append(of_native(f"{framework} {path.path}", path.native))
            notes.append(f"{framework} {path.path} = {path.setting}")
            beta = beta if beta is not None or path.beta is None else path.beta
        if "off-policy" in report.regimes and not args.behaviour:
            notes.append(f"the launch also trains off-policy ({report.off_policy_reason}); this measurement samples "
                         "the policy itself: give --behaviour <a checkpoint a few steps older> for that regime")
        notes += [f"{h.code}: {h.message}" for h in report.hazards if h.severity in ("bias", "warning")]
    return judged, beta, notes


def _device(text: str):
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise Refusal(f"--device {text}: CUDA is not available in this torch ({torch.__version__})")
    return text


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (Refusal, PlanError, ValueError) as err:
        print(f"kl-adapters measure: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"kl-adapters measure: needs transformers in this Python ({err}); pip install transformers",
              file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from . import models as mo
    from .gradients import GradientView
    from .crossfit import CrossFit
    from .measurement import collect, summarize
    from .plan import Plan, length_bins
    from .report import document, format_table, plot

    _numbers(args)
    bins = _bins(args.length_bins)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise Refusal("--plot needs matplotlib (pip install matplotlib)") from None
    betas = _betas(args.beta)
    judged, launch_beta, notes = configurations(args)
    beta = betas[0] if betas else launch_beta
    if args.reward and beta is None:
        raise Refusal("give --beta (the KL coefficient): with a reward the bias is compared with the task gradient")
    reward_fn = mo.load_reward(args.reward) if args.reward else None
    rows = mo.load_prompts(args.prompts, args.num_prompts)
    if len(rows) < 3:
        raise Refusal(f"{args.prompts} has {len(rows)} prompts: at least 3 prompt groups are needed")
    checked = mo.check_models(args.policy, args.reference, args.base, args.behaviour)
    ids = mo.prompt_ids(checked.tokenizer, rows)
    device = _device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    models = mo.load_models(checked, device=device, dtype=dtype)
    params = mo.select_parameters(models.policy, args.params)
    numel = sum(p.numel() for p in params)
    view = GradientView(params, _sketch(args.sketch, numel), seed=args.seed)

    bar = _Bar(sys.stderr)
    start = time.perf_counter()
    sampled = mo.sample(models, ids, args.group_size, args.max_new_tokens, args.temperature, args.seed,
                        args.micro_batch, progress=lambda d, n: bar("sampling", d, n))
    rewards = None if reward_fn is None else mo.rewards(reward_fn, rows, models, sampled)
    source = mo.ModelSource(models, sampled, args.temperature, rewards)
    plan = Plan(tuple(judged), beta if beta is not None else 1.0, length_bins(source.lengths, bins),
                scale_rewards=args.scale_rewards == "group", with_task=rewards is not None)
    vectors, sizes = collect(source, plan, view, folds=args.folds, micro_batch=args.micro_batch,
                             progress=lambda stage, d, n: bar(stage, d, n))
    bar.close()
    crossfit = CrossFit.of(vectors, sizes)
    result, *others = [summarize(crossfit, replace(plan, beta=b), source.lengths, step_batch=args.step_batch,
                                 confidence=args.confidence) for b in (plan.beta, *betas[1:])]
    lengths = source.lengths.to(torch.float64)
    context = {
        "policy": args.policy, "reference": args.reference or "the adapter's base", "behaviour": args.behaviour,
        "prompts": args.prompts, "num_prompts": len(rows), "group_size": args.group_size,
        "completions": int(lengths.numel()), "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
        "regime": "off-policy" if source.off_policy else "on-policy", "beta": plan.beta,
        "reward": args.reward, "scale_rewards": args.scale_rewards, "step_batch": args.step_batch,
        "parameters": numel, "params": args.params, "sketch": view.sketch, "device": device, "dtype": str(dtype),
        "judged": [c.__dict__ for c in judged], "notes": notes, "reference_estimator": plan.reference.name,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if args.plot:
        plot(result, args.plot, f"{args.policy} vs {context['reference']}, {len(rows)} prompts x G = "
                                f"{args.group_size}")
    if args.json:
        json.dump(document(result, context, others), sys.stdout, indent=2)
        print()
        return 0
    kind = "exact" if view.sketch is None else f"count-sketched to {view.sketch:,} values (norms within about " \
                                               f"{100 * (2 / view.sketch) ** 0.5:.1g}%)"
    header = [
        f"kl-adapters measure: {len(rows)} prompts x G = {args.group_size} = {context['completions']:,} completions "
        f"({context['regime']}), mean length {context['mean_length']:.1f} tokens (max {context['max_length']}), "
        f"temperature {args.temperature:g}, {context['seconds']:.0f} s",
        f"policy {args.policy} vs reference {context['reference']}; gradient of {numel:,} parameters "
        f"({args.params}), {kind}",
        f"beta {plan.beta:g}" + (f", reward {args.reward} (GRPO advantages, scale_rewards={args.scale_rewards}), "
                                 f"{args.step_batch} completions per step" if rewards is not None else
                                 " (no reward: the bias against the exact KL gradient only)"),
        *(f"note: {n}" for n in notes),
    ]
    print(format_table(result, header, others))
    return 0


class _Bar:
    """A one-line progress bar on a terminal (nothing when the stream is not one)."""

    def __init__(self, stream):
        self.stream, self.live = stream, stream.isatty()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.live:
            filled = int(30 * done / max(total, 1))
            self.stream.write(f"\r{stage:<10} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r" + " " * 60 + "\r")
            self.stream.flush()
