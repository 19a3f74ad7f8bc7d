"""The `kl-adapters` command: `audit` (exact gradient table), `demo` (the exact-objective benchmark), `presets`,
`doctor` (what a TRL / verl / OpenRLHF configuration's KL gradient optimizes), `measure` (how far that gradient is
from the exact one on your own model and prompts, and whether it matters against the task gradient)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _audit(args: argparse.Namespace) -> int:
    from .audit import audit, format_table, format_task_table, kl_seq, random_policies, task_audit

    try:
        sizes = tuple(int(g) for g in args.batch_sizes.split(",") if g.strip())
    except ValueError:
        return _refuse("audit", f"--batch-sizes must be comma-separated integers, e.g. 1,2,3; got {args.batch_sizes!r}")
    problems = [msg for bad, msg in (
        (args.vocab < 2, f"--vocab must be >= 2 (one token is EOS), got {args.vocab}"),
        (args.horizon < 1, f"--horizon must be >= 1, got {args.horizon}"),
        (any(g < 1 for g in sizes), f"--batch-sizes must be >= 1, got {args.batch_sizes!r}"),
        (args.discount is not None and not 0 < args.discount < 1, f"--discount must be in (0, 1), got {args.discount}"),
        (args.task is not None and not (args.task > 0 and any(g >= 3 for g in sizes)),
         f"--task needs a scale > 0 and --batch-sizes with a G >= 3 (a row's statistics need two other rows), got "
         f"--task {args.task} --batch-sizes {args.batch_sizes!r}"),
    ) if bad]
    if problems:
        return _refuse("audit", problems[0])
    rows = audit(args.vocab, args.horizon, args.seed, drift=args.drift, off_policy=args.off_policy,
                 is_clip=None if args.is_clip <= 0 else args.is_clip, batch_sizes=sizes, discount=args.discount)
    task_rows = [] if args.task is None else task_audit(
        args.vocab, args.horizon, args.seed, drift=args.drift, off_policy=args.off_policy,
        batch_sizes=tuple(g for g in sizes if g >= 3), scale=args.task)
    if args.json:
        pol = random_policies(args.vocab, args.horizon, args.seed, drift=args.drift, off_policy=args.off_policy)
        doc = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "json")},
               "kl_seq": float(kl_seq(pol.space, pol.logits, pol.ref_logits)),
               "num_sequences": pol.space.num_sequences,
               "rows": [r.as_dict() for r in rows], "task_rows": [r.as_dict() for r in task_rows]}
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        print(format_table(rows, vocab=args.vocab, horizon=args.horizon, seed=args.seed))
        if task_rows:
            print(format_task_table(task_rows))
    return 0


def _presets(args: argparse.Namespace) -> int:
    from .presets import PRESETS as listed
    from .presets import RECOMMENDED
    if args.json:
        json.dump({n: {k: v for k, v in p.__dict__.items() if k != "coefficients"} for n, p in listed.items()},
                  sys.stdout, indent=2)
        print()
        return 0
    for p in listed.values():
        unbiased = ", ".join(w for w, ok in (("on-policy", p.unbiased_on_policy), ("off-policy", p.unbiased_off_policy))
                             if ok) or "no"
        mark = {RECOMMENDED[0]: "RECOMMENDED for a KL in the loss, in every framework. ",
                RECOMMENDED[1]: "RECOMMENDED for a KL kept in the reward. "}.get(p.name, "")
        print(f"{p.name:<15} {mark}{p.summary}\n{'':<15} gradient: {p.gradient}\n{'':<15} importance weights: "
              f"{p.importance_weights}; unbiased for grad KL_seq: {unbiased}\n")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """Exit 0: the configuration's KL gradient is unbiased (or there is no KL); 1: biased or a no-op; 2: unreadable;
    3: refused by kl-adapters (`doctor.report.EXIT_CODES`, `UNREADABLE`)."""
    from .doctor import UNREADABLE, DoctorError, diagnose, format_report

    rest = list(args.args)
    as_json = "--json" in rest
    rest = [a for a in rest if a != "--json"]
    options = {}
    if "--trainer" in rest:
        i = rest.index("--trainer")
        options["trainer"] = rest[i + 1] if i + 1 < len(rest) else ""
        del rest[i:i + 2]
    try:
        if options and args.framework != "trl":
            raise DoctorError("--trainer (grpo or rloo) applies to trl only")
        report = diagnose(args.framework, rest, **options)
    except DoctorError as err:
        print(f"kl-adapters doctor: cannot read this {args.framework} configuration: {err}", file=sys.stderr)
        return UNREADABLE
    if as_json or args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(format_report(report, colour=sys.stdout.isatty()))
    return report.exit_code


def _demo(args: argparse.Namespace) -> int:
    from .demo.run import main

    try:
        if args.long_horizon:
            from .demo.long_horizon_run import quick

            return quick(args.out)
        if args.task:
            from .demo.task.driver import quick

            return quick(args.out)
        return main(args)
    except ModuleNotFoundError as err:  # the demo trains with TRL: a package of its environment is missing
        return _refuse("demo", f"needs TRL's environment ({err}): run `bash scripts/demo.sh`, which builds .venvs/trl, "
                               "or install the pins of envs/trl.txt")


def _refuse(command: str, message: str) -> int:
    print(f"kl-adapters {command}: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kl-adapters", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit", help="exact expected gradient, bias and variance of every preset on a tabular policy",
        description="Enumerate every sequence of a small random tabular policy (V tokens incl. EOS, horizon T) and "
                    "compute, exactly in float64, each preset's expected KL gradient against grad KL(pi || pi_ref) "
                    "over whole sequences: its relative bias, cosine, variance and the exact target it does follow, "
                    "on-policy and off-policy (a behaviour policy mu). With --batch-sizes, the batch estimators "
                    "(sequence, reward) over every batch of G; with --task, the trainer's task + KL gradient. This "
                    "is a property of each estimator, not of your model: `kl-adapters measure` measures your model. "
                    "docs/audit.md.")
    a.add_argument("-V", "--vocab", type=int, default=4, help="vocabulary size including EOS (default 4)")
    a.add_argument("-T", "--horizon", type=int, default=4, help="maximum sequence length (default 4)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--drift", type=float, default=1.0, help="std of pi's logits around pi_ref's (default 1.0)")
    a.add_argument("--off-policy", type=float, default=0.5, help="std of mu's logits around pi's (default 0.5)")
    a.add_argument("--is-clip", type=float, default=2.0, help="cap for the extra clipped 'sequence' row; 0 = no row")
    a.add_argument("--batch-sizes", default="", metavar="G,G,...",
                   help="also audit the batch estimators (sequence, reward) over every batch of G sequences, e.g. "
                        "1,2,3 (N^G batches: G = 3 at the default V, T takes minutes)")
    a.add_argument("--discount", type=float, default=None, metavar="GAMMA",
                   help="also audit 'sequence' with its future-KL return discounted by GAMMA in (0, 1): the "
                        "bias-variance dial's exact bias (and variance)")
    a.add_argument("--task", type=float, default=None, metavar="SCALE",
                   help="also audit the trainer's gradient, task + KL, at the batch sizes >= 3: GRPO advantages of a "
                        "random reward SCALE x U(0, 1) per sequence; sequence-plain vs sequence fitted to the KL term "
                        "alone vs to task + KL (G = 3 at the default V, T takes minutes: try -V 3 -T 3)")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    a.set_defaults(func=_audit)
    d = sub.add_parser("demo", help="train a tiny transformer with TRL under each KL configuration; exact evaluation")
    from .demo.run import add_demo_arguments

    add_demo_arguments(d)
    d.set_defaults(func=_demo)
    p = sub.add_parser("presets", help="list the presets and what gradient each produces")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_presets)
    doc = sub.add_parser(
        "doctor", help="read a TRL / verl / OpenRLHF configuration and report what its KL gradient optimizes",
        description="kl-adapters doctor trl [--trainer grpo|rloo] ARGS|config.yaml|script.py ; doctor verl "
                    "OVERRIDES|launch.sh ; doctor openrlhf ARGS|launch.sh  (--json anywhere). Exit 0: unbiased or "
                    "no KL; 1: biased or a no-op; 2: the configuration cannot be read (framework not installed, "
                    "parser error); 3: kl-adapters refuses it.")
    doc.add_argument("--json", action="store_true", help="machine-readable report (schema: kl_adapters.doctor.SCHEMA)")
    doc.add_argument("framework", choices=("trl", "verl", "openrlhf"))
    doc.add_argument("args", nargs=argparse.REMAINDER, help="the framework's arguments, a config file or a script")
    doc.set_defaults(func=_doctor)
    from .measure.command import add_arguments, run

    m = sub.add_parser(
        "measure", help="measure a KL configuration's gradient bias on your policy, reference and prompts",
        description="Sample G completions per prompt from your policy, then estimate, with confidence intervals, how "
                    "far the expected KL gradient of a configuration (TRL's default, the k3 loss, verl's or "
                    "OpenRLHF's settings, or read from a launch configuration) is from the exact gradient of the "
                    "sequence KL, for it and every kl-adapters preset; with a reward, against the task gradient and "
                    "one step's noise. Exit 0, or 2 on bad input (one line, before any sampling). docs/measure.md.")
    add_arguments(m)
    m.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the output was piped into a reader that stopped (e.g. `| head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
