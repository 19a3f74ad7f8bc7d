"""TRL adapter, end-of-sequence probabilities: pi(EOS | y_<t) read from the policy forward TRL already runs (a forward
hook on the backbone of its ``_get_per_token_logps_and_entropies``, `_record_forwards`), for the reduced presets'
termination control variate (`reductions.EndOfSequence`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...reductions import EndOfSequence
from .._guard import UnsupportedFrameworkError
from ..end_of_sequence import eos_token_ids as read_eos_token_ids
from ..end_of_sequence import token_ids
from ..patching import Scoped
from .inputs import _completion_mask

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer

logger = logging.getLogger(__name__)


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
    hidden @ W.T: the termination control variate is then left out, and the gradient stays exact. Read inside the
    policy's forward (`_head_gap`): FSDP swaps the unsharded weight in there."""
    problem = _head_problem(lm)
    if problem is None:
        return lm.get_output_embeddings().weight
    if not getattr(trainer, "_kl_adapters_eos_warned", False):
        trainer._kl_adapters_eos_warned = True
        logger.warning("kl-adapters: %s, so pi(EOS) is not read from the hidden state; the reduced presets run without "
                       "their termination control variate (the gradient stays exact)", problem)
    return None


def _head_gap(trainer: GRPOTrainer, lm: torch.nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor,
              width: int) -> torch.Tensor:
    """`_eos_gap` of one backbone output, W read the way TRL's fused LM head reads it (trl.trainer.utils): during the
    forward, an FSDP2 DTensor gathered whole with `full_tensor()`, a DeepSpeed ZeRO-3 partitioned weight inside TRL's
    `maybe_gather_lm_head_ctx` (a null context without ZeRO-3). Both gathers are collectives: every rank reaches them
    once per backbone call, as it reaches TRL's own. Pinned by tests/trl/test_sharded_eos.py."""
    from torch.distributed.tensor import DTensor
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    weight = _eos_weight(trainer, lm)
    eos_ids = torch.tensor(eos_token_ids(trainer), device=hidden.device)
    with torch.no_grad():
        if isinstance(weight, DTensor):
            weight = weight.detach().full_tensor()
        with maybe_gather_lm_head_ctx(weight):
            return _eos_gap(hidden, input_ids, weight, eos_ids, width, trainer.temperature)


@dataclass
class PolicyForward:
    """One call of TRL's `_get_per_token_logps_and_entropies` on the policy, as `_recorded` saw it.

    logps   its output's log-probs (out[0], TRL's tensor itself)
    eos_gap [B, T] `_eos_gap` from the backbone's last hidden state (None: a head `_eos_weight` refuses)
    hidden  the backbone's last hidden state with its graph, kept for `full` only
    """

    logps: torch.Tensor
    eos_gap: torch.Tensor | None
    hidden: torch.Tensor | None = None


@dataclass
class Recording:
    """A wrapper's request to record the policy forwards of one TRL call on `trainer` (bound as `RECORDING` by the loss
    and generation wrappers around TRL's own call): a PolicyForward in `seen` for every call of
    _get_per_token_logps_and_entropies on the trainer's policy (first_only: the first call only, the policy's forward
    inside _compute_loss), with its EOS gap when `eos` (and the head allows) and its hidden state when keep_hidden."""

    trainer: GRPOTrainer
    eos: bool = True
    keep_hidden: bool = False
    first_only: bool = False
    seen: list[PolicyForward] = field(default_factory=list)


#: the request of the TRL call in progress (`Recording`), read by `_record_forwards`
RECORDING: Scoped[Recording] = Scoped("trl.recording")


def _record_forwards(original: Callable) -> Callable:
    """Wrap GRPOTrainer._get_per_token_logps_and_entropies: inside a `RECORDING` on this trainer, run it unchanged and
    record its call (`_recorded`); otherwise TRL's method alone."""

    @functools.wraps(original)
    def get_per_token_logps_and_entropies(self, *args, **kwargs):
        request = RECORDING.get()
        if request is None or request.trainer is not self:
            return original(self, *args, **kwargs)
        return _recorded(request, functools.partial(original, self), *args, **kwargs)

    return get_per_token_logps_and_entropies


def _recorded(request: Recording, forward: Callable, *args, **kwargs):
    """`forward` (TRL's method on the trainer) called as TRL called it, its PolicyForward appended to request.seen
    when it is one to record. A forward hook on the backbone (transformers' `base_model`, run by TRL's forward in
    every release: 1.14's full logits, 1.15+'s fused LM head) reads each chunk's last hidden state: no second
    forward, and nothing of size [B, T, V]."""
    trainer, seen = request.trainer, request.seen
    model = args[0] if args else kwargs["model"]
    if (request.first_only and seen) or not (request.first_only or model is trainer.model):
        return forward(*args, **kwargs)
    width = args[3] if len(args) > 3 else kwargs["logits_to_keep"]
    lm = _causal_lm(model, trainer)
    eos = request.eos and _eos_weight(trainer, lm) is not None
    gaps, hidden = [], []

    def hook(module, hook_args, hook_kwargs, output):
        h = _last_hidden(output)
        if request.keep_hidden:
            hidden.append(h)
        if eos:
            ids = hook_kwargs["input_ids"] if hook_kwargs.get("input_ids") is not None else hook_args[0]
            gaps.append(_head_gap(trainer, lm, h, ids, width))

    needed = eos or request.keep_hidden
    handle = lm.base_model.register_forward_hook(hook, with_kwargs=True) if needed else None
    try:
        out = forward(*args, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    if request.keep_hidden and len(hidden) != 1:
        raise UnsupportedFrameworkError(f"kl_preset='full' expected one policy backbone call, saw {len(hidden)}")
    seen.append(PolicyForward(out[0], torch.cat(gaps) if gaps else None, hidden[0] if hidden else None))
    return out


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


def _causal_lm(model: torch.nn.Module, trainer: GRPOTrainer) -> torch.nn.Module:
    """The transformers causal LM inside an (accelerate-, PEFT-) wrapped model."""
    model = trainer.accelerator.unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _last_hidden(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
