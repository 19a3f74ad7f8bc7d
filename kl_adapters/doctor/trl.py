"""The doctor's TRL reader: GRPOTrainer / RLOOTrainer configurations, parsed by TRL's own ``trl grpo`` / ``trl rloo``
parser (`trl.scripts.<trainer>.make_parser`, TrlParser: command-line arguments and ``--config file.yaml``).

Input: the arguments of ``trl grpo|rloo`` (a YAML file as first argument means ``--config``), or an example script
(``.py``): the arguments of the usage command in its docstring plus the literal keyword arguments of its
``GRPOConfig(...)`` / ``RLOOConfig(...)`` call. GRPO arguments are parsed into `kl_adapters.adapters.trl.KLGRPOConfig`,
so kl-adapters' own fields (``--kl_preset``, ``--kl_is_clip``, ``--kl_target``, ``--kl_discount``) are read and
checked by KLGRPOConfig itself: what it refuses is the verdict "refused". ``--use_cpu`` is added when absent:
TrainingArguments refuses
bf16 without a GPU, and the device does not touch the KL. ``--num_processes N`` (accelerate's flag, also taken from
the usage command) is the world size GRPOConfig validates its batch sizes against (default 1); it does not touch the
KL either.

KL paths (`kl_adapters.native`): GRPO's loss (beta * k3, times pi/pi_old with use_bias_correction_kl); RLOO's
reward (beta * sum_t k1_t in the sequence reward). Pinned by tests/trl/test_doctor.py.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import shlex
import warnings
from contextlib import contextmanager
from pathlib import Path

from .. import activation, native, support
from .report import (AUDIT_ARGS, OFF, DoctorError, Fix, KLPath, Report, adapter_native, installed_version,
                     Refused, note_budget, refusals)
from .shell import logical_lines

TRAINERS = ("grpo", "rloo")
_CONFIG_CLASS = {"grpo": "GRPOConfig", "rloo": "RLOOConfig"}
_KL_FIELDS = ("--kl_preset", "--kl_is_clip", "--kl_target", "--kl_discount")

BETA_AFTER_FIX = ("TRL's beta keeps its strength relative to the policy loss: the adapter adds the preset's "
                  "sequence-level KL with beta_seq = beta * B / D, D the loss type's own normaliser (grpo, sapo: "
                  "D = B * max_completion_length, i.e. no per-sequence length division)")


def read(argv: list[str], trainer: str | None = None) -> Report:
    """Report on a TRL configuration (see the module docstring); DoctorError when it cannot be read."""
    version = installed_version("trl")
    source = " ".join(argv) or "(TRL defaults)"
    if argv and argv[0].endswith(".py"):
        trainer_in_script, argv = script_arguments(Path(argv[0]), argv[1:])
        trainer = trainer_in_script if trainer is None else trainer
    elif argv and argv[0].endswith((".yaml", ".yml")):
        argv = ["--config", *argv]
    trainer = "grpo" if trainer is None else trainer
    if trainer not in TRAINERS:
        raise DoctorError(f"--trainer must be one of {', '.join(TRAINERS)}, got {trainer!r}")
    report = Report("trl", version, source)
    report.check_version()
    with refusals(report):
        activation.check_environment()  # a refused KL_ADAPTERS here would stop the import of TRL's trainers
        argv, processes = _num_processes(argv)
        config, kl_flags, model = _parse(trainer, argv, processes)
        if trainer == "grpo":
            _grpo(report, config)
            _support(report, config, model, processes)
        else:
            _rloo(report, config, kl_flags)
    return report


def script_arguments(path: Path, extra: list[str]) -> tuple[str, list[str]]:
    """(trainer, argv) of an example script: its docstring usage command's arguments, then `extra`, then the literal
    keyword arguments of its GRPOConfig/RLOOConfig call as ``--key value``."""
    try:
        text = path.read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError) as err:
        raise DoctorError(f"cannot read {path}: {err}") from None
    trainers = [t for t, cls in _CONFIG_CLASS.items() if f"{cls}(" in text or f" {cls}," in text or f"({cls}," in text]
    if len(trainers) != 1:
        raise DoctorError(f"{path}: uses {'both' if trainers else 'neither'} of GRPOConfig / RLOOConfig; "
                          "pass --trainer and the arguments instead")
    argv = _usage_arguments(ast.get_docstring(tree) or "", path.name) if "TrlParser" in text else []
    literals: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == _CONFIG_CLASS[trainers[0]]:
            for kw in node.keywords:
                try:
                    value = ast.literal_eval(kw.value) if kw.arg else None
                except ValueError:
                    continue  # computed at run time (e.g. from its own argparse): the parser default stands
                if kw.arg and (value is None or isinstance(value, (str, int, float, bool))):
                    literals += [f"--{kw.arg}", str(value)]
    return trainers[0], argv + extra + literals


def _usage_arguments(docstring: str, name: str) -> list[str]:
    """The arguments after the script's name in the usage command, and accelerate's --num_processes before it."""
    for _, line in logical_lines(docstring):
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word.endswith(name):
                launcher = words[:i]
                n = launcher.index("--num_processes") if "--num_processes" in launcher else None
                return words[i + 1:] + ([] if n is None else launcher[n:n + 2])
    return []


def _num_processes(argv: list[str]) -> tuple[list[str], int]:
    """(argv without --num_processes N, N; the last one given wins, default 1)."""
    processes = 1
    while "--num_processes" in argv:
        i = argv.index("--num_processes")
        try:
            processes = int(argv[i + 1])
        except (IndexError, ValueError):
            raise DoctorError("--num_processes needs an integer") from None
        argv = argv[:i] + argv[i + 2:]
    return argv, processes


@contextmanager
def _world_size(config_class: type, processes: int):
    """TrainingArguments.world_size as `processes` while TRL validates a config (no process group is started)."""
    config_class.world_size = property(lambda self: processes)
    try:
        yield
    finally:
        del config_class.world_size


def _parse(trainer: str, argv: list[str], processes: int):
    """(the trainer's config, the kl-adapters flags given to RLOO, the model arguments: TRL's ModelConfig) parsed by
    TRL's TrlParser; GRPO's config class is KLGRPOConfig, whose own refusals raise SettingError (the verdict
    "refused")."""
    from trl import TrlParser

    from ..adapters.trl import KLGRPOConfig

    script = importlib.import_module(f"trl.scripts.{trainer}")
    types = tuple(KLGRPOConfig if t.__name__ == "GRPOConfig" else t for t in script.make_parser().dataclass_types)
    parser = TrlParser(types)
    args = list(argv) + ([] if "--use_cpu" in argv else ["--use_cpu", "true"])
    config_class = next(t for t in types if t.__name__ in (_CONFIG_CLASS[trainer], "KLGRPOConfig"))
    err = io.StringIO()
    try:  # argparse's usage text and transformers' deprecation warnings are not for the doctor's reader
        with _world_size(config_class, processes), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            *parsed, remaining = parser.parse_args_and_config(args, return_remaining_strings=True)
    except activation.SettingError:
        raise
    except SystemExit:
        errors = [line.split("error: ", 1)[1] for line in err.getvalue().splitlines() if "error: " in line]
        raise DoctorError(f"TRL's parser refused the arguments: {errors[-1] if errors else 'exit'}") from None
    except OSError as unreadable:  # --config's file
        raise DoctorError(f"cannot read {unreadable.filename}: {unreadable.strerror}") from None
    except (ValueError, TypeError) as refused:
        raise DoctorError(f"TRL refuses these arguments ({processes} process(es); --num_processes N sets it): "
                          f"{refused}") from None
    config = next(p for p in parsed if isinstance(p, config_class))
    model = next((p for p in parsed if type(p).__name__ == "ModelConfig"), None)
    kl_flags: dict[str, str] = {}
    rest = list(remaining)
    while rest:
        key = rest.pop(0)
        name, _, value = key.partition("=")
        if name not in _KL_FIELDS or (not value and not rest):
            raise DoctorError(f"arguments TRL's {trainer} parser does not know: {' '.join(remaining)}")
        kl_flags[name[2:]] = value or rest.pop(0)
    return config, kl_flags, model


def _off_policy(report: Report, config) -> None:
    every = config.steps_per_generation * config.num_iterations
    if config.gradient_accumulation_steps % every != 0 or config.num_iterations > 1:
        report.regimes = ("on-policy", "off-policy")
        report.off_policy_reason = (f"num_iterations={config.num_iterations}, steps_per_generation="
                                    f"{config.steps_per_generation}, gradient_accumulation_steps="
                                    f"{config.gradient_accumulation_steps}: later optimizer steps reuse a rollout")


def _grpo(report: Report, config) -> None:
    from ..adapters.trl import field_settings

    settings = field_settings(config.kl_preset, config.kl_is_clip, config.kl_target, config.kl_discount)
    _off_policy(report, config)
    _discount(report, config.kl_discount)
    if config.beta == 0.0:  # KLGRPOConfig refused a preset with beta 0 (and gave a budget its starting beta)
        return
    setting = (f"beta={config.beta:g}, loss_type={config.loss_type}, use_bias_correction_kl="
               f"{config.use_bias_correction_kl}, importance_sampling_level={config.importance_sampling_level}")
    if settings is not None:
        _sharded_head(config, settings)
        report.paths.append(KLPath("loss", f"kl_preset={settings}, beta={config.beta:g}", config.beta,
                                   adapter_native(settings.spec, f"kl_preset={settings}", "trl")))
        note_budget(report, settings, f"beta={config.beta:g}", "optimizer step", "--kl_target")
        return
    kl = native.trl_grpo_loss(config.use_bias_correction_kl, config.importance_sampling_level)
    report.paths.append(KLPath("loss", setting, config.beta, kl))
    if kl.preset is None:
        report.add("sequence-is", "bias", "importance_sampling_level='sequence' multiplies every token's k3 by the "
                   "sequence-level ratio, with gradient: its gradient adds (sum_t k3_t) times the sequence's mean "
                   "score, an extra term no preset has (TRL issue #6586)")
    if config.loss_type in ("grpo", "sapo"):
        report.add("length-normalized", "bias", f"loss_type={config.loss_type} divides each sequence's loss, KL "
                   "included, by its own length: the KL optimized is E[KL_seq / |o|], a length-normalized KL")
    if getattr(config, "vllm_importance_sampling_correction", False) and getattr(config, "use_vllm", False):
        report.add("vllm-is", "warning", "vLLM importance sampling correction weights the policy loss only; the KL "
                   "term is not corrected for the vLLM/trainer mismatch")
    report.fix = Fix("sequence", (
        "from kl_adapters.adapters.trl import KLGRPOConfig  # in place of GRPOConfig, then kl_preset='sequence'",
        "--kl_preset sequence  (scripts parsing KLGRPOConfig)",
        "KL_ADAPTERS=sequence  (environment, e.g. with `trl grpo`)"), BETA_AFTER_FIX)


def _sharded_head(config, settings) -> None:
    """Refused, as GRPOTrainer's construction refuses it (`trainer_init.sharded_head_refusal`): a preset that needs the
    full vocabulary (`full`) under FSDP or DeepSpeed ZeRO-3 (`zero_optimization.stage` 3 in the `deepspeed` config, a
    dict or a JSON file). Pinned by tests/trl/test_doctor.py::test_full_under_sharding_is_refused."""
    from ..adapters.trl.trainer_init import sharded_head_refusal

    sharding = "FSDP" if config.fsdp else "DeepSpeed ZeRO-3" if _zero_stage(config.deepspeed) == 3 else None
    refusal = sharded_head_refusal(settings, "kl_preset", sharding)
    if refusal is not None:
        raise Refused(refusal)


def _zero_stage(deepspeed) -> int | None:
    """`zero_optimization.stage` of TrainingArguments' `deepspeed` (a dict or a JSON file's path); None otherwise."""
    if isinstance(deepspeed, str) and Path(deepspeed).is_file():
        deepspeed = json.loads(Path(deepspeed).read_text())
    stage = deepspeed.get("zero_optimization", {}).get("stage") if isinstance(deepspeed, dict) else None
    return stage if isinstance(stage, int) else None


def _support(report: Report, config, model, processes: int) -> None:
    """The support matrix's verdict (`kl_adapters.support`) of every setting a GRPO configuration with a KL term turns
    on, where kl-adapters' path runs (kl_preset, or the fix): a note when tested, an `untested-path` / `refused-path`
    warning otherwise. Pinned by tests/trl/test_doctor.py::test_support_settings_print_their_verdict."""
    if not report.paths:
        return
    on = {"lora": bool(getattr(model, "use_peft", False)),
          "vllm": bool(config.use_vllm),
          "sharding": bool(config.deepspeed or config.fsdp),
          "data-parallel": processes > 1,
          **support.vision_language_settings(getattr(model, "model_name_or_path", None), "trl"),
          "liger": bool(config.use_liger_kernel),
          "off-policy": OFF in report.regimes}
    notes, warnings = support.doctor_lines("trl", [key for key, turned_on in on.items() if turned_on])
    report.notes += notes
    for code, message in warnings:
        report.add(code, "warning", message)


def _discount(report: Report, gamma: float | None) -> None:
    """--kl_discount gamma < 1 (KLGRPOConfig's bias-variance dial, which it has checked): a bias hazard with the exact
    relative bias |E[g_gamma] - grad KL_seq| / |grad KL_seq| of the discounted future-KL return in `AUDIT_PROBLEM`
    (horizon 4; it grows with the completion length)."""
    from ..audit import audit

    if gamma is None or gamma == 1.0:
        return
    rows = audit(*AUDIT_ARGS, presets=("sequence",), is_clip=None, discount=gamma)
    bias = max(r.relative_bias for r in rows if r.discount == gamma and r.regime in report.regimes)
    report.add("discounted", "bias", f"--kl_discount {gamma:g}: the future-KL return is discounted (lower "
               f"variance, biased): exact relative bias {bias:.2%} in the audit problem (horizon 4), larger at "
               "long completions (docs/long_horizon.md); 1 or unset is exact")


def _rloo(report: Report, config, kl_flags: dict[str, str]) -> None:
    if kl_flags:
        raise DoctorError(f"RLOOTrainer has no kl-adapters fields ({', '.join(kl_flags)}); kl-adapters leaves RLOO "
                          "as it is (KL_ADAPTERS only makes it refuse biased RLOO settings)")
    _off_policy(report, config)
    if config.beta == 0.0:
        return
    report.paths.append(KLPath("reward", f"beta={config.beta:g}, normalize_advantages={config.normalize_advantages}",
                               config.beta, native.trl_rloo_reward()))
    if config.normalize_advantages:
        report.add("std-normalized-reward", "bias", "normalize_advantages=True divides the advantages, KL reward "
                   "included, by their batch std: the KL's scale (beta) then depends on the batch")
    if len(report.regimes) > 1:
        report.add("stale-kl-reward", "bias", "off-policy RLOO computes k1 from the rollout-time log-probs and weights "
                   "it with the clipped sequence ratio: not the current policy's KL gradient (the audit's off-policy "
                   "row uses a per-token ratio instead, so it only indicates the size)")
    if report.hazards:
        report.fix = Fix("sequence", (
            "num_iterations=1, steps_per_generation dividing gradient_accumulation_steps, normalize_advantages=False "
            "(RLOO's KL is then exact on-policy), or",
            "GRPOTrainer with KLGRPOConfig(kl_preset='sequence', beta=...)  (exact on- and off-policy)"),
            "RLOO's beta multiplies the summed k1 in the sequence reward (unchanged); " + BETA_AFTER_FIX)
