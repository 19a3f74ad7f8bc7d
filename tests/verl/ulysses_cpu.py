"""TEST-ONLY CPU stand-in for flash-attention's varlen forward, so that verl 0.9.1's Ulysses sequence parallelism runs
on CPU (gloo). Not part of kl-adapters; imported only by tests/verl/dp_worker_verl.py.

verl's Ulysses exchanges the sequence shards inside the attention call: `apply_monkey_patch` replaces transformers'
`flash_attention._flash_attention_forward` by `_ulysses_flash_attention_forward` (all-to-all: whole sequence, a
slice of the heads; the flash-attention forward on it; all-to-all back), which reaches flash-attention through
`verl.models.transformers.monkey_patch._flash_attention_forward`. `install` registers transformers' own flash
integration under the name `NAME` (so the model calls it without flash-attn installed) and puts
`varlen_attention_stand_in` where verl calls flash-attention: everything verl does around the kernel -- the shards,
the all-to-alls, the padding, the gathers -- runs as on a GPU."""

from __future__ import annotations

from functools import partial

import torch

#: the attention implementation the model is loaded with (no "flash" in it: transformers would ask for flash-attn)
NAME = "cpu_varlen_stand_in"
#: the packed length of every call of the stand-in (the whole micro-batch, after verl's all-to-all)
CALLS: list[int] = []


def varlen_attention_stand_in(query, key, value, attention_mask, query_length, *args, position_ids=None,
                              is_causal=True, softmax_scale=None, **kwargs):
    """What flash_attn_varlen_func computes on one packed row: query [1, L, H, D], key / value [1, L, Hk, D] (Hk
    dividing H), a new sequence wherever position_ids [1, L] is 0; causal softmax(q k^T * scale) v within each
    sequence, [1, L, H, D]. Plain float arithmetic (the model's dtype)."""
    assert attention_mask is None and position_ids is not None, "the stand-in covers verl's packed (rmpad) forward"
    CALLS.append(query.shape[1])
    starts = (position_ids.reshape(-1) == 0).cumsum(0)
    length = starts.shape[0]
    allowed = (starts[:, None] == starts[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    groups = query.shape[2] // key.shape[2]
    key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
    scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * scale
    weights = scores.masked_fill(~allowed.to(scores.device), float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, value)


def install(engine_check, sp_size: int) -> None:
    """Make engine_check's workers run Ulysses with `sp_size` ranks per sequence: its FSDPEngineConfig with
    ulysses_sequence_parallel_size=sp_size, its HFModelConfig loading the model with attention `NAME`, and the
    stand-in behind verl's Ulysses attention."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from verl.models.transformers import monkey_patch

    AttentionInterface.register(NAME, flash_attention_forward)
    monkey_patch._flash_attention_forward = varlen_attention_stand_in
    engine_check.FSDPEngineConfig = partial(engine_check.FSDPEngineConfig, ulysses_sequence_parallel_size=sp_size)
    model_config = engine_check.HFModelConfig
    engine_check.HFModelConfig = lambda **kw: model_config(**{**kw, "override_config": {"attn_implementation": NAME}})
