"""CPU stub for tests only (see flash_attn/__init__.py): flash-attn's padding helpers, which OpenRLHF's
--ds.packing_samples path calls (models/ring_attn_utils.py: unpad_and_slice_tensor, gather_and_pad_tensor), as the
plain index operations flash_attn/bert_padding.py defines them: a [batch, seqlen, ...] tensor's rows where
attention_mask is 1, concatenated in row-major order, and back. No kernels; the packed forward's attention is then
transformers' own (eager / sdpa masks each packed sequence from its position ids)."""

import torch
import torch.nn.functional as F
from einops import rearrange  # noqa: F401  (re-exported like the real module)


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tensor[indices] along the first axis."""
    return tensor[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """(the unmasked rows [nnz, ...], their flat indices, cu_seqlens, max seqlen, seqlens): flash-attn's signature."""
    seqlens = attention_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of `unpad_input`: zeros at the masked positions, [batch, seqlen, ...]."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
