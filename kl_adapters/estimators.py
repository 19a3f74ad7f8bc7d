"""Per-token KL estimators, computed in float32 or wider, and the reverse cumulative sum.

Notation (per sampled token y_t with prefix y_<t):
    k1_t = log pi(y_t) - log pi_ref(y_t)                      (log-ratio; value-unbiased for KL_t)
    k2_t = k1_t**2 / 2                                         (biased value; gradient k1_t * grad log pi)
    k3_t = pi_ref/pi - 1 - log(pi_ref/pi) = expm1(-k1_t) + k1_t   (value-unbiased, >= 0)

These functions return *values*. Which gradient a configuration produces is decided in `presets.py`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def working_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: never compute KL terms in bf16/fp16."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def as_float(flags: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool tensor as 0/1 in dtype, through its bytes (uint8): the same values as flags.to(dtype), whose conversion
    from bool is the slower one on CPU."""
    return flags.view(torch.uint8).to(dtype)


def k1(log_ratio: Tensor) -> Tensor:
    """k1 = log pi/pi_ref (the log-ratio itself)."""
    return log_ratio


def k2(log_ratio: Tensor) -> Tensor:
    """k2 = (log pi/pi_ref)^2 / 2."""
    return 0.5 * log_ratio.square()


def k3(log_ratio: Tensor) -> Tensor:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi) = expm1(-k1) + k1, exact near k1 = 0 (no cancellation)."""
    return torch.expm1(-log_ratio) + log_ratio


def capped(log_x: Tensor) -> Tensor:
    """log_x capped at half the log of its dtype's largest value (44 in float32, 354 in float64), so that exp(log_x)
    and sums of many such terms stay finite: importance weights of a batch far off-policy and pi_ref/pi of a token the
    policy all but excludes. The cap acts only where the exact value would overflow the working dtype (tested:
    tests/core/test_faults.py::test_overflowing_weights_stay_finite); there it biases, which is_ess shows."""
    return log_x.clamp(max=0.5 * math.log(torch.finfo(log_x.dtype).max))


def reverse_cumsum(x: Tensor, discount: float = 1.0) -> Tensor:
    """y_t = sum_{s >= t} discount^(s - t) x_s along the last dimension (reward-to-go; discount 1: the plain sum).

    A discount < 1 runs in blocks short enough that discount^-length stays below e^30 (scaled cumulative sums within
    a block, carried across blocks), so no power overflows at any length. Pinned by
    tests/core/test_discount.py::test_discounted_reverse_cumsum_equals_the_recursion."""
    if discount == 1.0:
        return x.flip(-1).cumsum_(-1).flip(-1)  # (flip copies: the cumulative sum runs in place on the copy)
    width = x.shape[-1]
    block = max(1, min(width, int(30.0 / -math.log(discount))))
    n_blocks = -(-width // block)
    padded = torch.nn.functional.pad(x, (0, n_blocks * block - width)).unflatten(-1, (n_blocks, block))
    powers = discount ** torch.arange(block, dtype=x.dtype, device=x.device)
    within = (padded * powers).flip(-1).cumsum(-1).flip(-1) / powers  # the sum to the end of each block
    carry = torch.zeros_like(within[..., 0, 0])
    out = torch.empty_like(within)
    tail = discount ** (block - torch.arange(block, dtype=x.dtype, device=x.device))  # discount^(block - j)
    for k in range(n_blocks - 1, -1, -1):  # y at block k's positions = within + discount^(block - j) y_(next block)
        out[..., k, :] = within[..., k, :] + tail * carry[..., None]
        carry = out[..., k, 0]
    return out.flatten(-2)[..., :width]
