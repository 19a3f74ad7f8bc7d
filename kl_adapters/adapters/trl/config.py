"""TRL adapter, TRL's idiom for the flag: `KLGRPOConfig`, GRPOConfig with kl-adapters' fields (``--kl_preset`` and
the others with ``TrlParser``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig  # not a trigger module: importing it patches nothing (see adapters/__init__.py)

from ... import activation
from .budget import check_budget
from .flags import _zero_beta, field_settings, settings_of, start_budget
from .sites import _GRPO_MODULE, patch


@dataclass
class KLGRPOConfig(GRPOConfig):
    """GRPOConfig with kl-adapters' flag.

    Parameters:
        kl_preset (`str` or `None`, *optional*, defaults to `None`):
            KL configuration that replaces TRL's KL term when `beta > 0`: `"sequence"` (unbiased gradient of the
            sequence-level KL(pi || pi_ref), on- and off-policy), `"reward"` (unbiased on-policy), `"full"` (exact KL
            over the vocabulary, lowest variance; runs the reference at loss time), or any preset of
            `kl-adapters presets`. `None` defers to the `KL_ADAPTERS` environment variable; `"off"` disables.
        kl_is_clip (`float` or `None`, *optional*, defaults to `None`):
            Cap on the importance weights the preset applies off-policy (lower variance, biased). `None`: exact.
        kl_target (`float` or `None`, *optional*, defaults to `None`):
            KL budget: target KL(pi || pi_ref) per completion, in nats. `beta` becomes the starting value of a
            controller that adjusts it once per optimizer step so that the sequence KL tracks the target
            (`kl_adapters.budget`). Needs a preset unbiased for the sequence KL. `None`: `beta` stays fixed.
        kl_discount (`float` or `None`, *optional*, defaults to `None`):
            The bias-variance dial: gamma in (0, 1] of the preset's future-KL return, sum_{s>t} gamma^(s-t) KL_s in
            place of sum_{s>t} KL_s (lower gradient variance at long completions, biased; `kl-adapters audit
            --discount` gives the exact bias). Only for presets with that return (sequence, reward, their `-plain`
            forms, full). `None` or 1: the exact sequence-level KL gradient.
    """

    kl_preset: str | None = field(
        default=None,
        metadata={"help": "kl-adapters KL configuration replacing TRL's KL term (e.g. 'sequence', 'reward'); "
                          "None defers to the KL_ADAPTERS environment variable, 'off' disables."},
    )
    kl_is_clip: float | None = field(
        default=None,
        metadata={"help": "Cap on the importance weights of the KL preset (biased, lower variance); None: exact."},
    )
    kl_target: float | None = field(
        default=None,
        metadata={"help": "KL budget: target KL(pi || pi_ref) per completion in nats; beta starts at `beta` and is "
                          "adjusted every optimizer step to track it. None: beta stays fixed."},
    )
    kl_discount: float | None = field(
        default=None,
        metadata={"help": "gamma in (0, 1] of the KL preset's future-KL return (< 1: lower variance, biased; for "
                          "sequence, reward, their -plain forms, full). None: 1, the exact gradient."},
    )

    def __post_init__(self):
        super().__post_init__()
        settings = field_settings(self.kl_preset, self.kl_is_clip, self.kl_target, self.kl_discount)
        if settings is None and self.kl_target is None:
            return
        start_budget(self)
        if settings is not None and self.beta == 0.0:
            raise activation.SettingError(_zero_beta(f"kl_preset={self.kl_preset!r}"))
        resolved = settings_of(self)  # kl_target without kl_preset budgets KL_ADAPTERS' preset, if there is one
        if resolved is None or resolved.kl_target is not None:
            check_budget(self)
        patch(_GRPO_MODULE)  # the field must take effect on any GRPOTrainer
