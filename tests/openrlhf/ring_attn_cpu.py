"""TEST-ONLY CPU stand-in for ring-flash-attn (and for flash-attn's ``all_gather``), so that OpenRLHF 0.11.2's ring
attention (``--ds.ring_attn_size > 1``) runs on CPU over gloo. Not part of kl-adapters, not ring-flash-attn: installed
by tests/openrlhf/ring_worker_openrlhf.py only (`install`). ring-flash-attn cannot be imported here (it imports
flash-attn's CUDA kernels at module top), and the suite's flash_attn import stub has no working ``all_gather``.

OpenRLHF's own ring-attention code runs unchanged around it: DeepspeedStrategy.setup_ring_attn (the "sp" group of its
device mesh, then ring_flash_attn.substitute_hf_flash_attn), Actor.forward's unpad_and_slice_tensor (each rank its
contiguous slice of the packed micro-batch, padded to a multiple of the ring size; update_ring_attn_params hands the
global cu_seqlens to ring_flash_attn.update_ring_flash_attn_params) and gather_and_pad_tensor (flash-attn's all_gather
of the per-token log-probs, then OpenRLHF's unpadding). What stands in:

* ``substitute_hf_flash_attn(group, heads_k_stride)``: as ring-flash-attn 0.1.8 does, puts the ring attention in
  transformers' ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]``, here `ring_attention`;
* ``update_ring_flash_attn_params(cu_seqlens, group)``: keeps the global cu_seqlens (ring-flash-attn derives each
  rank's q / k offsets from them, ``llama3_flash_attn_prepare_cu_seqlens``);
* `ring_attention`: what ring-flash-attn's llama3 varlen attention computes for this rank's queries: the keys and values
  of the whole packed row all-gathered over the ring group, causal softmax attention within each sequence of
  cu_seqlens; the gradient of each rank's keys and values summed over the ranks (the kernel's reduce-scatter);
* `all_gather`: flash_attn.utils.distributed.all_gather (AllGatherFunc: all-gather along dim 0, reduce-scatter
  backward), which gather_and_pad_tensor calls.

Plain float arithmetic; every call of `ring_attention` is logged in `CALLS` (query and key lengths).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

#: (this rank's query length, the gathered key length) of every `ring_attention` call
CALLS: list[tuple[int, int]] = []
_STATE: dict = {}


class _Gather(torch.autograd.Function):
    """Concatenation along `dim` of every rank's tensor; backward: the gradient summed over the ranks, this rank's
    slice (a reduce-scatter, as an all-reduce: gloo)."""

    @staticmethod
    def forward(ctx, tensor, group, dim):
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        ctx.group, ctx.dim, ctx.length = group, dim, tensor.shape[dim]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * ctx.length, ctx.length), None, None


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """flash_attn.utils.distributed.all_gather: every rank's tensor concatenated along dim 0."""
    return _Gather.apply(tensor, group, 0)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group) -> None:
    _STATE["cu_seqlens"] = cu_seqlens.clone()


def ring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface (query [1, H, L, D], key / value [1, Hk, L, D] of this rank's slice) ->
    ([1, L, H, D], None): causal attention of this rank's queries over the whole ring's keys, within each sequence of
    the global cu_seqlens (set by update_ring_flash_attn_params)."""
    assert query.shape[0] == 1 and attention_mask is None and dropout == 0.0, "packed ring-attention forward only"
    group, cu_seqlens = _STATE["group"], _STATE["cu_seqlens"].to(query.device)
    keys, values = _Gather.apply(key, group, 2), _Gather.apply(value, group, 2)
    local, total = query.shape[2], keys.shape[2]
    CALLS.append((local, total))
    assert int(cu_seqlens[-1]) == total, "cu_seqlens must cover the gathered packed row"
    positions = torch.arange(total, device=query.device)
    sequence = torch.bucketize(positions, cu_seqlens[1:].long(), right=True)  # the sequence of each packed token
    queries = dist.get_rank(group) * local + torch.arange(local, device=query.device)
    allowed = (sequence[queries][:, None] == sequence[None, :]) & (positions[None, :] <= queries[:, None])
    repeat = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.einsum("bhqd,bhkd->bhqk", query, keys) * scale
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bhkd->bqhd", weights, values), None


def substitute_hf_flash_attn(process_group, heads_k_stride: int) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _STATE["group"] = process_group
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = ring_attention


def install() -> None:
    """This process imports `ring_flash_attn` as this stand-in, and OpenRLHF's ring_attn_utils gathers with
    `all_gather` (its module-level binding of flash-attn's)."""
    from openrlhf.models import ring_attn_utils

    module = types.ModuleType("ring_flash_attn", "TEST-ONLY CPU stand-in (tests/openrlhf/ring_attn_cpu.py)")
    module.substitute_hf_flash_attn = substitute_hf_flash_attn
    module.update_ring_flash_attn_params = update_ring_flash_attn_params
    sys.modules["ring_flash_attn"] = module
    ring_attn_utils.all_gather = all_gather
