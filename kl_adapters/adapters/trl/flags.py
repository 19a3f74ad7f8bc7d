"""TRL adapter, the flag: which KL settings a trainer runs with (KLGRPOConfig's fields, else KL_ADAPTERS /
``kl_adapters.enable``), checked as every path checks them (`activation.validate`), and the refusals of a preset with
``beta = 0`` (a silent no-op).

Activation (tests/trl/test_activation.py): ``kl_preset``, ``--kl_preset`` and ``KL_ADAPTERS`` accept and refuse the
same values (`field_settings`, `activation.validate`); a refused KL_ADAPTERS stops the import of GRPOTrainer with its
one line; a preset with ``beta = 0`` is refused (a silent no-op) on every path; GRPOTrainer.__init__ logs
``kl-adapters: preset ... active in trl <release> (KL path: loss; ...)`` once per process
(`trainer_init._checked_init`).

Bias-variance dial (``KLGRPOConfig(kl_discount=gamma)``, ``--kl_discount``; `discount_of`): the preset's future-KL
return sum_{s>t} KL_s becomes sum_{s>t} gamma^(s-t) KL_s (``discount=`` of kl_term / kl_statistics / the
full-vocabulary surrogate, at loss and rollout time alike): lower gradient variance at long completions, biased for
gamma < 1 (the exact bias: ``kl-adapters audit --discount``, and the doctor's report). Refused for presets without that
return and without kl_preset (silent no-ops). Measured in docs/long_horizon.md. Pinned by tests/trl/test_long_horizon.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ... import activation
from ..._validate import check_discount
from ...activation import Settings

if TYPE_CHECKING:  # pragma: no cover
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer


#: the beta a KL budget starts from where the config leaves TRL's default beta = 0 (no KL term, no reference model):
#: beta is then only the controller's starting value. 0.04 is the GRPO paper's KL coefficient (DeepSeekMath); in the
#: budget measurements (docs/kl_budget.md) runs started above the final beta ended nearer pi* than runs started
#: below it. Pinned by tests/trl/test_budget.py::test_budget_with_trls_default_beta_starts_at_the_start_beta.
BUDGET_START_BETA = 0.04


def field_settings(kl_preset: str | None, kl_is_clip: float | None = None, kl_target: float | None = None,
                   kl_discount: float | None = None) -> Settings | None:
    """The settings KLGRPOConfig's fields select (TrlParser: --kl_preset, --kl_is_clip, --kl_target, --kl_discount):
    kl_preset's value, with kl_is_clip / kl_target in place of its own options; None without kl_preset (KL_ADAPTERS
    then applies, with kl_target as its budget). SettingError naming the fields for what every path refuses
    (`activation.checked`), kl_is_clip or kl_discount without kl_preset (silent no-ops), two different budgets and a
    kl_discount the preset cannot take. KLGRPOConfig and the doctor call it. Pinned by tests/trl/test_activation.py."""
    given = {"kl_preset": kl_preset, "kl_is_clip": kl_is_clip, "kl_target": kl_target, "kl_discount": kl_discount}
    where = ", ".join(f"{key}={value!r}" for key, value in given.items() if value is not None)
    settings = activation.parse(kl_preset, setting="kl_preset")
    if settings is None:
        if kl_is_clip is not None or kl_discount is not None:
            raise activation.SettingError(f"{where}: kl_is_clip and kl_discount need kl_preset (without it they would "
                                          "be silent no-ops); set kl_preset, e.g. 'sequence'")
        return None
    if None not in (kl_target, settings.kl_target) and kl_target != settings.kl_target:
        raise activation.SettingError(f"{where}: two KL budgets; give one")
    settings = activation.checked(Settings(settings.preset, settings.is_clip if kl_is_clip is None else kl_is_clip,
                                           settings.kl_target if kl_target is None else kl_target), where)
    if kl_discount is not None:
        try:
            check_discount(kl_discount, settings.spec)
        except ValueError as err:
            raise activation.SettingError(f"{where}: {err}") from None
    return settings


def start_budget(args: GRPOConfig) -> None:
    """A KL budget on a config whose beta is TRL's default 0 starts from BUDGET_START_BETA: beta is only the
    controller's starting value, and TRL builds its reference model only for beta > 0, so this must happen before
    GRPOTrainer.__init__ (KLGRPOConfig.__post_init__, and `_checked_init` for KL_ADAPTERS)."""
    settings = settings_of(args)
    if settings is not None and settings.kl_target is not None and args.beta == 0.0:
        args.beta = BUDGET_START_BETA


def _zero_beta(setting: str) -> str:
    return (f"{setting} with beta=0.0 would be a silent no-op: TRL builds no reference model when beta == 0; set beta > "
            f"0 (or kl_target, a KL budget, which starts from beta={BUDGET_START_BETA})")


def settings_for(trainer: GRPOTrainer) -> Settings | None:
    """The KL settings of a trainer: its config's kl_preset if set, else enable()/KL_ADAPTERS (`settings_of`)."""
    return settings_of(trainer.args)


def settings_of(args: GRPOConfig) -> Settings | None:
    """The KL settings of a TRL config: its kl_preset if set (with kl_is_clip, or the value's own is_clip), else
    enable()/KL_ADAPTERS; a kl_target field (KLGRPOConfig) sets the budget of either."""
    preset = getattr(args, "kl_preset", None)
    settings = activation.resolve(preset, setting="kl_preset")
    if preset not in (None, "") and settings is not None:
        is_clip = args.kl_is_clip if args.kl_is_clip is not None else settings.is_clip
        settings = Settings(settings.preset, is_clip, settings.kl_target)
    target = getattr(args, "kl_target", None)
    if settings is not None and target is not None:
        settings = replace(settings, kl_target=target)
    return settings


def discount_of(args: GRPOConfig) -> float:
    """gamma of the preset's future-KL return: KLGRPOConfig's kl_discount, 1 (exact) when unset."""
    discount = getattr(args, "kl_discount", None)
    return 1.0 if discount is None else discount
