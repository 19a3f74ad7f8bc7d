"""TRL adapter, the loss: ``GRPOTrainer.compute_loss`` with TRL's KL term replaced by the preset's
(`_compute_loss_with_kl`) and the metrics logged beside TRL's (`_log_metrics`).

What changes when a preset is set: TRL computes its policy loss as usual but with ``beta = 0`` for that call, so its
k3 term is skipped; the wrapper then adds  ``kl_surrogate(logp, ref_logp, mask, preset=..., beta=beta_seq,
old_logp=behaviour_logp)``  (as ``kl_term(...).surrogate(beta_seq)``) on the policy log-probs of the same forward
pass. Its gradient is beta_seq * (1/B) * sum_b sum_t c_bt grad log pi_bt (c = the preset's weight; for "sequence" an
unbiased estimate of grad KL_seq on- and off-policy). Pinned by tests/trl/test_grpo_gradients.py.

Meaning of TRL's ``beta``: unchanged relative to the policy loss. TRL adds beta * KL_t per token and divides every
token of the loss by the loss type's normaliser D; the adapter uses beta_seq = beta * B / D with TRL 1.16's own D
(`aggregation.per_token_normaliser`), so the KL has exactly the weight relative to the task loss it has natively (the
"token" preset reproduces TRL's default ``use_bias_correction_kl=True`` gradient bit for bit:
tests/trl/test_grpo_gradients.py::test_token_preset_is_native_trl). ``grpo``, ``sapo`` and GMPO normalise each
sequence by its own length, which would regularize a length-normalized KL, not KL_seq; for them the adapter uses the
constant D = B * max_completion_length (as ``dr_grpo`` does).

Behaviour policy for the importance weights (`inputs.behaviour_logps`): vLLM's sampling log-probs when TRL has them
(tokens vLLM could not score fall back to the trainer's old log-probs), else ``old_per_token_logps`` (num_iterations
> 1 or steps_per_generation not dividing gradient_accumulation_steps), else on-policy. Works for every loss_type, both
importance_sampling_levels and PEFT/LoRA (TRL's reference log-probs, adapter-disabled base, are used as they are).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from typing import TYPE_CHECKING

import torch

from ... import native
from ...surrogate import KLTerm, kl_term, weight_gap
from .._guard import UnsupportedFrameworkError
from ..metrics import GRAD_WEIGHT_GAP, IS_ESS, SEQ_KL
from ..patching import overriding
from .aggregation import _check_code_path, per_token_normaliser
from .budget import _apply_budget, observe_budget
from .data_parallel import _statistics_across_processes
from .eos import RECORDING, Recording, end_of_sequence
from .flags import discount_of, settings_for
from .full import _full_kl
from .inputs import _completion_mask, behaviour_logps
from .statistics import statistics_inputs

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer

logger = logging.getLogger(__name__)


def _native_preset(trainer: GRPOTrainer) -> str:
    """The preset whose per-token gradient TRL's own KL term has, at token-level importance sampling
    (`native.trl_grpo_loss`; at sequence level the native gradient has an extra term no preset has)."""
    return native.trl_grpo_loss(trainer.args.use_bias_correction_kl).preset


def _log_metrics(trainer, mode, logp, ref, mask, behaviour, term: KLTerm) -> None:
    """Metrics: TRL's ``kl`` keeps its meaning (token-mean of k3, times pi/pi_old when use_bias_correction_kl); added
    beside it: ``kl_adapters/seq_kl`` (mean per-sequence KL estimate, sum_t w_{1:t} k3_t),
    ``kl_adapters/grad_weight_gap`` (`surrogate.weight_gap` against TRL's own KL term, `_native_preset`: how far TRL's
    own KL gradient would be from the preset's on this batch; 0 means no difference) and ``kl_adapters/is_ess`` (effective sample size of the
    micro-batch's full-sequence importance weights, 1 on-policy, towards 1/B as they degenerate; averaged over the
    logging window). Each is summed over processes before it is divided (one reduce); the step's sequence KL goes to
    the budget (`observe_budget`)."""
    reduce = functools.partial(trainer.accelerator.reduce, reduction="sum")
    lp = logp.detach().float()
    m = mask.float()
    d = ref.float() - lp
    k3 = torch.expm1(d) - d
    if trainer.args.use_bias_correction_kl:
        k3 = k3 * torch.exp(lp - (lp if behaviour is None else behaviour.float()))
    gap = term.weight_gap_parts(_native_preset(trainer))
    seq = term.sequence_kl
    totals = reduce(torch.stack([
        (k3 * m).sum(), m.sum(), seq.sum(), torch.tensor(float(seq.numel()), device=seq.device), *gap.unbind(),
        term.is_ess, torch.ones((), device=seq.device),
    ]).float()).tolist()
    metrics = trainer._metrics[mode]
    metrics["kl"].append(totals[0] / max(totals[1], 1.0))
    metrics[SEQ_KL].append(totals[2] / max(totals[3], 1.0))
    observe_budget(trainer, mode, totals[2], totals[3])
    metrics[GRAD_WEIGHT_GAP].append(weight_gap(torch.tensor(totals[4:6], dtype=torch.float64)).item())
    metrics[IS_ESS].append(totals[6] / totals[7])  # mean over processes


def _bypassed(trainer: GRPOTrainer) -> UnsupportedFrameworkError:
    """The one line when TRL's loss made no call of _get_per_token_logps_and_entropies on the policy (a fused loss,
    such as the Liger GRPO loss of TRL releases older than the tested ones, computes its own log-probs): the adapter
    would have no log-probs to put its KL term on. Names the release and, with use_liger_kernel, Liger."""
    liger = " (use_liger_kernel=True: a fused Liger loss bypasses it)" if trainer.args.use_liger_kernel else ""
    return UnsupportedFrameworkError(
        f"trl {importlib.metadata.version('trl')}: {type(trainer).__name__}._compute_loss made no call of "
        f"GRPOTrainer's _get_per_token_logps_and_entropies{liger}: not the code path kl-adapters is tested with")


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
    spec, beta = settings.spec, self.beta
    full = spec.needs_full_logits
    # the first forward inside _compute_loss is the policy's, with gradient; TRL skips its own KL term (and its `kl`
    # metric) for this call: beta is 0 there
    request = Recording(self, eos=spec.uses_batch_statistics, keep_hidden=full, first_only=True)
    with RECORDING.bound(request), overriding(self, "beta", 0.0):
        loss = original(self, model, inputs, return_outputs, num_items_in_batch)
    seen = request.seen
    if not seen:
        raise _bypassed(self)
    logp = seen[0].logps
    mask = _completion_mask(inputs)
    behaviour = behaviour_logps(inputs, logp)
    beta_seq = beta * mask.shape[0] / per_token_normaliser(self, inputs, mask)
    options = statistics_inputs(self, spec, inputs, beta,
                                end_of_sequence(self, seen[0], inputs["completion_ids"], mask))
    options["discount"] = discount_of(self.args)
    if full:
        return loss + _full_kl(self, model, inputs, seen[0].hidden, logp, behaviour, beta_seq, mask, options).to(
            loss.dtype)
    ref = inputs["ref_per_token_logps"]
    if "task" in options and self.accelerator.num_processes > 1:
        options = _statistics_across_processes(self, settings, logp, ref, mask, behaviour, options)
    term = kl_term(logp, ref, mask, preset=spec, old_logp=behaviour, is_clip=settings.is_clip, **options)
    kl = term.surrogate(beta_seq)
    _log_metrics(self, "train" if self.model.training else "eval", logp, ref, mask, behaviour, term)
    return loss + kl.to(loss.dtype)


def _kl_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return _compute_loss_with_kl(original, self, model, inputs, return_outputs, num_items_in_batch)

    return compute_loss
