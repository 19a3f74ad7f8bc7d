"""TRL adapter, what it reads of TRL's batch dict: the completion mask, the behaviour policy's log-probs, and the
rollout statistics and prompt groups it stores there at generation (TRL's own shuffle_sequence_dict /
split_tensor_dict carry them into the micro-batches with the rest)."""

from __future__ import annotations

from dataclasses import fields

import torch

from ...reductions import KLStatistics


def _completion_mask(inputs: dict) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


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


#: batch-dict keys of the rollout-time statistics (KLStatistics fields), sliced by TRL with the rest of the batch
ROLLOUT_STATISTICS_KEYS = {f.name: f"kl_adapters_{f.name}" for f in fields(KLStatistics)}


#: batch-dict key of each row's GRPO prompt-group id, stored at generation and carried by TRL's shuffle / split
GROUP_KEY = "kl_adapters_group"


def statistics_of(inputs: dict) -> KLStatistics | None:
    """The rows' rollout-time statistics stored in a (micro-)batch by `rollout_statistics`, or None."""
    if ROLLOUT_STATISTICS_KEYS["baseline"] not in inputs:
        return None
    return KLStatistics(**{field: inputs.get(key) for field, key in ROLLOUT_STATISTICS_KEYS.items()})
