"""OpenRLHF adapter, end-of-sequence probabilities: pi(EOS | y_<t) read from the policy forward OpenRLHF already runs
(``Actor.forward`` and actor.py's binding of ``log_probs_from_logits``), for the reduced presets' termination control
variate, and carried with the rollout's log-probs to make_experience (`LogProbsWithEos`). Pinned by
tests/openrlhf/test_eos.py and test_ray.py."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from ... import activation
from ..end_of_sequence import eos_probabilities
from .eos_payload import EosPayload, action_eos, eos_token_ids, split_eos, with_eos
from .state import EOS_CAPTURE, LOSS_STEP, EosCapture, LossStep


def _wants_eos(step: LossStep | None) -> bool:
    """Whether an Actor.forward's end-of-sequence probabilities are needed (a preset with batch statistics): the
    policy's training forward inside a loss step (the current policy, for its rows' own termination control variate),
    or an inference forward outside one (PolicyModelActor.forward at rollout time, for the rollout statistics)."""
    if step is not None:
        return torch.is_grad_enabled() and step.settings.spec.uses_batch_statistics
    settings = activation.active()
    return not torch.is_grad_enabled() and settings is not None and settings.spec.uses_batch_statistics


def _wrap_actor_forward(original: Callable) -> Callable:
    """Wrap Actor.forward (in the PolicyModelActor's process: patched with ppo_actor) for pi(EOS | y_<t), the reduced
    presets' termination control variate, from the policy forward OpenRLHF already runs, without a second pass.

    With actor.py's binding of ``log_probs_from_logits`` (`_wrap_log_probs_from_logits`): from the logits it was given
    and the log-probs it returned, log pi(EOS) = logsumexp(z_EOS) - (z_y - log pi(y))
    (`end_of_sequence.eos_probabilities`: two gathers), at the rollout temperature, the EOS ids being the model's
    generation config's and config's. In the training step the probabilities go to the loss (the current policy's, for
    its rows' own control variate). In PolicyModelActor.forward at rollout time (an inference forward) they ride on
    the returned log-probs (eos_payload.LogProbsWithEos, a tensor subclass that survives its ``.to("cpu")``
    and Ray) to the experience maker, which takes them off before OpenRLHF sees its experiences (`_take_eos`). Pinned
    by tests/openrlhf/test_eos.py and test_ray.py."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, sequences, action_mask=None, *args, **kwargs):
        step = LOSS_STEP.get()
        packed = getattr(self, "packing_samples", False)
        wanted = action_mask is not None and _wants_eos(step)
        ids = eos_token_ids(self.model) if wanted else ()
        if not ids:
            return original(self, sequences, action_mask, *args, **kwargs)
        with EOS_CAPTURE.bound(EosCapture(torch.tensor(ids, device=sequences.device))) as capture:
            out = original(self, sequences, action_mask, *args, **kwargs)
        if capture.prob is None:
            return out
        prob = capture.prob
        if packed:  # [1, nnz] (a ring rank: its slice) in --ds.packing_samples' order: gathered and padded back as
            # Actor.forward gathers and pads its log-probs
            given = signature.bind(self, sequences, action_mask, *args, **kwargs).arguments
            prob = _padded(prob, sequences, given.get("attention_mask"), given.get("ring_attn_group"))
        eos = action_eos(prob, sequences, action_mask, capture.ids)
        if step is not None:  # the loss reads it (`loss._loss_kl_term`); OpenRLHF gets its own result
            step.eos = eos
            return out
        return with_eos(out, eos) if isinstance(out, Tensor) else out

    return forward


def _padded(packed: Tensor, sequences: Tensor, attention_mask: Tensor, ring_attn_group=None) -> Tensor:
    """A packed forward's per-token values as [batch, seqlen], as Actor.forward makes its log-probs: OpenRLHF's own
    unpad indices and gather_and_pad_tensor. Without ring attention `packed` is [1, nnz]; with a ring group
    (--ds.ring_attn_size > 1) it is this rank's slice of the packed row, which gather_and_pad_tensor all-gathers over
    the group and cuts at the padding unpad_and_slice_tensor added (get_tensor_in_current_ring_attn_rank's, recomputed
    by that function on the packed length), so every ring rank gets whole rows. Pinned by
    tests/openrlhf/test_coverage_packing.py and tests/openrlhf/test_ring_attention.py."""
    from openrlhf.models import ring_attn_utils

    indices = ring_attn_utils.unpad_input(sequences.unsqueeze(-1), attention_mask)[1]
    pad = 0
    if ring_attn_group is not None:
        pad = ring_attn_utils.get_tensor_in_current_ring_attn_rank(indices[None], ring_attn_group, 0)[1]
    return ring_attn_utils.gather_and_pad_tensor(packed, ring_attn_group, pad, indices, *sequences.shape)


def _wrap_log_probs_from_logits(original: Callable) -> Callable:
    """Wrap actor.py's binding of log_probs_from_logits: inside a `_wrap_actor_forward` call, also read pi(EOS) from
    the logits after its call (so at the rollout temperature on every release); its result is OpenRLHF's."""

    @functools.wraps(original)
    def log_probs_from_logits(logits, labels, *args, **kwargs):
        out = original(logits, labels, *args, **kwargs)  # 0.10.4 / 0.11.0 divide the logits by the temperature here
        capture = EOS_CAPTURE.get()
        if capture is not None:
            capture.prob = eos_probabilities(logits, labels, out, capture.ids)
        return out

    return log_probs_from_logits


def _take_eos(experiences: list) -> list[EosPayload] | None:
    """Take the rollout forward's EosPayload off each sample batch's action_log_probs (and any off its reference
    log-probs: a reference Actor in a patched process carries one too), leaving OpenRLHF's plain tensors; None unless
    every sample batch had one."""
    payloads = []
    for e in experiences:
        e.action_log_probs, payload = split_eos(e.action_log_probs)
        e.base_action_log_probs = split_eos(e.base_action_log_probs)[0]
        payloads.append(payload)
    return payloads if payloads and all(p is not None for p in payloads) else None
