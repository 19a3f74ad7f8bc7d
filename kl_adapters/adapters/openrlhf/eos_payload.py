"""OpenRLHF adapter, the end-of-sequence payload: pi(EOS | y_<t) and is_eos of one policy forward in OpenRLHF's action
layout (`EosPayload`), and the log-probs tensor that carries it from the rollout forward to make_experience
(`LogProbsWithEos`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..end_of_sequence import eos_token_ids as read_eos_token_ids


def eos_token_ids(model: Any) -> tuple[int, ...]:
    """The end-of-sequence ids of an OpenRLHF Actor's model (DeepSpeed's engine / PEFT unwrapped by attribute access):
    its generation config's ``eos_token_id`` (int or list; what vLLM, which OpenRLHF samples with, stops at beside the
    tokenizer's eos), its config's and, for a vision-language model, its text config's (transformers 5's Qwen2-VL keeps
    ``eos_token_id`` there only) (`end_of_sequence.eos_token_ids`)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return read_eos_token_ids(getattr(inner, "generation_config", None), config, text)


@dataclass(frozen=True)
class EosPayload:
    """pi(EOS | y_<t) and whether y_t is an end-of-sequence token, [B, T] each in the action layout (zero / False at
    padding), of one forward of the policy (what `end_of_sequence` turns into the core's `EndOfSequence`)."""

    prob: Tensor
    is_eos: Tensor

    def to(self, device) -> EosPayload:
        return EosPayload(self.prob.to(device), self.is_eos.to(device))


def action_eos(prob: Tensor, sequences: Tensor, action_mask: Tensor, eos_ids: Tensor) -> EosPayload:
    """The payload of an Actor.forward: prob [B, S] from `end_of_sequence.eos_probabilities` over its logits, cut as Actor.forward cuts
    its log-probs (``[:, :-1]`` then the last T = action_mask width columns), and y_t = sequences[:, -T:] in eos_ids."""
    width = action_mask.shape[1]
    real = action_mask.bool()
    tokens = sequences[:, -width:]
    return EosPayload(torch.where(real, prob[:, :-1][:, -width:], 0.0),
                      torch.isin(tokens, eos_ids.to(tokens.device)) & real)


class LogProbsWithEos(Tensor):
    """Action log-probs that carry the `EosPayload` of the forward that computed them (attribute ``eos``).

    What the policy's rollout-time forward returns under a reduced preset (adapters/openrlhf/eos.py: Actor.forward inside
    PolicyModelActor.forward), so that its end-of-sequence probabilities reach make_experience with the log-probs:
    through PolicyModelActor.forward's ``.to("cpu")`` (kept, moved along) and Ray's pickling (a tensor subclass is
    pickled with its attributes; Ray's zero-copy reducer takes plain tensors only). Every other operation returns a
    plain tensor, so OpenRLHF computes with it as with its own result; `split_eos` takes the payload off. Pinned by
    tests/openrlhf/test_eos.py::test_payload_survives_to_and_pickling and test_ray.py."""

    eos: EosPayload

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is Tensor.to and isinstance(out, Tensor):
            return with_eos(out, args[0].eos.to(out.device))
        return out

    def __deepcopy__(self, memo):
        return with_eos(copy.deepcopy(self.as_subclass(Tensor), memo), copy.deepcopy(self.eos, memo))


def with_eos(log_probs: Tensor, eos: EosPayload) -> LogProbsWithEos:
    """`log_probs` (same data) carrying `eos`."""
    out = log_probs.as_subclass(LogProbsWithEos)
    out.eos = eos
    return out


def split_eos(log_probs: Tensor | None) -> tuple[Tensor | None, EosPayload | None]:
    """(the plain tensor, its EosPayload) of a `LogProbsWithEos`; (log_probs, None) for anything else."""
    if isinstance(log_probs, LogProbsWithEos):
        return log_probs.as_subclass(Tensor), log_probs.eos
    return log_probs, None
