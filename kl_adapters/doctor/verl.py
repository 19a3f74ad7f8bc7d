"""The doctor's verl reader: Hydra overrides composed with verl's own config (``ppo_trainer.yaml``, or the
``--config-name`` given, from the installed verl's trainer/config), or a launch script running
``verl.trainer.main_ppo`` (its overrides extracted by `shell.find_commands`).

KL paths (`kl_adapters.native`): the actor loss (``actor.use_kl_loss``: kl_loss_coef * agg_loss(kl_penalty(log_prob,
ref, kl_loss_type))) and the reward (``algorithm.use_kl_in_reward``: scores - beta * kl_penalty(old, ref,
kl_penalty), then the advantage estimator). ``kl_adapters:<preset>`` names and KL_ADAPTERS (the script's environment
or ``+ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS``) select the adapter's presets; its own refusals
(`kl_adapters.adapters.verl.check_config`) are the verdict "refused". verl's full ``validate_config`` is not run (it
checks GPU counts and batch divisibility, which do not touch the KL). Pinned by tests/verl/test_doctor.py.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

from .. import activation, native, support
from ..activation import ENV_VAR
from .report import (OFF, ON, DoctorError, Fix, KLPath, Report, adapter_native, installed_version, note_budget,
                     per_token_target, refusals)
from .shell import UNRESOLVED, launch_arguments

MODULES = ("verl.trainer.main_ppo",)
_TO_GO = ("reinforce_plus_plus", "gae")  # per-token returns; other estimators sum the token rewards
_ACTOR, _ALGO = "actor_rollout_ref.actor", "algorithm"

BETA_LOSS = ("kl_loss_coef keeps its strength relative to the task loss: the preset's term goes through verl's own "
             "agg_loss, i.e. kl_surrogate(..., beta = kl_loss_coef * B / D) with D verl's divisor (token-mean: "
             "batch_num_tokens / dp_size)")
BETA_REWARD = ("algorithm.kl_ctrl.kl_coef keeps verl's meaning, a per-token reward coefficient on the raw reward "
               "scale; the KL reward-to-go is added after the advantage estimator (never divided by GRPO's std)")


def read(argv: list[str], env: dict[str, str] | None = None, strict: bool = True) -> Report:
    """Report on verl Hydra overrides, or on a launch script when argv is one ``.sh`` path (its variables resolved
    from `env`, default this process's environment). strict=False drops overrides of keys this verl release does not
    have (e.g. a script written for another release), reporting them, where Hydra itself would refuse them."""
    version = installed_version("verl")
    command = launch_arguments(argv, MODULES, os.environ if env is None else env)
    report = Report("verl", version, " ".join(argv) or "(verl defaults)", unresolved=command.unresolved)
    report.check_version()
    with refusals(report):
        activation.check_environment()  # a refused KL_ADAPTERS here would stop the import of verl's trainer
        config, dropped = compose(command.args, strict=strict)
        if dropped:
            report.add("unknown-arguments", "warning", f"verl {version}'s config has no such keys (written for "
                       f"another release?), read without them: {' '.join(dropped)}")
        _analyse(report, config, command.variables.get(ENV_VAR))
    return report


def compose(overrides: list[str], strict: bool = True):
    """(verl's config composed with `overrides` by Hydra, as ``python -m verl.trainer.main_ppo`` composes it, the
    overrides dropped). strict=False drops, one at a time, each override Hydra refuses for a key the config lacks."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    name, rest = _config_name(overrides)
    if not os.path.exists(os.path.join(config_dir, f"{name}.yaml")):
        raise DoctorError(f"config {name!r} is not one of the installed verl's trainer configs ({config_dir})")
    dropped: list[str] = []
    while True:
        try:
            with initialize_config_dir(config_dir=config_dir, version_base=None):
                return hydra_compose(config_name=name, overrides=rest), dropped
        except (HydraException, OmegaConfBaseException, ValueError) as err:
            missing = re.search(r"Could not (?:override|append to config)[^']*'([^']+)'", str(err))
            culprit = [o for o in rest if missing and o.lstrip("+~").split("=", 1)[0] == missing.group(1)]
            if strict or not culprit:
                raise DoctorError(_compose_failure(err, name, missing and missing.group(1))) from None
            rest.remove(culprit[0])
            dropped.append(culprit[0])


#: Hydra's options of ``python -m verl.trainer.main_ppo`` (long and short form) that take a value
_HYDRA_OPTIONS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path",
                  "--config-dir": "path", "-cd": "path"}


def _config_name(arguments: list[str]) -> tuple[str, list[str]]:
    """(the config name, default ppo_trainer; the Hydra overrides). ``--config-path`` / ``--config-dir`` are read past:
    an example's own config folder is not installed, its config name is looked up in verl's."""
    name, rest, words = "ppo_trainer", [], list(arguments)
    while words:
        item = words.pop(0)
        option, has_value, value = item.partition("=")
        if option in _HYDRA_OPTIONS:
            if not has_value:
                if not words:
                    raise DoctorError(f"{option} needs a value")
                value = words.pop(0)
            if _HYDRA_OPTIONS[option] == "name":
                name = value.strip("'\"").removesuffix(".yaml")
        elif item.startswith("-"):
            raise DoctorError(f"unsupported main_ppo option {item!r} (only Hydra overrides key=value and "
                              "--config-name)")
        else:
            rest.append(item)
    return name, rest


def _compose_failure(err: Exception, name: str, missing_key: str | None) -> str:
    """Hydra's error in one line; for a key the config lacks, the full keys that end with it."""
    candidates = [k for k in _keys(name) if k.endswith("." + missing_key)] if missing_key else []
    if candidates:
        return f"verl's {name}.yaml has no key {missing_key!r}: did you mean {' or '.join(candidates[:3])}?"
    lines = [line.strip().rstrip(".") for line in str(err).splitlines()
             if line.strip() and not line.startswith("See https")]
    return f"Hydra could not compose verl's {name}.yaml with these overrides: {'; '.join(lines)}"


def _keys(name: str) -> list[str]:
    """Every dotted key of verl's config `name`, composed without overrides."""
    from omegaconf import OmegaConf

    config, _ = compose([f"--config-name={name}"])
    found: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, child in node.items():
            found.append(prefix + str(key))
            if isinstance(child, dict):
                walk(child, f"{prefix}{key}.")

    walk(OmegaConf.to_container(config, resolve=False, throw_on_missing=False), "")
    return found


def _get(config, key: str):
    """The value at `key` (None when absent); DoctorError when the script computes it at run time or it does not
    resolve (a broken interpolation)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        value = OmegaConf.select(config, key, default=None, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise DoctorError(f"{key} does not resolve: {err}".splitlines()[0]) from None
    if isinstance(value, str) and UNRESOLVED in value:
        raise _RunTimeValue(f"{key} is set from something the script computes at run time ({value})")
    return value


class _RunTimeValue(DoctorError):
    """A setting the launch script computes at run time (`shell.UNRESOLVED`)."""


def _number(config, key: str) -> float | None:
    """The number at `key`; None when absent or computed by the script at run time; DoctorError when not a number."""
    try:
        value = _get(config, key)
    except _RunTimeValue:
        return None
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        raise DoctorError(f"{key}={value!r} is not a number") from None


def _flag(config, key: str) -> bool:
    """The boolean at `key` (absent: False); DoctorError when it is neither true nor false."""
    value = _get(config, key)
    if value not in (None, True, False):
        raise DoctorError(f"{key}={value!r} is not True or False")
    return bool(value)


def _analyse(report: Report, config, script_env: str | None) -> None:
    from omegaconf import OmegaConf

    use_loss, use_reward = _flag(config, f"{_ACTOR}.use_kl_loss"), _flag(config, f"{_ALGO}.use_kl_in_reward")
    runtime_env = OmegaConf.select(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{ENV_VAR}", default=None)
    env_value = script_env or runtime_env
    default = activation.parse(env_value, setting=ENV_VAR if script_env else f"ray_kwargs.ray_init.runtime_env.env_vars."
                                                                           f"{ENV_VAR}")
    _regimes(report, config)
    _adapter_refusal(report, config, env_value)
    loss_type, agg = str(_get(config, f"{_ACTOR}.kl_loss_type")), str(_get(config, f"{_ACTOR}.loss_agg_mode"))
    if use_loss:
        _loss_path(report, config, loss_type, agg, default)
    if use_reward:
        _reward_path(report, config, agg, default)
    if use_loss and use_reward:
        report.add("double-kl", "bias", "KL in the reward (algorithm.use_kl_in_reward) and in the loss "
                   "(actor.use_kl_loss) at once: two betas in different units regularize twice (unbiased only for "
                   "the same value-unbiased estimator at one common beta, which verl's units never give)")
    if report.verdict in ("biased", "no-op", "refused"):
        report.fix = _fix(report, config, use_loss, use_reward, agg)
    _support(report, config)


def _support(report: Report, config) -> None:
    """The support matrix's verdict (`kl_adapters.support`) of every setting the configuration turns on, where
    kl-adapters' path runs (configured, or the fix): a note when tested, an `untested-path` / `refused-path` warning
    otherwise. Pinned by tests/verl/test_doctor.py::test_support_settings_print_their_verdict."""
    if report.fix is None and not any(p.native.source.startswith("kl_adapters/") for p in report.paths):
        return
    value = {key: _value(config, path) for key, path in _SUPPORT_KEYS.items()}
    strategy, sizes = value["strategy"], (value["ulysses"], value["fsdp ulysses"])
    on = {"lora": bool(value["lora_rank"]) or value["lora_adapter_path"] is not None,
          "vllm": value["rollout"] in ("vllm", "sglang"),
          "packing": value["use_remove_padding"] is True,
          "sequence-parallel": any(isinstance(n, int) and n > 1 for n in sizes),
          "sharding": strategy in ("fsdp", "fsdp2"),
          "megatron": strategy == "megatron",
          "data-parallel": isinstance(value["nnodes"], int) and isinstance(value["n_gpus_per_node"], int)
          and value["nnodes"] * value["n_gpus_per_node"] > 1,
          **support.vision_language_settings(value["model"], "verl"),
          "liger": value["use_liger"] is True,
          "dynamic-batch": value["use_dynamic_bsz"] is True,
          "off-policy": OFF in report.regimes}
    notes, warnings = support.doctor_lines("verl", [key for key, turned_on in on.items() if turned_on])
    report.notes += notes
    for code, message in warnings:
        report.add(code, "warning", message)


#: what `_support` reads: name -> config key
_SUPPORT_KEYS = {
    "strategy": f"{_ACTOR}.strategy", "use_dynamic_bsz": f"{_ACTOR}.use_dynamic_bsz",
    "ulysses": f"{_ACTOR}.ulysses_sequence_parallel_size",
    "fsdp ulysses": f"{_ACTOR}.fsdp_config.ulysses_sequence_parallel_size",
    **{k: f"actor_rollout_ref.model.{k}" for k in ("lora_rank", "lora_adapter_path", "use_remove_padding", "use_liger")},
    "model": "actor_rollout_ref.model.path", "rollout": "actor_rollout_ref.rollout.name",
    "nnodes": "trainer.nnodes", "n_gpus_per_node": "trainer.n_gpus_per_node",
}


def _value(config, key: str):
    """The value at `key`, None where the config lacks it or the script computes it at run time."""
    try:
        return _get(config, key)
    except DoctorError:
        return None


def _regimes(report: Report, config) -> None:
    batch, mini = _number(config, "data.train_batch_size"), _number(config, f"{_ACTOR}.ppo_mini_batch_size")
    epochs = _number(config, f"{_ACTOR}.ppo_epochs")
    if None in (batch, mini, epochs) or mini == 0:
        report.regimes = (ON, OFF)
        report.off_policy_reason = "batch sizes not resolved: both regimes shown"
        return
    steps = int(batch // mini) * int(epochs)
    if steps > 1:
        report.regimes = (ON, OFF)
        report.off_policy_reason = (f"{int(batch // mini)} mini-batch(es) x {int(epochs)} epoch(s) per rollout: "
                                    "later updates use a stale rollout")


@contextmanager
def _environment(value: str | None):
    saved = os.environ.get(ENV_VAR)
    os.environ.pop(ENV_VAR, None)
    if value:
        os.environ[ENV_VAR] = value
    try:
        yield
    finally:
        os.environ.pop(ENV_VAR, None)
        if saved is not None:
            os.environ[ENV_VAR] = saved


def _adapter_refusal(report: Report, config, env_value: str | None) -> None:
    """The adapter's refusal of this configuration (the same check its patched validate_config runs) as the "refused"
    hazard; a kl-adapters value it cannot parse ends the analysis (`refusals`)."""
    from ..adapters import verl as adapter
    from ..adapters._guard import UnsupportedFrameworkError

    with _environment(env_value):
        try:
            adapter.check_config(config)
        except activation.SettingError:
            raise
        except (ValueError, UnsupportedFrameworkError) as err:
            report.add("refused", "refused", f"kl-adapters refuses this configuration before Ray starts: {err}")


def _loss_path(report: Report, config, loss_type: str, agg: str, default) -> None:
    from ..adapters.verl import flag_settings

    coef = _number(config, f"{_ACTOR}.kl_loss_coef")
    setting = f"kl_loss_type={loss_type}, kl_loss_coef={coef}, loss_agg_mode={agg}"
    settings = flag_settings(loss_type, default)
    if settings is not None:
        report.paths.append(KLPath("loss", setting, coef, adapter_native(settings.spec, f"{loss_type}", "verl")))
        note_budget(report, settings, f"kl_loss_coef={coef}", "rollout", f"{_ACTOR}.kl_loss_type=kl_adapters:"
                    f"{settings.preset}:kl_target")
    else:
        kl = native.verl_loss(loss_type)
        report.paths.append(KLPath("loss", setting, coef, kl))
        if kl.preset is None:
            report.add("unsupported-estimator", "bias", kl.reason)
        if loss_type.rstrip("+") in ("low_var_kl", "k3") and not loss_type.endswith("+"):
            report.add("clamp", "warning", f"verl clamps k3's log-ratio to +-{native.VERL_K3_LOG_RATIO_CLAMP:g} and "
                       f"its value to +-{native.VERL_K3_VALUE_CLAMP:g}: zero gradient wherever k3 > "
                       f"{native.VERL_K3_VALUE_CLAMP:g} (a token the policy has nearly dropped)")
        if agg == "seq-mean-token-mean":
            report.add("length-normalized", "bias", "loss_agg_mode=seq-mean-token-mean divides each sequence's KL "
                       "by its own length: a length-normalized KL, not KL_seq")
    if coef == 0:
        report.add("zero-coefficient", "no-op", "actor.use_kl_loss=True with kl_loss_coef=0: a reference model is "
                   "computed and the KL adds nothing")


def _reward_path(report: Report, config, agg: str, default) -> None:
    from ..adapters.verl import REWARD_KEY, flag_settings

    penalty = str(_get(config, f"{_ALGO}.kl_penalty"))
    estimator = str(_get(config, f"{_ALGO}.adv_estimator"))
    ctrl, coef = str(_get(config, f"{_ALGO}.kl_ctrl.type")), _number(config, f"{_ALGO}.kl_ctrl.kl_coef")
    setting = f"kl_penalty={penalty}, kl_coef={coef} ({ctrl}), adv_estimator={estimator}"
    settings = flag_settings(penalty, default, REWARD_KEY)
    if ctrl == "adaptive":
        target, length = _number(config, f"{_ALGO}.kl_ctrl.target_kl"), _number(config, "data.max_response_length")
        report.add("adaptive-controller", "warning", "kl_ctrl.type=adaptive compares target_kl with the batch mean "
                   "of each sequence's token-mean KL (ray_trainer.py:108-112): a per-token unit, not KL_seq; beta then "
                   "varies with response length" + ("" if not target else "; " + per_token_target(
                       target, None if length is None else int(length), f"{_ALGO}.kl_penalty='kl_adapters:reward:"
                       "kl_target=<that>' (with kl_ctrl.type=fixed)")))
    if settings is not None:
        report.paths.append(KLPath("reward", setting, coef, adapter_native(settings.spec, penalty, "verl")))
        note_budget(report, settings, f"kl_ctrl.kl_coef={coef}", "rollout",
                    f"{_ALGO}.kl_penalty=kl_adapters:{settings.preset}:kl_target")
        return
    kl = native.verl_reward(penalty, to_go=estimator in _TO_GO)
    report.paths.append(KLPath("reward", setting, coef, kl))
    if kl.preset is None:
        report.add("unsupported-estimator", "bias", kl.reason)
    if penalty.rstrip("+") in ("low_var_kl", "k3"):
        report.add("clamp", "warning", f"verl clamps k3's value to +-{native.VERL_K3_VALUE_CLAMP:g}: the reward "
                   "misses the KL of tokens beyond the clamp")
    if estimator == "grpo" and _flag(config, f"{_ALGO}.norm_adv_by_std_in_grpo"):
        report.add("std-normalized-reward", "bias", "adv_estimator=grpo divides the summed reward, KL included, by "
                   "its group's std: beta becomes prompt-dependent and the KL enters that std (biased direction)")
    elif estimator == "grpo":
        report.add("mean-baseline", "warning", "adv_estimator=grpo without std: the group mean includes the sample "
                   "itself, which scales the KL gradient by 1 - 1/G (direction unbiased, beta shrunk)")
    gamma, lam = _number(config, f"{_ALGO}.gamma"), _number(config, f"{_ALGO}.lam")
    if estimator in _TO_GO and gamma is not None and gamma != 1.0:
        report.add("discounted", "bias", f"algorithm.gamma={gamma:g}: a discounted KL reward-to-go is not the "
                   "gradient of the sequence KL")
    if estimator == "gae" and lam is not None and lam != 1.0:
        report.add("gae-lambda", "bias", f"algorithm.lam={lam:g} bootstraps the KL return from the critic: exact "
                   "only at lam = 1")
    if agg == "seq-mean-token-mean":
        report.add("length-normalized", "bias", "loss_agg_mode=seq-mean-token-mean divides each sequence's KL "
                   "return by its own length in the policy loss: a length-normalized KL")
    if coef == 0 and ctrl != "adaptive":
        report.add("zero-coefficient", "no-op", "algorithm.use_kl_in_reward=True with kl_ctrl.kl_coef=0: the KL "
                   "reward is always zero")


def _fix(report: Report, config, use_loss: bool, use_reward: bool, agg: str) -> Fix:
    """Reward path alone and on-policy: kl_adapters:reward there; otherwise the actor loss with `sequence`."""
    on_policy = report.regimes == (ON,)
    agg_line = [f"{_ACTOR}.loss_agg_mode=token-mean"] if agg == "seq-mean-token-mean" else []
    if use_reward and not use_loss and on_policy:
        coef = [] if _number(config, f"{_ALGO}.kl_ctrl.kl_coef") else [f"{_ALGO}.kl_ctrl.kl_coef=0.001"]
        return Fix("reward", (f"{_ALGO}.kl_penalty=kl_adapters:reward", *coef, *agg_line), BETA_REWARD)
    coef = [] if _number(config, f"{_ACTOR}.kl_loss_coef") else [f"{_ACTOR}.kl_loss_coef=0.001"]
    return Fix("sequence", (f"{_ACTOR}.use_kl_loss=True", f"{_ACTOR}.kl_loss_type=kl_adapters:sequence", *coef,
                            f"{_ALGO}.use_kl_in_reward=False", *agg_line), BETA_LOSS)
