"""TRL adapter: GRPOTrainer (and GMPOTrainer) get an exact-gradient KL term; RLOOTrainer is checked, not patched.

Flag (TRL's idiom, a config field): ``KLGRPOConfig(kl_preset="sequence", beta=0.04, ...)`` in place of ``GRPOConfig``
(``--kl_preset sequence`` with ``TrlParser``), or, with no code change, ``KL_ADAPTERS=sequence`` /
``kl_adapters.enable("sequence")``; the config field wins. Unset: TRL runs its own code, unchanged.

What changes when it is set (one wrapper around ``GRPOTrainer.compute_loss``):
    TRL computes its policy loss as usual but with ``beta = 0`` for that call, so its k3 term is skipped; the wrapper
    then adds  ``kl_surrogate(logp, ref_logp, mask, preset=..., beta=beta_seq, old_logp=behaviour_logp)``  on the
    policy log-probs of the same forward pass. Its gradient is beta_seq * (1/B) * sum_b sum_t c_bt grad log pi_bt
    (c = the preset's weight; for "sequence" an unbiased estimate of grad KL_seq on- and off-policy).
    Pinned by tests/trl/test_grpo_gradients.py.

Meaning of TRL's ``beta``: unchanged relative to the policy loss. TRL adds beta * KL_t per token and divides every
token of the loss by the loss type's normaliser D; the adapter uses beta_seq = beta * B / D with TRL 1.16's own D, so
the KL has exactly the weight relative to the task loss it has natively (the "token" preset reproduces TRL's default
``use_bias_correction_kl=True`` gradient bit for bit: tests/trl/test_grpo_gradients.py::test_token_preset_is_native_trl).
``grpo``, ``sapo`` and GMPO normalise each sequence by its own length, which would regularize a length-normalized KL,
not KL_seq; for them the adapter uses the constant D = B * max_completion_length (as ``dr_grpo`` does).

Behaviour policy for the importance weights: vLLM's sampling log-probs when TRL has them (tokens vLLM could not score
fall back to the trainer's old log-probs), else ``old_per_token_logps`` (num_iterations > 1 or steps_per_generation
not dividing gradient_accumulation_steps), else on-policy. Works for every loss_type, both importance_sampling_levels
and PEFT/LoRA (TRL's reference log-probs, adapter-disabled base, are used as they are).

Metrics: TRL's ``kl`` keeps its meaning (token-mean of k3, times pi/pi_old when use_bias_correction_kl); added beside
it: ``kl_adapters/seq_kl`` (mean per-sequence KL estimate, sum_t w_{1:t} k3_t) and ``kl_adapters/grad_weight_gap``
(sum |c_native - c_preset| / sum |c_preset| over the batch's tokens: how far TRL's own KL gradient would be from the
preset's on this batch; 0 means no difference).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from trl import GRPOConfig  # not a trigger module: importing it patches nothing (see adapters/__init__.py)

from .. import activation, native
from ..activation import Settings
from .._validate import check_is_clip
from ..surrogate import KLTerm, kl_term
from ._guard import ALLOW_UNTESTED_ENV, UnsupportedFrameworkError, require_version

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer

_GRPO_MODULE = "trl.trainer.grpo_trainer"
logger = logging.getLogger(__name__)

#: loss types whose policy loss is divided by a per-batch constant D, which the KL term shares
_CONSTANT_NORMALISER = ("dapo", "cispo", "vespo", "bnpo", "dr_grpo", "luspo")
#: loss types that divide each sequence by its own length; the KL term uses D = B * max_completion_length instead
_LENGTH_NORMALISED = ("grpo", "sapo")


@dataclass
class KLGRPOConfig(GRPOConfig):
    """GRPOConfig with kl-adapters' flag.

    Parameters:
        kl_preset (`str` or `None`, *optional*, defaults to `None`):
            KL configuration that replaces TRL's KL term when `beta > 0`: `"sequence"` (unbiased gradient of the
            sequence-level KL(pi || pi_ref), on- and off-policy), `"reward"` (unbiased on-policy), or any preset of
            `kl-adapters presets`. `None` defers to the `KL_ADAPTERS` environment variable; `"off"` disables.
        kl_is_clip (`float` or `None`, *optional*, defaults to `None`):
            Cap on the importance weights the preset applies off-policy (lower variance, biased). `None`: exact.
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

    def __post_init__(self):
        super().__post_init__()
        settings = activation.parse(self.kl_preset)  # unknown names raise, listing the valid presets
        check_is_clip(self.kl_is_clip)
        if self.kl_is_clip is not None and settings is None:
            raise ValueError("kl_is_clip is set but kl_preset is not: it would be a silent no-op")
        if settings is not None:
            if self.beta == 0.0:
                raise ValueError(f"kl_preset={self.kl_preset!r} with beta=0.0 would be a silent no-op: TRL builds no "
                                 "reference model when beta == 0; set beta > 0")
            patch(_GRPO_MODULE)  # the field must take effect on any GRPOTrainer


def settings_for(trainer: GRPOTrainer) -> Settings | None:
    """The KL settings of a trainer: its config's kl_preset if set, else enable()/KL_ADAPTERS."""
    preset = getattr(trainer.args, "kl_preset", None)
    settings = activation.resolve(preset)
    if preset not in (None, "") and settings is not None:
        return Settings(settings.preset, trainer.args.kl_is_clip)
    return settings


def _check_code_path(trainer: GRPOTrainer) -> None:
    """Refuse configurations the adapter is not tested with (never patch silently wrong)."""
    if trainer.args.use_liger_kernel and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedFrameworkError(
            "kl-adapters is not tested with use_liger_kernel=True (Liger needs a GPU; in trl 1.16 it only swaps layer "
            f"kernels and the loss path is unchanged). Set {ALLOW_UNTESTED_ENV}=1 to proceed anyway.")
    if _normaliser_kind(trainer) is None:
        raise UnsupportedFrameworkError(
            f"{type(trainer).__name__} overrides _compute_loss with an aggregation kl-adapters does not know; "
            "supported: GRPOTrainer (every loss_type) and trl.experimental GMPOTrainer")


def _normaliser_kind(trainer: GRPOTrainer) -> str | None:
    """Which aggregation TRL 1.16 applies to this trainer's policy loss: a loss_type, "gmpo", or None (unknown)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    impl = type(trainer)._compute_loss
    if impl is GRPOTrainer._compute_loss:
        return trainer.loss_type if trainer.loss_type in _CONSTANT_NORMALISER + _LENGTH_NORMALISED else None
    try:
        from trl.experimental.gmpo import GMPOTrainer
    except ImportError:  # pragma: no cover - trl without experimental
        return None
    return "gmpo" if isinstance(trainer, GMPOTrainer) and impl is GMPOTrainer._compute_loss else None


def per_token_normaliser(trainer: GRPOTrainer, inputs: dict, mask: torch.Tensor) -> float | torch.Tensor:
    """D such that TRL 1.16 divides each token of this micro-batch's policy loss by D (grpo_trainer.py:3152-3185).

    For the length-normalised kinds (grpo, sapo, gmpo) returns B * max_completion_length (see module docstring).
    """
    train = trainer.model.training
    accumulation = trainer.current_gradient_accumulation_steps if train else 1
    batch = mask.shape[0]
    kind = _normaliser_kind(trainer)
    if kind in ("dapo", "cispo", "vespo"):
        items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        return items * accumulation / trainer.args.steps_per_generation if train else items
    if kind == "bnpo":
        return mask.sum().clamp(min=1.0) * accumulation
    if kind == "luspo":
        return batch * accumulation
    return batch * trainer.max_completion_length * accumulation  # dr_grpo, and grpo / sapo / gmpo by choice


def behaviour_logps(inputs: dict, logp: torch.Tensor) -> torch.Tensor | None:
    """Log-probs of the policy that sampled the batch: vLLM's where it scored the token, else the trainer's old ones.

    None means on-policy (TRL skips old log-probs when the batch is used within one optimizer step).
    """
    old = inputs.get("old_per_token_logps")
    sampling = inputs.get("sampling_per_token_logps")
    if sampling is None:
        return old
    fallback = old if old is not None else logp.detach()
    return torch.where(torch.isnan(sampling), fallback, sampling)


def _native_preset(trainer: GRPOTrainer) -> str:
    """The preset whose per-token gradient TRL's own KL term has, at token-level importance sampling
    (`native.trl_grpo_loss`; at sequence level the native gradient has an extra term no preset has)."""
    return native.trl_grpo_loss(trainer.args.use_bias_correction_kl).preset


def _log_metrics(trainer, mode, logp, ref, mask, behaviour, term: KLTerm) -> None:
    reduce = functools.partial(trainer.accelerator.reduce, reduction="sum")
    lp = logp.detach().float()
    m = mask.float()
    d = ref.float() - lp
    k3 = torch.expm1(d) - d
    if trainer.args.use_bias_correction_kl:
        k3 = k3 * torch.exp(lp - (lp if behaviour is None else behaviour.float()))
    c_native = term.coefficients_of(_native_preset(trainer))
    seq = term.sequence_kl
    totals = reduce(torch.stack([
        (k3 * m).sum(), m.sum(), seq.sum(), torch.tensor(float(seq.numel()), device=seq.device),
        (c_native - term.coefficients).abs().sum(), term.coefficients.abs().sum(),
    ]).float()).tolist()
    metrics = trainer._metrics[mode]
    metrics["kl"].append(totals[0] / max(totals[1], 1.0))
    metrics["kl_adapters/seq_kl"].append(totals[2] / max(totals[3], 1.0))
    metrics["kl_adapters/grad_weight_gap"].append(totals[4] / totals[5] if totals[5] > 0 else 0.0)


def _compute_loss_with_kl(original, self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GRPOTrainer.compute_loss with the KL term replaced by the active preset (see module docstring)."""
    settings = settings_for(self)
    if settings is None or self.beta == 0.0:
        if settings is not None and not getattr(self, "_kl_adapters_warned", False):
            self._kl_adapters_warned = True
            logger.warning("kl-adapters: KL preset %r is set but beta == 0, so there is no KL term to replace", str(settings))
        return original(self, model, inputs, return_outputs, num_items_in_batch)
    _check_code_path(self)
    captured: list[torch.Tensor] = []
    forward = self._get_per_token_logps_and_entropies

    def capture(*args, **kwargs):  # the first forward inside _compute_loss is the policy's, with gradient
        out = forward(*args, **kwargs)
        if not captured:
            captured.append(out[0])
        return out

    beta, self.beta = self.beta, 0.0  # TRL skips its own KL term (and its `kl` metric) for this call
    self._get_per_token_logps_and_entropies = capture
    try:
        loss = original(self, model, inputs, return_outputs, num_items_in_batch)
    finally:
        self.beta = beta
        del self._get_per_token_logps_and_entropies
    logp = captured[0]
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    ref = inputs["ref_per_token_logps"]
    behaviour = behaviour_logps(inputs, logp)
    beta_seq = beta * mask.shape[0] / per_token_normaliser(self, inputs, mask)
    term = kl_term(logp, ref, mask, preset=settings.preset, old_logp=behaviour, is_clip=settings.is_clip)
    kl = term.surrogate(beta_seq)
    _log_metrics(self, "train" if self.model.training else "eval", logp, ref, mask, behaviour, term)
    return loss + kl.to(loss.dtype)


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
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.gradient_accumulation_steps % generate_every != 0 or self.normalize_advantages:
            raise UnsupportedFrameworkError(
                f"KL_ADAPTERS={settings} cannot be applied to RLOOTrainer: its KL (k1 summed into the reward) is "
                "only unbiased on-policy without normalize_advantages. Use num_iterations=1, steps_per_generation "
                "dividing gradient_accumulation_steps and normalize_advantages=False, or GRPOTrainer with kl-adapters.")
        logger.info("kl-adapters: RLOOTrainer's KL is already unbiased on-policy (k1 in the reward); left unchanged")

    return init


_ORIGINAL = "__kl_adapters_original__"


def _wrap(owner: type, name: str, make) -> None:
    current = owner.__dict__[name]
    if getattr(current, _ORIGINAL, None) is not None:
        return
    wrapped = make(current)
    setattr(wrapped, _ORIGINAL, current)
    setattr(owner, name, wrapped)


def _unwrap(owner: type, name: str) -> None:
    original = getattr(owner.__dict__.get(name), _ORIGINAL, None)
    if original is not None:
        setattr(owner, name, original)


def _kl_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return _compute_loss_with_kl(original, self, model, inputs, return_outputs, num_items_in_batch)

    return compute_loss


def patch(trigger: str) -> None:
    """Install the wrappers (idempotent); they fall through to TRL's code while no preset is set.

    Refuses trl versions outside versions.TESTED. `trigger` is the TRL module just imported (see activation.ADAPTERS).
    """
    require_version("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    _wrap(GRPOTrainer, "compute_loss", _kl_compute_loss)
    rloo = sys.modules.get("trl.trainer.rloo_trainer")
    if rloo is not None and hasattr(rloo, "RLOOTrainer"):
        _wrap(rloo.RLOOTrainer, "__init__", _check_rloo)


def unpatch() -> None:
    """Restore TRL's original methods."""
    _unwrap(sys.modules[_GRPO_MODULE].GRPOTrainer, "compute_loss")
    rloo = sys.modules.get("trl.trainer.rloo_trainer")
    if rloo is not None:
        _unwrap(rloo.RLOOTrainer, "__init__")
