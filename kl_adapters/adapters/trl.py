"""TRL adapter: GRPOTrainer (and GMPOTrainer) get an exact-gradient KL term; RLOOTrainer is checked, not patched.

Flag (TRL's idiom, a config field): ``KLGRPOConfig(kl_preset="sequence", beta=0.04, ...)`` in place of ``GRPOConfig``
(``--kl_preset sequence`` with ``TrlParser``), or, with no code change, ``KL_ADAPTERS=sequence`` /
``kl_adapters.enable("sequence")``; the config field wins. Unset: TRL runs its own code, unchanged. A KL budget
(``kl_target``) is described below.

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

Batch statistics of the variance-reduced presets ("sequence", "reward"; see kl_adapters.reductions): the
leave-one-out control-variate coefficient and baseline of each row must come from OTHER samples, the more the better,
while TRL's loss sees micro-batches of ``per_device_train_batch_size`` rows (default 8). Where TRL already has the
policy's log-probs of the whole generation batch at rollout time (``old_per_token_logps``: num_iterations > 1 or
steps_per_generation not dividing gradient_accumulation_steps; vLLM's ``sampling_per_token_logps``), a wrapper around
``_generate_and_score_completions`` computes ``kl_statistics`` there, leave-one-out within each GRPO group (the
``num_generations`` completions of one prompt), and stores them as [B] / [B, T] tensors of the batch dict
(``ROLLOUT_STATISTICS_KEYS``), which TRL's own ``shuffle_sequence_dict`` / ``split_tensor_dict`` permute and slice with
the rest into micro-batches; the loss uses the micro-batch's rows. Otherwise (TRL's on-policy default, where it skips
that forward pass) no forward pass is added: the statistics are leave-one-out over the micro-batch's own rows at loss
time (with several processes, over the rows of every process's micro-batch: `_statistics_across_processes`), within
each prompt's group (``GROUP_KEY``, stored at generation and carried by TRL's shuffle / split like the
statistics; a row with fewer than two other rows of its prompt in the micro-batch gets the plain form). With TRL's
defaults (per_device_train_batch_size = num_generations = 8, gradient_accumulation_steps = 1) that micro-batch IS the
whole generation batch, one group of 8. Either way row b's statistics are functions of the other rows only, so the
expected gradient is unchanged (tests/core/test_batch_exactness.py; the trainer identity with the stored statistics:
tests/trl/test_statistics.py).

Task advantages and end-of-sequence probabilities the statistics are fitted with: `statistics_inputs`.

Metrics: TRL's ``kl`` keeps its meaning (token-mean of k3, times pi/pi_old when use_bias_correction_kl); added beside
it: ``kl_adapters/seq_kl`` (mean per-sequence KL estimate, sum_t w_{1:t} k3_t), ``kl_adapters/grad_weight_gap``
(sum |c_native - c_preset| / sum |c_preset| over the batch's tokens: how far TRL's own KL gradient would be from the
preset's on this batch; 0 means no difference) and ``kl_adapters/is_ess`` (effective sample size of the micro-batch's
full-sequence importance weights, 1 on-policy, towards 1/B as they degenerate; averaged over the logging window).

KL budget (``KLGRPOConfig(kl_target=<nats>)``, ``--kl_target``, ``KL_ADAPTERS=<preset>:kl_target=<nats>``):
`KLBudgetCallback`. Pinned by tests/trl/test_budget.py.

Activation (tests/trl/test_activation.py): ``kl_preset``, ``--kl_preset`` and ``KL_ADAPTERS`` accept and refuse the
same values (`field_settings`, `activation.validate`); a refused KL_ADAPTERS stops the import of GRPOTrainer with its
one line; a preset with ``beta = 0`` is refused (a silent no-op) on every path; GRPOTrainer.__init__ logs
``kl-adapters: preset ... active in trl <release> (KL path: loss; ...)`` once per process (`_checked_init`).

Bias-variance dial (``KLGRPOConfig(kl_discount=gamma)``, ``--kl_discount``): the preset's future-KL return
sum_{s>t} KL_s becomes sum_{s>t} gamma^(s-t) KL_s (``discount=`` of kl_term / kl_statistics / the full-vocabulary
surrogate, at loss and rollout time alike): lower gradient variance at long completions, biased for gamma < 1 (the
exact bias: ``kl-adapters audit --discount``, and the doctor's report). Refused for presets without that return and
without kl_preset (silent no-ops). Measured in docs/long_horizon.md. Pinned by tests/trl/test_long_horizon.py.

Preset ``full`` (exact KL_t over the vocabulary, reference run in the trainer process): `_full_kl`. Pinned by
tests/trl/test_full.py.

Releases (versions.TESTED["trl"]) and what differs between them: `_check_code_path`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from trl import GRPOConfig  # not a trigger module: importing it patches nothing (see adapters/__init__.py)

from .. import activation, native
from ..activation import Settings
from .._validate import check_discount
from ..budget import DEFAULT_RULE, KLBudget, check_budget_preset
from ..full_vocab import full_kl_surrogate_from_hidden
from ..presets import get_preset
from ..reductions import EndOfSequence, KLStatistics, TaskAdvantages
from ..surrogate import KLTerm, kl_statistics, kl_term
from ._guard import ALLOW_UNTESTED_ENV, UnsupportedFrameworkError, require_version
from .budget_wiring import restore
from .end_of_sequence import eos_token_ids as read_eos_token_ids
from .end_of_sequence import token_ids
from .metrics import GRAD_WEIGHT_GAP, IS_ESS, SEQ_KL
from .patching import Site, install, uninstall

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer

_GRPO_MODULE = "trl.trainer.grpo_trainer"
_RLOO_MODULE = "trl.trainer.rloo_trainer"
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
            check_discount(kl_discount, get_preset(settings.preset))
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


def _check_code_path(trainer: GRPOTrainer) -> None:
    """Refuse configurations the adapter is not tested with (never patch silently wrong).

    Releases (versions.TESTED["trl"]: 1.14.0, 1.14.1, 1.14.2, 1.15.0, 1.16.0). The code paths the adapter relies on are
    the same in all of them: ``_compute_loss`` (KL block, loss types and normalisers) is identical line for line,
    ``compute_loss``'s signature, the ``inputs`` keys, GRPOConfig's KL fields and defaults (beta 0.0,
    use_bias_correction_kl True, loss_type "dapo") and RLOO's k1-in-reward are unchanged (sdists diffed). What differs:
      * how TRL computes log-probs: 1.14.x slices full logits (or, with use_liger_kernel, a chunked Liger path,
        ``_chunked_logps``, reached from compute_loss through ``_forward_redirection``); 1.15.0 adds a fused LM head to the
        model. The adapter takes the log-probs from ``_get_per_token_logps_and_entropies``'s output (``out[0]`` in every
        release), so it is indifferent to which; use_liger_kernel is refused in every release (here).
      * gradient-accumulation scaling: 1.14.x disables Trainer's scaling with ``compute_loss_func="non-None..."``, 1.15.0
        with ``loss_is_scaled_for_ga = True``; in both, ``_compute_loss`` divides by the accumulation steps itself, which
        `per_token_normaliser` reads as ``current_gradient_accumulation_steps`` (unchanged).
      * 1.15.0 runs its fused LM head through Triton kernels on every device (trl/kernels/chunked_logprob.py imports
        triton; 1.16.0 falls back to torch without it), so on a CPU-only machine 1.15.0 needs triton installed and
        TRITON_INTERPRET=1 (how its tests run here: tests/trl/conftest.py); the KL path is the same.
      * 1.14.0 and 1.14.1 import ``requests`` unconditionally (trl/generation/vllm_client.py) without declaring it: an
        environment for them needs ``requests`` installed (envs/trl-1.14.0.txt, envs/trl-1.14.1.txt); 1.14.2 fixed it.
    """
    if trainer.args.use_liger_kernel and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedFrameworkError(
            "kl-adapters is not tested with use_liger_kernel=True (Liger needs a GPU; in trl >= 1.15 it only swaps layer "
            "kernels, in trl 1.14.x it also switches the log-probs to a chunked Liger path). "
            f"Set {ALLOW_UNTESTED_ENV}=1 to proceed anyway.")
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


#: batch-dict keys of the rollout-time statistics (KLStatistics fields), sliced by TRL with the rest of the batch
ROLLOUT_STATISTICS_KEYS = {f.name: f"kl_adapters_{f.name}" for f in fields(KLStatistics)}


def _is_full(settings: Settings | None) -> bool:
    return settings is not None and get_preset(settings.preset).needs_full_logits


def _completion_mask(inputs: dict) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def rollout_logps(batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log-probs, mask) of the sampling policy over a whole generation batch, as TRL has them at rollout time.

    vLLM's sampling log-probs where it scored the token, else TRL's old log-probs (as `behaviour_logps`); tokens
    vLLM did not score are left out of the mask when TRL computed no old log-probs. None when TRL has neither (its
    on-policy default skips that forward pass; kl-adapters adds none).
    """
    old = batch.get("old_per_token_logps")
    sampling = batch.get("sampling_per_token_logps")
    mask = _completion_mask(batch)
    if sampling is None:
        return None if old is None else (old, mask)
    scored = ~torch.isnan(sampling)
    if old is not None:
        return torch.where(scored, sampling, old), mask
    return torch.nan_to_num(sampling), mask * scored


def group_ids(trainer: GRPOTrainer, rows: int) -> torch.Tensor:
    """[rows] prompt ids of this process's generation batch: TRL's RepeatSampler yields each prompt's
    num_generations completions consecutively, and each process takes a contiguous slice of the global batch."""
    mode_generations = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
    start = trainer.accelerator.process_index * rows
    return torch.div(torch.arange(start, start + rows), mode_generations, rounding_mode="floor")


def rollout_statistics(trainer: GRPOTrainer, batch: dict, preset: str,
                       eos: EndOfSequence | None = None) -> KLStatistics | None:
    """`kl_statistics(..., preset=preset)` of the whole generation batch, leave-one-out within each GRPO group, fitted
    with the batch's task advantages (`task_advantages`) and `eos` (the sampling policy's end-of-sequence
    probabilities, `rollout_end_of_sequence`), from the log-probs TRL has at rollout time (`rollout_logps`), over every
    process's generation batch; None when it has none. Row b's statistics depend on the other rows only. They are
    taken on-policy (no old_logp: the rollout log-probs are the policy that sampled), where `Preset.weighted_returns`
    has no effect, so `sequence` and `reward` get identical statistics here. Pinned by tests/trl/test_statistics.py
    (and, over processes, tests/trl/test_data_parallel.py)."""
    logps = rollout_logps(batch)
    if logps is None or batch.get("ref_per_token_logps") is None:
        return None
    logp, mask = logps
    group = group_ids(trainer, logp.shape[0]).to(logp.device)
    task, ref = task_advantages(trainer, batch, trainer.beta), batch["ref_per_token_logps"]
    if trainer.accelerator.num_processes == 1:
        return kl_statistics(logp, ref, mask, group=group, preset=preset, task=task, eos=eos,
                             discount=discount_of(trainer.args))
    # several processes: over every process's generation batch (a GRPO group split across processes included)
    task, every_eos = _fitting_inputs_of_every_process(trainer, task, eos)
    whole = kl_statistics(*(_every_process(trainer, x) for x in (logp, ref, mask)), preset=preset, task=task,
                          eos=every_eos, group=_every_process(trainer, group), discount=discount_of(trainer.args))
    return _own_rows(trainer, whole, mask)


def statistics_of(inputs: dict) -> KLStatistics | None:
    """The rows' rollout-time statistics stored in a (micro-)batch by `rollout_statistics`, or None."""
    if ROLLOUT_STATISTICS_KEYS["baseline"] not in inputs:
        return None
    return KLStatistics(**{field: inputs.get(key) for field, key in ROLLOUT_STATISTICS_KEYS.items()})


# What the reduced presets' statistics are fitted with (issue 20): TRL's advantages, the rows' prompt groups and the
# policy's end-of-sequence probabilities, read from the forward passes TRL already runs.

#: batch-dict key of each row's GRPO prompt-group id, stored at generation and carried by TRL's shuffle / split
GROUP_KEY = "kl_adapters_group"


def advantages_normalized(trainer: GRPOTrainer) -> bool:
    """Whether TRL divided the advantages by a standard deviation over rows that include the row: scale_rewards
    "group" or "batch" (GRPOConfig maps True / False to "group" / "none" in 1.14.0-1.16.0), or
    multi_objective_aggregation "normalize_then_sum" (the summed reward divided by the batch's std, whatever
    scale_rewards says). Pinned by tests/trl/test_task_and_eos.py::test_advantages_normalized."""
    return trainer.scale_rewards != "none" or trainer.multi_objective_aggregation == "normalize_then_sum"


def task_advantages(trainer: GRPOTrainer, inputs: dict, beta: float) -> TaskAdvantages | None:
    """TRL's advantages as its loss uses them ([B], or [B, T] from a subclass), with `beta` its KL coefficient: the
    policy loss's per-token descent weight is beta c - A before TRL's normaliser D, which the KL term shares
    (`per_token_normaliser`). grpo / sapo divide the task term by each row's own length instead of D: the advantages
    are still passed unscaled, since a per-row length factor on group-centred advantages would make the other rows'
    task terms depend on the row's own reward (the statistics must be functions of the other rows).
    None (the statistics then fit the KL term alone) with normalize_then_sum over several reward functions: each is
    standardised within the group by its own std, so no single shift and scale removes the row's own rewards from
    the other rows' advantages."""
    if trainer.multi_objective_aggregation == "normalize_then_sum" and len(trainer.reward_funcs) > 1:
        return None
    return TaskAdvantages(inputs["advantages"], beta=beta, normalized=advantages_normalized(trainer))


def eos_token_ids(trainer: GRPOTrainer) -> tuple[int, ...]:
    """The ids that end a completion: trl >= 1.14.2 stops generation and the completion mask at any of
    `trainer.eos_token_ids` (the tokenizer's eos_token_id and the generation config's); 1.14.0 / 1.14.1 at the
    tokenizer's eos_token_id alone (`end_of_sequence.token_ids`, `end_of_sequence.eos_token_ids`)."""
    return token_ids(getattr(trainer, "eos_token_ids", None)) or read_eos_token_ids(trainer._tokenizer)


def _head_problem(lm: torch.nn.Module) -> str | None:
    """Why TRL's next-token logits of `lm` are not hidden @ W.T / temperature with W its output embedding's weight
    (a bias, a logit scale, soft-capping, another head), or None when they are."""
    head, config = lm.get_output_embeddings(), lm.config.get_text_config()
    scaled = [k for k in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                          "logits_scaling") if getattr(config, k, None) not in (None, 1.0)]
    if isinstance(head, torch.nn.Linear) and head.bias is None and not scaled:
        return None
    return (f"{type(lm).__name__}'s head is {type(head).__name__}"
            f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}"
            f"{f' scaled by {scaled}' if scaled else ''}")


def _eos_gap(hidden: torch.Tensor, input_ids: torch.Tensor, weight: torch.Tensor, eos_ids: torch.Tensor,
             width: int, temperature: float) -> torch.Tensor:
    """[b, width] log sum_{e in eos_ids} exp(z_e) - z_y at the last `width` positions (detached, float32), with
    z = hidden @ weight.T / temperature the next-token logits and y the next input id (hidden position i predicts
    token i + 1). With TRL's log pi(y) there, log pi(EOS | y_<t) = gap + log pi(y): the EOS ids' rows of W and the
    sampled tokens' rows, never the [b, width, V] logits."""
    with torch.no_grad():
        h = hidden[:, -width - 1:-1].float() / temperature
        w = weight.detach()
        z_y = torch.einsum("bth,bth->bt", h, w[input_ids[:, -width:]].float())
        return torch.logsumexp(h @ w[eos_ids].float().T, -1) - z_y


def _eos_weight(trainer: GRPOTrainer, lm: torch.nn.Module) -> torch.Tensor | None:
    """The output projection W that `_eos_gap` reads, or None (warned once per trainer) for a head that is not
    hidden @ W.T: the termination control variate is then left out, and the gradient stays exact."""
    problem = _head_problem(lm)
    if problem is None:
        return lm.get_output_embeddings().weight
    if not getattr(trainer, "_kl_adapters_eos_warned", False):
        trainer._kl_adapters_eos_warned = True
        logger.warning("kl-adapters: %s, so pi(EOS) is not read from the hidden state; the reduced presets run without "
                       "their termination control variate (the gradient stays exact)", problem)
    return None


@dataclass
class PolicyForward:
    """One call of TRL's `_get_per_token_logps_and_entropies` on the policy, as `recording` saw it.

    logps   its output's log-probs (out[0], TRL's tensor itself)
    eos_gap [B, T] `_eos_gap` from the backbone's last hidden state (None: a head `_eos_weight` refuses)
    hidden  the backbone's last hidden state with its graph, kept for `full` only
    """

    logps: torch.Tensor
    eos_gap: torch.Tensor | None
    hidden: torch.Tensor | None = None


def recording(trainer: GRPOTrainer, forward, seen: list[PolicyForward], *, eos: bool = True,
              keep_hidden: bool = False, first_only: bool = False):
    """A stand-in for trainer._get_per_token_logps_and_entropies (the bound `forward`) that runs it unchanged and
    appends a PolicyForward to `seen` for every call on the trainer's policy (first_only: the first call only, the
    policy's forward inside _compute_loss), with its EOS gap when `eos` (and the head allows) and its hidden state
    when keep_hidden. A forward hook on the backbone (transformers' `base_model`, run by TRL's forward in every
    release: 1.14's full logits, 1.15+'s fused LM head) reads each chunk's last hidden state: no second forward,
    and nothing of size [B, T, V]."""
    eos_ids = eos_token_ids(trainer)

    def call(*args, **kwargs):
        model = args[0] if args else kwargs["model"]
        if (first_only and seen) or not (first_only or model is trainer.model):
            return forward(*args, **kwargs)
        width = args[3] if len(args) > 3 else kwargs["logits_to_keep"]
        lm = _causal_lm(model, trainer)
        weight = _eos_weight(trainer, lm) if eos else None
        gaps, hidden = [], []

        def hook(module, hook_args, hook_kwargs, output):
            h = _last_hidden(output)
            if keep_hidden:
                hidden.append(h)
            if weight is not None:
                ids = hook_kwargs["input_ids"] if hook_kwargs.get("input_ids") is not None else hook_args[0]
                gaps.append(_eos_gap(h, ids, weight, torch.tensor(eos_ids, device=h.device), width,
                                     trainer.temperature))

        needed = weight is not None or keep_hidden
        handle = lm.base_model.register_forward_hook(hook, with_kwargs=True) if needed else None
        try:
            out = forward(*args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        if keep_hidden and len(hidden) != 1:
            raise UnsupportedFrameworkError(f"kl_preset='full' expected one policy backbone call, saw {len(hidden)}")
        seen.append(PolicyForward(out[0], torch.cat(gaps) if gaps else None, hidden[0] if hidden else None))
        return out

    return call


def end_of_sequence(trainer: GRPOTrainer, forward: PolicyForward, completion_ids: torch.Tensor,
                    mask: torch.Tensor) -> EndOfSequence | None:
    """EndOfSequence(pi(EOS | y_<t) summed over `eos_token_ids` at TRL's temperature, y_t in them, horizon
    max_completion_length) of one recorded forward, zero at padding; None without an EOS gap. Pinned by
    tests/trl/test_task_and_eos.py::test_eos_probabilities_are_the_policys."""
    if forward.eos_gap is None:
        return None
    real = mask != 0
    prob = torch.exp(forward.eos_gap + forward.logps.detach().float()).clamp(max=1.0)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids(trainer), device=completion_ids.device))
    return EndOfSequence(torch.where(real, prob, 0.0), is_eos & real, horizon=trainer.max_completion_length)


def rollout_end_of_sequence(trainer: GRPOTrainer, batch: dict, seen: list[PolicyForward]) -> EndOfSequence | None:
    """The end-of-sequence probabilities of the forward that produced the batch's old_per_token_logps (TRL's tensor
    itself), None when TRL ran none (vLLM's sampling log-probs alone, or no rollout log-probs)."""
    old = batch.get("old_per_token_logps")
    match = [f for f in seen if f.logps is old]
    if old is None or not match:
        return None
    return end_of_sequence(trainer, match[0], batch["completion_ids"], _completion_mask(batch))


def statistics_inputs(trainer: GRPOTrainer, preset: str, inputs: dict, beta: float,
                      eos: EndOfSequence | None) -> dict:
    """The keyword arguments of kl_term / full_kl_surrogate_from_hidden that shape the preset's statistics at loss
    time: the rows' rollout statistics (`statistics_of`) with this forward's eos, or, none stored, TRL's task
    advantages, the rows' prompt groups (GROUP_KEY; a batch without it is one group) and eos for leave-one-out
    over the micro-batch; {} for a preset without statistics.

    The statistics are fitted to the gradient TRL takes, task + KL (kl_adapters.reductions), with, wherever they are
    computed (loss time, rollout time, ``full``):
      * ``TaskAdvantages(inputs["advantages"], beta, normalized)`` (`task_advantages`): TRL's advantages as its loss uses
        them, beta the GRPOConfig beta (the policy loss's per-token weight is beta c - A before the normaliser D the KL
        term shares), normalized unless scale_rewards = "none" under multi_objective_aggregation "sum_then_normalize";
        None for "normalize_then_sum" over several reward functions (no single shift and scale removes a row's own rewards
        from the other rows' advantages there); the rows' prompt ids as ``group`` (GRPO normalises per prompt);
      * ``EndOfSequence(pi(EOS | y_<t), y_t is EOS, max_completion_length)`` (`end_of_sequence`), the termination control
        variate's input, over every id TRL stops at (`eos_token_ids`). pi(EOS) is read from the policy forward TRL runs
        anyway: a forward hook on the backbone (transformers' ``base_model``, which TRL's forward runs in every release:
        1.14.x's full logits, 1.15+'s fused LM head, `full`'s hidden-state path) takes the last hidden state h and
        computes log pi(EOS) = logsumexp_e(h W_e / T) - h W_y / T + log pi(y), with W_e the EOS ids' rows of the output
        projection, W_y the sampled token's row and log pi(y) TRL's own log-prob (`recording`, `_eos_gap`): no second
        forward, nothing of size [B, T, V]. At loss time it is the current policy's (exactness needs it); at rollout, the
        forward that produced old_per_token_logps (statistics only; none when TRL runs no old-policy forward). A head
        that is not hidden @ W.T (bias, logit scale, soft-capping) gets no termination term, with a warning.
    """
    spec = get_preset(preset)
    if not spec.uses_batch_statistics:
        return {}
    statistics = None if spec.needs_full_logits else statistics_of(inputs)
    if statistics is not None:
        return {"statistics": statistics, "eos": eos}
    return {"task": task_advantages(trainer, inputs, beta), "group": inputs.get(GROUP_KEY), "eos": eos}


def _generate_with_statistics(original, self, generation_batch):
    """GRPOTrainer._generate_and_score_completions, plus, when a preset with batch statistics is active, each row's
    prompt group (GROUP_KEY) and the rollout statistics in its output (see module docstring); unchanged otherwise."""
    settings = settings_for(self)
    _apply_budget(self)
    if self.beta == 0.0 or settings is None or not get_preset(settings.preset).uses_batch_statistics:
        return original(self, generation_batch)
    if _is_full(settings):
        beta, self.beta = self.beta, 0.0  # TRL skips its reference pass: `full` runs the reference at loss time
        try:
            batch = original(self, generation_batch)
        finally:
            self.beta = beta
    else:
        seen: list[PolicyForward] = []
        self._get_per_token_logps_and_entropies = recording(self, self._get_per_token_logps_and_entropies, seen)
        try:
            batch = original(self, generation_batch)
        finally:
            del self._get_per_token_logps_and_entropies
        statistics = rollout_statistics(self, batch, settings.preset, rollout_end_of_sequence(self, batch, seen))
        if statistics is not None:
            for field, key in ROLLOUT_STATISTICS_KEYS.items():
                batch[key] = getattr(statistics, field)
    rows = batch["completion_ids"]
    batch[GROUP_KEY] = group_ids(self, rows.shape[0]).to(rows.device)
    return batch


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
        (c_native - term.coefficients).abs().sum(), term.coefficients.abs().sum(), term.is_ess,
        torch.ones((), device=seq.device),
    ]).float()).tolist()
    metrics = trainer._metrics[mode]
    metrics["kl"].append(totals[0] / max(totals[1], 1.0))
    metrics[SEQ_KL].append(totals[2] / max(totals[3], 1.0))
    observe_budget(trainer, mode, totals[2], totals[3])
    metrics[GRAD_WEIGHT_GAP].append(totals[4] / totals[5] if totals[5] > 0 else 0.0)
    metrics[IS_ESS].append(totals[6] / totals[7])  # mean over processes


def _causal_lm(model: torch.nn.Module, trainer: GRPOTrainer) -> torch.nn.Module:
    """The transformers causal LM inside an (accelerate-, PEFT-) wrapped model."""
    model = trainer.accelerator.unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _output_projection(lm: torch.nn.Module, temperature: float) -> torch.Tensor:
    """W / temperature such that TRL's next-token logits are hidden @ (W / temperature).T; refuses any other head."""
    problem = _head_problem(lm)
    if problem is not None:
        raise UnsupportedFrameworkError(f"kl_preset='full' needs logits = hidden @ W.T; {problem}")
    return lm.get_output_embeddings().weight / temperature


def _last_hidden(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _reference_hidden(trainer: GRPOTrainer, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state [B, L, H], W / temperature) of the reference on the batch, without gradient: TRL's
    ref_model, else (PEFT) the base with adapters disabled or TRL's "ref" adapter, as TRL's own reference pass."""
    from contextlib import nullcontext

    from trl.trainer.utils import use_adapter

    if trainer.ref_model is not None:
        lm, context = _causal_lm(trainer.ref_model, trainer), nullcontext()
    else:
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        lm = peft_model.get_base_model()
        context = use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None)
    with torch.no_grad(), context, trainer.accelerator.autocast():
        hidden = _last_hidden(lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False))
        return hidden, _output_projection(lm, trainer.temperature).detach()


def _full_kl(trainer: GRPOTrainer, model, inputs: dict, policy_hidden: torch.Tensor, logp: torch.Tensor, behaviour,
             beta_seq, mask, options: dict) -> torch.Tensor:
    """beta_seq * full_kl_surrogate_from_hidden on this micro-batch (preset `full`, below); logs metrics.
    logp: TRL's own log-probs of the completion (with their graph): one pass over the vocabulary chunks, the score
    part of the gradient through them; options: `statistics_inputs` (task advantages, groups, eos).

    Preset ``full`` (kl_adapters.full_vocab: exact KL_t over the vocabulary, Rao-Blackwellized): the reference runs in
    the trainer process (``ref_model``, or with PEFT the adapter-disabled base / TRL's "ref" adapter). With it set:
      * generation skips TRL's reference log-prob pass (``beta`` is 0 for that call): ``full`` reads the reference's
        distributions at loss time instead, so the reference runs once per micro-batch either way;
      * the loss wrapper captures the policy backbone's last hidden state of TRL's own forward (a forward hook for that one
        call, gradient attached), runs the reference backbone (no gradient) on the same tokens, and adds
        ``full_kl_surrogate_from_hidden(h, W / temperature, h_ref, W_ref / temperature, completion_ids, mask,
        beta=beta_seq, old_logp=behaviour_logp, logp=per_token_logps)`` (W the output projection): chunked over tokens,
        so [B, T, V] logits of neither model are materialised; TRL's own per-token log-probs (with their graph) carry the
        score part of the gradient, so each chunk's logits are computed once. beta_seq and the behaviour log-probs are
        those of the other presets; the statistics are leave-one-out over the micro-batch's rows within their prompt
        groups, with the task advantages and pi(EOS) from the same hidden state (rollout-time statistics would need the
        exact KL_t of the whole generation batch, i.e. the very reference pass this preset removes from generation).
      * metrics: ``kl`` = token mean of the (importance-weighted) exact KL_t, ``kl_adapters/seq_kl`` its per-sequence sum.
      Refused (clear error): kl_is_clip (the estimator applies exact weights), models whose logits are not
      hidden @ W.T (bias, logit scale, soft-capping), multimodal inputs. Pinned by tests/trl/test_full.py.
    """
    if any(inputs.get(k) is not None for k in ("pixel_values", "image_grid_thw", "token_type_ids")):
        raise UnsupportedFrameworkError("kl_preset='full' supports text-only models (multimodal inputs are not tested)")
    completion = inputs["completion_ids"]
    horizon = completion.shape[1]
    input_ids = torch.cat([inputs["prompt_ids"], completion], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    ref_hidden, ref_weight = _reference_hidden(trainer, input_ids, attention_mask)
    weight = _output_projection(_causal_lm(model, trainer), trainer.temperature)
    seq_kl = full_kl_surrogate_from_hidden(  # hidden state at position i predicts token i + 1
        policy_hidden[:, -horizon - 1:-1], weight, ref_hidden[:, -horizon - 1:-1], ref_weight, completion, mask,
        old_logp=behaviour, logp=logp, **options)
    totals = trainer.accelerator.reduce(torch.stack([
        seq_kl.detach() * mask.shape[0], mask.sum(), torch.tensor(float(mask.shape[0]), device=mask.device)]).float(),
        reduction="sum").tolist()
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    metrics["kl"].append(totals[0] / max(totals[1], 1.0))
    metrics[SEQ_KL].append(totals[0] / max(totals[2], 1.0))
    observe_budget(trainer, "train" if trainer.model.training else "eval", totals[0], totals[2])
    return beta_seq * seq_kl


def _compute_loss_with_kl(original, self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GRPOTrainer.compute_loss with the KL term replaced by the active preset (see module docstring)."""
    settings = settings_for(self)
    _apply_budget(self)
    if settings is None or self.beta == 0.0:
        if settings is not None and not getattr(self, "_kl_adapters_warned", False):
            self._kl_adapters_warned = True
            logger.warning("kl-adapters: KL preset %r is set but beta == 0, so there is no KL term to replace", str(settings))
        return original(self, model, inputs, return_outputs, num_items_in_batch)
    _check_code_path(self)
    full = _is_full(settings)
    seen: list[PolicyForward] = []  # the first forward inside _compute_loss is the policy's, with gradient
    beta, self.beta = self.beta, 0.0  # TRL skips its own KL term (and its `kl` metric) for this call
    self._get_per_token_logps_and_entropies = recording(
        self, self._get_per_token_logps_and_entropies, seen, eos=get_preset(settings.preset).uses_batch_statistics,
        keep_hidden=full, first_only=True)
    try:
        loss = original(self, model, inputs, return_outputs, num_items_in_batch)
    finally:
        self.beta = beta
        del self._get_per_token_logps_and_entropies
    logp = seen[0].logps
    mask = _completion_mask(inputs)
    behaviour = behaviour_logps(inputs, logp)
    beta_seq = beta * mask.shape[0] / per_token_normaliser(self, inputs, mask)
    options = statistics_inputs(self, settings.preset, inputs, beta,
                                end_of_sequence(self, seen[0], inputs["completion_ids"], mask))
    options["discount"] = discount_of(self.args)
    if full:
        return loss + _full_kl(self, model, inputs, seen[0].hidden, logp, behaviour, beta_seq, mask, options).to(
            loss.dtype)
    ref = inputs["ref_per_token_logps"]
    if "task" in options and self.accelerator.num_processes > 1:
        options = _statistics_across_processes(self, settings, logp, ref, mask, behaviour, options)
    term = kl_term(logp, ref, mask, preset=settings.preset, old_logp=behaviour, is_clip=settings.is_clip, **options)
    kl = term.surrogate(beta_seq)
    _log_metrics(self, "train" if self.model.training else "eval", logp, ref, mask, behaviour, term)
    return loss + kl.to(loss.dtype)


def _statistics_across_processes(trainer: GRPOTrainer, settings: Settings, logp, ref, mask, behaviour,
                                 options: dict) -> dict:
    """Loss-time statistics (none stored at rollout) over the rows of every process's micro-batch, as one process
    holding them all would fit them (a GRPO group split across processes included): kl_statistics of the gathered
    inputs (`_every_process`; the statistics kl_term computes from a batch, which is_clip does not enter), this
    process's rows of them. Returns kl_term's options with them. Pinned by tests/trl/test_data_parallel.py."""
    task, eos = _fitting_inputs_of_every_process(trainer, options["task"], options["eos"])
    whole = kl_statistics(*(_every_process(trainer, x) for x in (logp, ref, mask)), preset=settings.preset,
                          old_logp=_every_process(trainer, behaviour), task=task, eos=eos,
                          group=_every_process(trainer, options["group"]), discount=options["discount"])
    return {"statistics": _own_rows(trainer, whole, mask), "eos": options["eos"], "discount": options["discount"]}


def _every_process(trainer: GRPOTrainer, x: torch.Tensor | None) -> torch.Tensor | None:
    """[B] / [B, T] `x` of every process, rows in process order ([B, T] zero-padded to the widest), detached."""
    if x is None:
        return None
    acc = trainer.accelerator
    return acc.gather(acc.pad_across_processes(x.detach(), dim=1) if x.dim() > 1 else x.detach())


def _fitting_inputs_of_every_process(trainer: GRPOTrainer, task: TaskAdvantages | None,
                                     eos: EndOfSequence | None) -> tuple[TaskAdvantages | None, EndOfSequence | None]:
    """The task advantages and end-of-sequence probabilities of every process's rows (`_every_process`)."""
    return (None if task is None else replace(task, advantages=_every_process(trainer, task.advantages)),
            None if eos is None else replace(eos, prob=_every_process(trainer, eos.prob),
                                             is_eos=_every_process(trainer, eos.is_eos)))


def _own_rows(trainer: GRPOTrainer, statistics: KLStatistics, mask: torch.Tensor) -> KLStatistics:
    """This process's rows of statistics fitted on every process's rows, at its own width."""
    rows = mask.shape[0]
    start = trainer.accelerator.process_index * rows
    return statistics[start:start + rows].with_width(mask.shape[1])


# ---- KL budget (kl_target, kl_adapters.budget) ---------------------------------------------------------------------


def _off_policy(args: GRPOConfig) -> bool:
    """Whether the loss can see batches from another policy than the one it trains: TRL's own condition for keeping
    rollout log-probs (a generation batch spanning optimizer steps, num_iterations > 1), or vLLM's sampler."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(getattr(args, "use_vllm", False))


def check_budget(args: GRPOConfig) -> None:
    """Refuse, at configuration time (KLGRPOConfig.__post_init__; the trainer's __init__ for the KL_ADAPTERS route), a
    KL budget that cannot do what it says in this trainer: no KL term to adjust (no preset, kl_preset 'off'; beta ==
    0, which `start_budget` leaves only where TRL made the config itself), or a preset whose gradient is not the
    sequence KL's for this trainer's (off-policy) batches (`budget.check_budget_preset`). What every path refuses
    (a bad target, a preset biased on-policy, is_clip) `activation.validate` has refused already. Pinned by
    tests/trl/test_budget.py::test_bad_budgets_are_refused_at_configuration."""
    settings = settings_of(args)
    if settings is None:
        raise activation.SettingError("kl_target needs a KL term to adjust: set kl_preset (e.g. 'sequence') or "
                                      "KL_ADAPTERS")
    if args.beta == 0.0:
        raise activation.SettingError(f"kl_target with beta=0.0: pass GRPOTrainer a GRPOConfig (its beta 0 then "
                                      f"starts the budget at {BUDGET_START_BETA}), or set beta > 0")
    try:
        check_budget_preset(settings.preset, settings.is_clip, off_policy=_off_policy(args))
    except ValueError as err:
        raise activation.SettingError(str(err)) from None


class KLBudgetCallback(TrainerCallback, ExportableState):
    """The run's KL budget (`budget.KLBudget`, initial beta = TRL's beta) as a transformers callback: updated at
    on_step_end, once per optimizer step, from that step's micro-batches on every process (`observe_budget`: the
    sums `_log_metrics` already reduces across processes, so every process computes the same beta); stored in each
    checkpoint's trainer_state.json (TrainerState.stateful_callbacks, where transformers keeps callback state) and
    restored from it at on_train_begin, which train(resume_from_checkpoint=...) reaches with the checkpoint's state.
    The trainer reads beta from it at each generation and loss call (`_apply_budget`).

    KL budget (``KLGRPOConfig(kl_target=<nats>)``, ``--kl_target``, or ``KL_ADAPTERS=<preset>:kl_target=<nats>``;
    kl_adapters.budget): TRL's ``beta`` is the starting value of a controller that sets ``trainer.beta`` once per optimizer
    step so that KL(pi || pi_ref) per completion tracks the target. ``KLBudgetCallback`` holds it: at on_step_end it
    updates beta from the step's mean ``kl_adapters/seq_kl`` (the sums `_log_metrics` already reduces across processes:
    no extra synchronisation, the same beta on every process); the generation and loss wrappers read it
    (`_apply_budget`), so TRL's own code and the statistics see the current beta. Its state is saved in each checkpoint's
    trainer_state.json (``stateful_callbacks``) and restored at on_train_begin by ``train(resume_from_checkpoint=...)``.
    Metrics beside TRL's: ``kl_adapters/beta``, ``kl_adapters/kl_target``. With TRL's default ``beta = 0`` the budget
    starts from ``BUDGET_START_BETA`` (`start_budget`, before TRL decides whether to build its reference model). Refused
    at configuration (`activation.validate`, `check_budget`): no KL term, a target that is not a finite number > 0, a
    preset whose gradient is not the sequence KL's (or ``reward`` off-policy), is_clip; RLOOTrainer (not patched).
    Without kl_target nothing of this runs. Pinned by tests/trl/test_budget.py.
    """

    def __init__(self, target: float, beta: float, rule: str = DEFAULT_RULE):
        self.budget = KLBudget(target, beta, rule)

    @property
    def budget_state(self) -> dict:
        return self.budget.state_dict()

    @budget_state.setter
    def budget_state(self, state: dict) -> None:  # transformers' restore_callback_states_from_checkpoint sets it
        self.budget.load_state_dict(state)

    def state(self) -> dict:
        b = self.budget
        return {"args": {"target": b.target, "beta": b.beta, "rule": b.rule}, "attributes": {"budget_state": b.state_dict()}}

    def on_train_begin(self, args, state, control, **kwargs):
        stored = state.stateful_callbacks.get(type(self).__name__)
        stored = stored[0] if isinstance(stored, list) else stored
        if stored or state.global_step:  # a fresh run stores the initial state here: loading it changes nothing
            restore({"budget_state": self.budget}, (stored or {}).get("attributes", {}),
                    "the checkpoint's trainer_state.json")

    def on_step_end(self, args, state, control, **kwargs):
        self.budget.update()


def budget_of(trainer: GRPOTrainer) -> KLBudget | None:
    """The trainer's KL budget, None without kl_target."""
    return next((cb.budget for cb in trainer.callback_handler.callbacks if isinstance(cb, KLBudgetCallback)), None)


def _apply_budget(trainer: GRPOTrainer) -> None:
    """trainer.beta = the budget's beta (TRL and the adapter read trainer.beta at every use)."""
    budget = budget_of(trainer)
    if budget is not None:
        trainer.beta = budget.beta


def observe_budget(trainer: GRPOTrainer, mode: str, total: float, count: float) -> None:
    """Hand a micro-batch's summed sequence-KL estimates over all processes (`total`, `count`: host numbers the
    metrics already computed) to the budget in training, and log kl_adapters/beta and kl_adapters/kl_target."""
    budget = budget_of(trainer)
    if budget is None:
        return
    if mode == "train":
        budget.observe(total, count)
    for key, value in budget.metrics().items():
        trainer._metrics[mode][key].append(value)


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
        if self.beta == 0.0:
            flag = "kl_preset" if getattr(self.args, "kl_preset", None) else activation.ENV_VAR
            raise activation.SettingError(_zero_beta(f"{flag}={str(settings)!r}"))
        if settings.kl_target is not None and budget_of(self) is None:
            check_budget(self.args)
            self.add_callback(KLBudgetCallback(settings.kl_target, self.beta))
        activation.announce("trl", "loss", settings, f"beta {self.beta:g}")

    return init


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


def _kl_generate(original):
    @functools.wraps(original)
    def generate_and_score_completions(self, generation_batch):
        return _generate_with_statistics(original, self, generation_batch)

    return generate_and_score_completions


def _kl_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return _compute_loss_with_kl(original, self, model, inputs, return_outputs, num_items_in_batch)

    return compute_loss


#: module -> the TRL methods patched (every release of versions.TESTED["trl"] has these leading parameters)
SITES: dict[str, tuple[Site, ...]] = {
    _GRPO_MODULE: (
        Site("compute_loss", ("self", "model", "inputs", "return_outputs", "num_items_in_batch"), _kl_compute_loss,
             owner="GRPOTrainer"),
        Site("_generate_and_score_completions", ("self", "inputs"), _kl_generate, owner="GRPOTrainer"),
        Site("__init__", ("self", "model", "reward_funcs", "args"), _checked_init, owner="GRPOTrainer"),
    ),
    _RLOO_MODULE: (Site("__init__", ("self", "model", "reward_funcs", "args"), _check_rloo, owner="RLOOTrainer"),),
}


def patch(trigger: str) -> None:
    """Install the wrappers (idempotent); they fall through to TRL's code while no preset is set.

    Refuses trl versions outside versions.TESTED, methods whose signature is not the tested one
    (`patching.install`), and a refused KL_ADAPTERS (`activation.check_environment`). `trigger` is the TRL module just
    imported (see activation.ADAPTERS); GRPOTrainer is patched whichever it is, RLOOTrainer once its module is loaded.
    """
    activation.check_environment()
    version = require_version("trl")
    install("trl", version, _GRPO_MODULE, SITES[_GRPO_MODULE])
    rloo = sys.modules.get(_RLOO_MODULE)
    if rloo is not None and hasattr(rloo, "RLOOTrainer"):
        install("trl", version, _RLOO_MODULE, SITES[_RLOO_MODULE])


def unpatch() -> None:
    """Restore TRL's original methods."""
    uninstall("trl")
