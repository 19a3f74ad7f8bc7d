"""OpenRLHF adapter, positions: OpenRLHF right-pads ``[prompt, response]``, so a row's response starts at its prompt's
length; the statistics' baseline is per response position and the termination control variate counts the positions
left to the horizon from the response's start. The adapter therefore hands the core every [B, T] tensor `aligned`
(each row shifted left to its first action token): a permutation of each row's tokens, which changes no preset's value
or gradient. The horizon is OpenRLHF's maximum response length (`_horizon`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...reductions import EndOfSequence

if TYPE_CHECKING:  # pragma: no cover
    from .eos_payload import EosPayload


def _pad(x: Tensor, width: int) -> Tensor:
    """[B, T] -> [B, width]: zero columns appended, or columns past `width` dropped."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x[..., :width]


def response_start(mask: Tensor) -> Tensor:
    """[B] the column of each row's first action token (0 for a row without one)."""
    return (mask != 0).int().argmax(-1)


def shifted(x: Tensor, offset: Tensor) -> Tensor:
    """out[b, j] = x[b, j + offset_b] where 0 <= j + offset_b < T, else 0 (gradient flows through the kept entries)."""
    width = x.shape[-1]
    index = torch.arange(width, device=x.device) + offset[:, None].to(x.device)
    inside = (index >= 0) & (index < width)
    return x.gather(-1, index.clamp(0, max(width - 1, 0))).masked_fill(~inside, 0)


@dataclass(frozen=True)
class Aligned:
    """The core's view of a batch in OpenRLHF's action layout (see the module docstring): each row shifted left to its
    first action token (`mask`), zero-filled on the right, `width` columns. `aligned` builds it."""

    mask: Tensor
    width: int

    def __call__(self, x: Tensor) -> Tensor:
        return _pad(shifted(x, response_start(self.mask)), self.width)

    def back(self, x: Tensor) -> Tensor:
        """The inverse at the real tokens: x [B, width] in aligned columns back at the action mask's columns."""
        return shifted(_pad(x, self.mask.shape[1]), -response_start(self.mask))

    def end_of_sequence(self, eos: EosPayload, horizon: int) -> EndOfSequence:
        """The core's EndOfSequence of a payload in the action layout (requires width <= horizon)."""
        return EndOfSequence(self(eos.prob), self(eos.is_eos).bool(), horizon)


def aligned(mask: Tensor, horizon: int | None = None) -> Aligned:
    """The `Aligned` view of a batch with action mask `mask` [B, T]: T columns, or with a horizon (the maximum response
    length, for `EndOfSequence`) min(T, horizon) columns, past which no response reaches once aligned; a response
    spanning more columns than the horizon is refused (ValueError: counting its remaining positions from a horizon it
    exceeds would be wrong)."""
    width = mask.shape[1]
    if horizon is None or width <= horizon:
        return Aligned(mask, width)
    real = (mask != 0).int()
    last = width - 1 - real.flip(-1).argmax(-1)
    span = int(torch.where(real.any(-1), last - response_start(mask) + 1, 0).max())
    if span > horizon:
        raise ValueError(f"a response spans {span} tokens, more than the horizon {horizon} (--rollout.max_new_tokens; "
                         "--data.max_len when unset or with --train.agent_func_path): raise it to the longest response")
    return Aligned(mask, horizon)


def _horizon(args: Any) -> int:
    """The maximum response length (`EndOfSequence.horizon`): --rollout.max_new_tokens (vLLM's max_tokens), or
    --data.max_len (what OpenRLHF truncates prompt + response to) when it is unset or an agent makes the responses
    (--train.agent_func_path: several turns, observations included)."""
    new_tokens = args.rollout.max_new_tokens
    return args.data.max_len if not new_tokens or args.train.agent_func_path else new_tokens
