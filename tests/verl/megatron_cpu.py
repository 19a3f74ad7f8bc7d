"""TEST-ONLY stand-ins that let verl 0.9.1's Megatron engine run a megatron-core 0.16.1 GPTModel on CPU (gloo), and the
tiny GPTModel of megatron_check.py (CPU and GPU). Not part of kl-adapters; imported only by megatron_check.py.

megatron-core's local (non-Transformer-Engine) GPT layer and its schedules stop on CPU where they put tensors on
``torch.cuda.current_device()`` / ``device="cuda"`` (RoPE, DotProductAttention's causal mask, the token counter of
forward_backward_no_pipelining). `install` (only where torch has no CUDA) points ``torch.cuda.current_device`` at the
CPU and maps every torch call's CUDA device to the CPU (`CudaToCpu`). verl's Megatron forward is written for
Transformer Engine's attention: its remove-padding (thd) forward hands the core attention packed tensors with
cu_seqlens, its bshd forward a [B, S] padding mask, and megatron's own DotProductAttention takes neither;
`PackedCausalAttention` (the core attention of `gpt_layer_spec`, on CPU and GPU) computes what Transformer Engine's
does there: causal softmax attention within each packed sequence, plain torch. Everything verl and megatron do around
it -- verl's packing (`preprocess_thd_engine`), megatron's RoPE with cu_seqlens, the vocab-parallel LM head and cross
entropy, megatron's forward-backward schedule, verl's unpacking -- runs as in a real run. The model is built directly
(`gpt_model`), not through verl's Megatron bridge from a HuggingFace checkpoint (Megatron-Bridge needs Transformer
Engine).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from torch.overrides import TorchFunctionMode

#: every (tokens, sequences) the stand-in attention saw: the test checks it ran on verl's packed micro-batches
CALLS: list[tuple[int, int]] = []


def _cpu(value):
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
        return "cpu"
    return value


class CudaToCpu(TorchFunctionMode):
    """Every torch call asking for a CUDA device (megatron's ``torch.zeros(..., device="cuda")`` in its schedules,
    its default causal mask, ``.to(torch.cuda.current_device())``) gets the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: _cpu(v) for k, v in (kwargs or {}).items()}
        return func(*(_cpu(a) for a in args), **kwargs)


def install() -> None:
    """Where torch has no CUDA (test-only; CUDA machines are left alone): ``torch.cuda.current_device()`` is the CPU,
    and `CudaToCpu` is entered for the rest of the process."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        CudaToCpu().__enter__()


class PackedCausalAttention(MegatronModule):
    """Core attention with DotProductAttention's interface: query [t, h, d] with packed_seq_params (verl's thd forward:
    a new sequence at each cu_seqlens_q_padded offset) or [s, b, h, d] without (causal, attention_mask ignored: verl's
    bshd forward pads at the end); key / value with h / num_query_groups fewer heads. Returns [t, h * d] or
    [s, b, h * d]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.heads, self.groups = config.num_attention_heads // tp, config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        repeat = self.heads // self.groups
        key, value = key.repeat_interleave(repeat, dim=-2), value.repeat_interleave(repeat, dim=-2)
        if packed_seq_params is None:  # [s, b, h, d] -> [b, h, s, d]
            s, b = query.shape[:2]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = self._causal(q, k, v, torch.zeros(s, dtype=torch.long, device=q.device))
            CALLS.append((s * b, b))
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        offsets = packed_seq_params.cu_seqlens_q_padded
        if offsets is None:
            offsets = packed_seq_params.cu_seqlens_q
        t = query.shape[0]
        segment = torch.bucketize(torch.arange(t, device=query.device), offsets[1:].to(query.device), right=True)
        q, k, v = (x.permute(1, 0, 2)[None] for x in (query, key, value))  # [1, h, t, d]
        CALLS.append((t, len(offsets) - 1))
        return self._causal(q, k, v, segment)[0].permute(1, 0, 2).reshape(t, -1)

    def _causal(self, q, k, v, segment):
        n = q.shape[-2]
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = torch.einsum("...qd,...kd->...qk", q, k) * self.scale
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def gpt_layer_spec():
    """megatron-core's local GPT layer spec (no Transformer Engine), RMSNorm, with `PackedCausalAttention` as its core
    attention. Not megatron's own DotProductAttention, on a GPU either: verl's Megatron forward is written for
    Transformer Engine's attention, and DotProductAttention takes neither its packed (thd) tensors nor the [B, S]
    padding mask of its bshd forward (it expects [B, 1, S, S])."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    return spec


def gpt_model(vocab: int, *, seed: int = 0, device="cpu", tp: int = 1):
    """A tiny random megatron GPTModel (2 layers, hidden 32, 4 heads in 2 query groups, SwiGLU, RMSNorm, RoPE, untied
    output layer), float32 parameters, on `device`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm",
        gated_linear_unit=True, add_bias_linear=False, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        init_method_std=0.2)
    model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(), vocab_size=vocab,
                     max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return model.to(device)
