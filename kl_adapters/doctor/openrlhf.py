"""The doctor's OpenRLHF reader: ``train_ppo_ray`` arguments parsed and validated by OpenRLHF's own code, or a launch
script running ``openrlhf.cli.train_ppo_ray`` (its arguments extracted by `shell.find_commands`).

OpenRLHF builds its parser inside ``if __name__ == "__main__":`` of openrlhf/cli/train_ppo_ray.py, after importing
Ray, vLLM and flash-attn. The reader runs that block of the installed file (its parser, ``hierarchize`` and the
argument validation that follows) with only the file's standard-library imports, and stops before ``train(args)``:
no Ray, GPU or model. Arguments its validation needs but the KL analysis never reads (a reward source) get a neutral
placeholder when absent (`PLACEHOLDERS`, reported in the notes), so a partial command line such as ``--algo.kl.use_loss
--algo.kl.estimator k3`` is enough; any other argument its validation fails on is named. kl-adapters'
``--algo.kl.preset`` (the openrlhf_cli wrapper's flag) and KL_ADAPTERS (the script's environment) are read as the
adapter reads them; its refusals (`kl_adapters.adapters.openrlhf.check_args`) are the verdict "refused". Flags that
OpenRLHF renamed (`kl_adapters.adapters.openrlhf.renamed.RENAMED`) are named with their new names.

KL paths (`kl_adapters.native`): the loss (``--algo.kl.use_loss``: compute_approx_kl differentiated, global token
mean, times init_coef) or the reward (default: -init_coef * k_t per token, returns with gamma, or GAE).
Pinned by tests/openrlhf/test_doctor.py.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import linecache
import os
import re
import sys
import traceback
from pathlib import Path

from .. import activation, native, support
from ..activation import ENV_VAR
from ..adapters.openrlhf.renamed import renamed_hint
from .report import (OFF, ON, DoctorError, Fix, KLPath, Refused, Report, adapter_native, installed_version,
                     note_budget, per_token_target, refusals)
from .shell import launch_arguments

MODULES = ("openrlhf.cli.train_ppo_ray", "kl_adapters.adapters.openrlhf_cli")
FLAG = "--algo.kl.preset"

BETA_LOSS = ("--algo.kl.init_coef keeps its strength relative to the policy loss: the sequence KL's gradient is "
             "divided by the policy loss's own normaliser (token-mean: the step's token count, as OpenRLHF's KL loss; "
             "seq-mean-token-mean: sequences x max response length), so a tuned value carries over unchanged")
BETA_REWARD = ("--algo.kl.init_coef keeps its OpenRLHF meaning (per-token KL reward coefficient, k1 unclamped by "
               "the adapter)")


def read(argv: list[str], env: dict[str, str] | None = None, strict: bool = True) -> Report:
    """Report on train_ppo_ray arguments, or on a launch script when argv is one ``.sh`` path (its variables resolved
    from `env`, default this process's environment). strict=False reads past arguments this OpenRLHF release does
    not know (e.g. a script written for another release), reporting them, where OpenRLHF itself would refuse them."""
    version = installed_version("openrlhf")
    command = launch_arguments(argv, MODULES, os.environ if env is None else env)
    preset_flag, seq_target, args_in = _strip_flag(command.args)
    report = Report("openrlhf", version, " ".join(argv) or "(OpenRLHF defaults)", unresolved=command.unresolved)
    report.check_version()
    with refusals(report):
        activation.check_environment()  # a refused KL_ADAPTERS here would stop the import of OpenRLHF's trainer
        args, printed, unknown, filled = parse(args_in, strict=strict)
        if unknown:
            hint = renamed_hint(unknown)
            report.add("unknown-arguments", "warning", f"OpenRLHF {version} refuses these arguments (written for "
                       f"another release?), read past them: {' '.join(unknown)}" + (f"; {hint}" if hint else ""))
        if filled:
            report.notes.append(f"placeholder for {', '.join(filled)} (OpenRLHF's validation wants one; the KL "
                                "analysis does not read it)")
        report.notes += [f"OpenRLHF: {line}" for line in printed]
        flag = preset_flag if preset_flag is not None else command.variables.get(ENV_VAR)
        _analyse(report, args, _with_seq_target(activation.parse(flag, setting=FLAG if preset_flag is not None
                                                                 else ENV_VAR), seq_target))
    return report


def _strip_flag(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(--algo.kl.preset, --algo.kl.seq_target, the other arguments): the openrlhf_cli wrapper's flags."""
    from ..adapters.openrlhf.flags import TARGET_FLAG

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(FLAG, dest="preset")
    parser.add_argument(TARGET_FLAG, dest="seq_target")
    known, rest = parser.parse_known_args(argv)
    return known.preset, known.seq_target, rest


def _with_seq_target(settings, seq_target: str | None):
    """The settings with --algo.kl.seq_target as their KL budget, as the openrlhf_cli wrapper makes them."""
    from ..adapters.openrlhf.cli import TARGET_FLAG, with_target

    if seq_target is None:
        return settings
    try:
        target = float(seq_target)
    except ValueError:
        raise Refused(f"{TARGET_FLAG} {seq_target}: not a number (the launcher refuses it)") from None
    try:
        return with_target(settings, target)
    except ValueError as err:
        raise Refused(str(err)) from None


#: Arguments OpenRLHF's validation needs but the KL analysis never reads, with a neutral value filled in when the
#: command line gives none of their alternatives: (flag, placeholder, alternatives). A reward source: with the default
#: `gae` estimator OpenRLHF derives the critic's path from the reward model's (AttributeError on None), and
#: --eval.dataset and dynamic filtering assert one.
PLACEHOLDERS = (
    ("--reward.remote_url", "kl-adapters-doctor-placeholder",
     ("--reward.model_name_or_path", "--reward.remote_url", "--train.agent_func_path")),
)
_PARSE = "_kl_adapters_parse_args"  # what `args = parser.parse_args()` calls instead (see parse)


def parse(argv: list[str], strict: bool = True) -> tuple[argparse.Namespace, list[str], list[str], list[str]]:
    """OpenRLHF's own parsing and validation of train_ppo_ray arguments (see the module docstring): (args, the lines
    it printed, the arguments it does not know, the PLACEHOLDERS flags filled in). DoctorError on an argparse error
    or a failed validation, naming what it lacks; with strict=False unknown arguments are returned, not refused."""
    spec = importlib.util.find_spec("openrlhf.cli.train_ppo_ray")
    path = Path(spec.origin)
    tree = ast.parse(path.read_text(), str(path))
    main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    if len(main) != 1:
        raise DoctorError(f"{path} has no `if __name__ == '__main__':` block to read its parser from")
    body = [_parse_call(s) for s in main[0].body if not _starts_training(s)]
    if not any(ast.unparse(s) == f"args = {_PARSE}(parser)" for s in body):
        raise DoctorError(f"{path}: no `args = parser.parse_args()` in its `__main__` block to read")
    stdlib = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and _stdlib(n)]
    code = compile(ast.fix_missing_locations(ast.Module(body=stdlib + body, type_ignores=[])), str(path), "exec")
    parsed: dict[str, list[str]] = {}

    def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
        given = {a.split("=", 1)[0] for a in argv}
        parsed["filled"] = [w for flag, value, alternatives in PLACEHOLDERS
                            if flag in parser._option_string_actions and not given & set(alternatives)
                            for w in (flag, value)]
        if strict:
            return parser.parse_args([*argv, *parsed["filled"]])
        args, parsed["unknown"] = parser.parse_known_args([*argv, *parsed["filled"]])
        return args

    namespace = {"__name__": "kl_adapters_doctor", "__file__": str(path), _PARSE: parse_args}
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = ["train_ppo_ray", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(code, namespace)
    except SystemExit:
        message = err.getvalue().strip().splitlines()
        hint = renamed_hint(argv)
        raise DoctorError(f"OpenRLHF's parser refused the arguments: {message[-1] if message else 'exit'}"
                          + (f"; {hint}" if hint else "")) from None
    except AssertionError as refused:
        raise DoctorError(f"OpenRLHF refuses these arguments: {refused}") from None
    except Exception as failed:  # its validation reading an argument the command line does not set
        raise DoctorError(_validation_failure(failed, path, namespace.get("args"))) from None
    finally:
        sys.argv = saved
    printed = [line for line in out.getvalue().splitlines() if line.strip()]
    return namespace["args"], printed, parsed.get("unknown", []), parsed["filled"][::2]


def _read_side(line: str) -> str:
    """The part of a source line that is read: an assignment's value (its target is not needed), else the line."""
    try:
        (statement,) = ast.parse(line).body
    except (SyntaxError, ValueError):
        return line
    return ast.unparse(statement.value) if isinstance(statement, ast.Assign) else line


def _parse_call(statement: ast.stmt) -> ast.stmt:
    """``args = parser.parse_args()`` -> ``args = <_PARSE>(parser)`` (placeholders, strictness); others as is."""
    if ast.unparse(statement) != "args = parser.parse_args()":
        return statement
    return ast.copy_location(ast.parse(f"args = {_PARSE}(parser)").body[0], statement)


def _validation_failure(failed: Exception, path: Path, args) -> str:
    """One sentence for an exception raised by OpenRLHF's validation: the flags of the `args.x.y` it read on the
    failing line that are unset (None), or that line."""
    frames = [f for f in traceback.extract_tb(failed.__traceback__) if f.filename == str(path)]
    if not frames:
        return f"OpenRLHF's argument validation failed: {type(failed).__name__}: {failed}"
    line = linecache.getline(str(path), frames[-1].lineno).strip()
    unset = []
    for reference in dict.fromkeys(re.findall(r"\bargs((?:\.\w+)+)", _read_side(line))):
        value, names = args, reference.strip(".").split(".")
        for i, name in enumerate(names):  # args.x.y.split: the flag is --x.y, where the value is None
            value = getattr(value, name, "?")
            if value is None:
                unset.append("--" + ".".join(names[:i + 1]))
                break
    where = f"{path.name}:{frames[-1].lineno}"
    if unset:
        return (f"OpenRLHF's argument validation needs {' or '.join(unset)}, which these arguments leave unset "
                f"({where}: {line})")
    return f"OpenRLHF's argument validation failed at {where} ({line}): {type(failed).__name__}: {failed}"


def _starts_training(statement: ast.stmt) -> bool:
    """train(args), and the ModelScope hub patch (network), are what follows the validation."""
    text = ast.unparse(statement)
    return text.startswith("train(") or "patch_hub" in text


def _stdlib(node: ast.Import | ast.ImportFrom) -> bool:
    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return all(n and n.split(".")[0] in sys.stdlib_module_names for n in names)


def _regimes(report: Report, args) -> None:
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    reasons = []
    if args.train.max_epochs > 1:
        reasons.append(f"--train.max_epochs {args.train.max_epochs}")
    if args.train.batch_size < samples:
        reasons.append(f"--train.batch_size {args.train.batch_size} < {samples} samples per rollout")
    if getattr(args.train, "async_enable", False):
        reasons.append("--train.async_enable (rollouts from an older policy)")
    if reasons:
        report.regimes = (ON, OFF)
        report.off_policy_reason = ", ".join(reasons) + ": later optimizer steps use a stale rollout"


def _adapter_refusal(report: Report, args, settings) -> None:
    """The adapter's refusal of these arguments (the check its launcher and actors run) as the "refused" hazard."""
    from ..adapters import openrlhf as adapter
    from ..adapters._guard import UnsupportedFrameworkError

    try:
        adapter.check_args(args, settings)
    except (ValueError, UnsupportedFrameworkError) as err:
        report.add("refused", "refused", f"kl-adapters refuses this configuration before Ray starts: {err}")


def _analyse(report: Report, args, settings) -> None:
    kl, adv = args.algo.kl, args.algo.advantage
    _regimes(report, args)
    coef = float(kl.init_coef)
    if settings is not None:
        _adapter_refusal(report, args, settings)
    if kl.target is not None:
        report.add("adaptive-controller", "warning", f"--algo.kl.target {kl.target:g}: the adaptive controller "
                   "compares the target with a per-token mean KL, not KL_seq, so beta drifts with response length; "
                   + per_token_target(kl.target, args.rollout.max_new_tokens, "--algo.kl.seq_target <that>"))
    if kl.use_loss:
        _loss_path(report, args, coef, settings)
    elif coef > 0:
        _reward_path(report, args, coef, settings)
    if report.verdict in ("biased", "no-op", "refused"):
        report.fix = _fix(report, args)
    if settings is not None or report.fix is not None:
        _support(report, args)


def _support(report: Report, args) -> None:
    """The support matrix's verdict (`kl_adapters.support`) of every setting the arguments turn on (called where
    kl-adapters' path runs: a preset, or the fix): a note when tested, an `untested-path` / `refused-path` warning
    otherwise. Pinned by tests/openrlhf/test_doctor.py::test_support_settings_print_their_verdict."""
    ds, train, actor = args.ds, args.train, args.actor
    on = {"lora": ds.lora.rank > 0,
          "vllm": (args.vllm.num_engines or 0) > 0,
          "packing": bool(ds.packing_samples),
          "sequence-parallel": ds.ring_attn_size > 1,
          "tensor-parallel": ds.tensor_parallel_size > 1,
          "sharding": ds.zero_stage > 0,
          "data-parallel": actor.num_nodes * actor.num_gpus_per_node > 1,
          **support.vision_language_settings(actor.model_name_or_path, "openrlhf"),
          "liger": bool(getattr(ds, "use_liger_kernel", False)),
          "dynamic-batch": bool(train.dynamic_batch_enable),
          "off-policy": OFF in report.regimes,
          "async": bool(getattr(train, "async_enable", False))}
    notes, warnings = support.doctor_lines("openrlhf", [key for key, turned_on in on.items() if turned_on])
    report.notes += notes
    for code, message in warnings:
        report.add(code, "warning", message)


def _unbiased_gradient(args) -> bool:
    """--algo.kl.unbiased_gradient, which arrived in OpenRLHF 0.11.1 (0.10.4 / 0.11.0 args have no such attribute)."""
    return getattr(args.algo.kl, "unbiased_gradient", False)


def _loss_agg_mode(args) -> str:
    """--actor.loss_agg_mode, which arrived in OpenRLHF 0.11.2; before it PolicyLoss is token-mean (gspo aside)."""
    return getattr(args.actor, "loss_agg_mode", "token-mean")


def _loss_path(report: Report, args, coef: float, settings) -> None:
    kl, unbiased = args.algo.kl, _unbiased_gradient(args)
    setting = (f"--algo.kl.use_loss, estimator {kl.estimator}, unbiased_gradient={unbiased}, "
               f"init_coef {coef:g}")
    if coef <= 0:
        report.add("zero-coefficient", "no-op", "--algo.kl.use_loss with --algo.kl.init_coef 0: OpenRLHF computes no "
                   "KL and builds no reference model")
    if settings is not None:
        report.paths.append(KLPath("loss", setting, coef, adapter_native(settings.spec, f"{FLAG} {settings}",
                                                                         "openrlhf")))
        note_budget(report, settings, f"--algo.kl.init_coef {coef:g}", "rollout", "--algo.kl.seq_target")
        return
    report.paths.append(KLPath("loss", setting, coef, native.openrlhf_loss(kl.estimator, unbiased)))
    report.add("clamp", "warning", f"OpenRLHF clamps the estimator's value to +-{native.OPENRLHF_VALUE_CLAMP:g}: zero "
               "gradient on tokens beyond it" + (f"; unbiased_gradient caps its weight pi/pi_old at "
                                                 f"{native.OPENRLHF_IS_WEIGHT_CLIP:g}" if unbiased else ""))
    report.add("token-mean", "warning", "the KL loss is a global token mean: beta is per token and its weight per "
               "sequence changes with the batch's total length")


def _reward_path(report: Report, args, coef: float, settings) -> None:
    kl, adv = args.algo.kl, args.algo.advantage
    setting = f"estimator {kl.estimator} in the reward, init_coef {coef:g}, advantage {adv.estimator}"
    if settings is not None:
        report.paths.append(KLPath("reward", setting, coef, adapter_native(settings.spec, f"{FLAG} {settings}",
                                                                           "openrlhf")))
        note_budget(report, settings, f"--algo.kl.init_coef {coef:g}", "rollout", "--algo.kl.seq_target")
        return
    kl_native = native.openrlhf_reward(kl.estimator)
    report.paths.append(KLPath("reward", setting, coef, kl_native))
    if kl_native.preset is None:
        report.add("unsupported-estimator", "bias", kl_native.reason)
    report.add("clamp", "warning", f"OpenRLHF clamps the KL reward's k to +-{native.OPENRLHF_VALUE_CLAMP:g}: tokens "
               "beyond it are under-penalized")
    if adv.estimator == "reinforce" and adv.gamma != 1:
        report.add("discounted", "bias", f"--algo.advantage.gamma {adv.gamma:g}: a discounted KL reward-to-go is not "
                   "the gradient of the sequence KL")
    if adv.estimator == "gae" and (adv.gamma != 1 or adv.lambd != 1):
        report.add("gae-lambda", "bias", f"GAE with gamma {adv.gamma:g}, lambd {adv.lambd:g}: the KL return is "
                   "discounted or bootstrapped from the critic; exact only at gamma = lambd = 1")
    if adv.estimator in ("gae", "reinforce", "reinforce_baseline") and not adv.no_std_norm:
        report.add("std-normalized-reward", "warning", "advantages (KL included) are whitened over the batch: beta "
                   "is divided by the batch's advantage std (direction kept, strength varies per batch)")
    if _loss_agg_mode(args) == "seq-mean-token-mean" or args.actor.policy_loss_type == "gspo":
        report.add("length-normalized", "bias", "seq-mean-token-mean (forced by gspo) divides each sequence's KL "
                   "return by its length in the policy loss: a length-normalized KL")


def _fix(report: Report, args) -> Fix:
    """On-policy reward path: preset reward there (k1, gamma 1, token-mean ppo); otherwise the loss with `sequence`."""
    kl = args.algo.kl
    coef = [] if kl.init_coef > 0 else ["--algo.kl.init_coef 0.001"]
    if not kl.use_loss and report.regimes == (ON,):
        lines = ["python -m kl_adapters.adapters.openrlhf_cli <your train_ppo_ray arguments> --algo.kl.preset reward",
                 *coef]
        lines += [] if kl.estimator == "k1" else ["--algo.kl.estimator k1"]
        lines += [] if _loss_agg_mode(args) == "token-mean" else ["--actor.loss_agg_mode token-mean"]
        return Fix("reward", tuple(lines), BETA_REWARD)
    lines = ["python -m kl_adapters.adapters.openrlhf_cli <your train_ppo_ray arguments> --algo.kl.preset sequence",
             "--algo.kl.use_loss", *coef]
    lines += ["(drop --algo.kl.unbiased_gradient)"] if _unbiased_gradient(args) else []
    return Fix("sequence", tuple(lines), BETA_LOSS)
