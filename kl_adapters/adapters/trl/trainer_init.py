"""TRL adapter, the trainers' construction: GRPOTrainer.__init__ under kl-adapters' settings (`_checked_init`) and
RLOOTrainer.__init__, checked, not patched (`_check_rloo`)."""

from __future__ import annotations

import functools
import inspect
import logging

from ... import activation
from .._guard import UnsupportedFrameworkError
from .budget import KLBudgetCallback, budget_of, check_budget
from .flags import _zero_beta, settings_for, start_budget

logger = logging.getLogger(__name__)


def _checked_init(original_init):
    """GRPOTrainer.__init__ under kl-adapters' settings (KLGRPOConfig's fields, else KL_ADAPTERS / enable()): a KL budget
    on beta 0 starts from BUDGET_START_BETA (`start_budget`, before TRL decides whether to build a reference model);
    then a preset with beta 0 is refused (a silent no-op), a budget gets its checks and `KLBudgetCallback`, and the
    activation line is logged (`activation.announce`). Without settings, TRL's __init__ alone."""
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        config = signature.bind_partial(self, *args, **kwargs).arguments.get("args")
        if config is not None:
            start_budget(config)
        original_init(self, *args, **kwargs)
        settings = settings_for(self)
        if settings is None:
            return
        flag = "kl_preset" if getattr(self.args, "kl_preset", None) else activation.ENV_VAR
        if self.beta == 0.0:
            raise activation.SettingError(_zero_beta(f"{flag}={str(settings)!r}"))
        _check_sharded_head(self, settings, flag)
        if settings.kl_target is not None and budget_of(self) is None:
            check_budget(self.args)
            self.add_callback(KLBudgetCallback(settings.kl_target, self.beta))
        activation.announce("trl", "loss", settings, f"beta {self.beta:g}")

    return init


def _check_sharded_head(trainer, settings, flag: str) -> None:
    """Refuse preset `full` where the policy's output projection is sharded (DeepSpeed ZeRO-3, FSDP): its loss takes a
    gradient through lm_head.weight after the model's forward, where neither framework gathers the weight or reduces
    its gradient. The reduced presets' pi(EOS) read needs no gradient and gathers the weight itself (`eos._head_gap`).
    Pinned by tests/trl/test_sharded_eos.py::test_full_is_refused_under_sharding."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    sharding = "DeepSpeed ZeRO-3" if is_deepspeed_zero3_enabled() else "FSDP" if trainer.is_fsdp_enabled else None
    refusal = sharded_head_refusal(settings, flag, sharding)
    if refusal is not None:
        raise UnsupportedFrameworkError(refusal)


def sharded_head_refusal(settings, flag: str, sharding: str | None) -> str | None:
    """The one-line refusal of `settings` under `sharding` ("DeepSpeed ZeRO-3", "FSDP", None: unsharded), or None when
    it runs: the trainer's check above and the doctor's reading of a configuration (doctor/trl.py) share it."""
    if not settings.spec.needs_full_logits or sharding is None:
        return None
    return (f"{flag}={str(settings)!r} is refused under {sharding}: its gradient through lm_head.weight is taken after "
            "the model's forward, where the sharded weight is neither gathered nor its gradient reduced; use "
            "'sequence'")


def _check_rloo(original_init):
    """RLOOTrainer.__init__ that refuses what the active preset cannot deliver, and leaves the exact case unchanged.

    RLOO puts sum_t k1_t (detached) in the sequence reward with a leave-one-out baseline: the `reward-sum` configuration,
    unbiased on-policy (tests/trl/test_rloo.py). Off-policy (stale k1, clipped sequence ratio) or with
    normalize_advantages (the KL divided by the batch std) it is biased and kl-adapters cannot fix it without rewriting
    RLOO's generation step, so an active flag raises there instead of being a silent no-op.
    """

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        settings = activation.active()
        if settings is None or self.beta == 0.0:
            return
        if settings.kl_target is not None:
            raise UnsupportedFrameworkError(f"KL_ADAPTERS={settings}: RLOOTrainer is checked, not patched, by "
                                            "kl-adapters, so a KL budget (kl_target) cannot adjust its beta; use "
                                            "GRPOTrainer with kl-adapters")
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.gradient_accumulation_steps % generate_every != 0 or self.normalize_advantages:
            raise UnsupportedFrameworkError(
                f"KL_ADAPTERS={settings} cannot be applied to RLOOTrainer: its KL (k1 summed into the reward) is "
                "only unbiased on-policy without normalize_advantages. Use num_iterations=1, steps_per_generation "
                "dividing gradient_accumulation_steps and normalize_advantages=False, or GRPOTrainer with kl-adapters.")
        logger.info("kl-adapters: RLOOTrainer's KL is already unbiased on-policy (k1 in the reward); left unchanged")

    return init
