"""Input validation shared by every public entry point: shapes, masks, dtypes, finiteness, beta, is_clip.

Imports torch only inside the tensor checks, so that `check_is_clip` serves the torch-free activation path.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def check_batch(logp: Tensor, ref_logp: Tensor, mask: Tensor, old_logp: Tensor | None = None,
                also_finite: dict[str, Tensor] | None = None) -> Tensor:
    """Validate a [B, T] batch of per-token log-probs and return the mask as a bool tensor.

    Raises TypeError / ValueError naming the offending argument when: an argument is not a tensor, shapes or devices
    differ, tensors are not 2-D, log-probs are not floating point, the mask holds values other than 0/1, or a log-prob is
    non-finite at a real (unmasked) token. Padding may hold anything (it is never read past this check).
    also_finite: further [B, T]-broadcastable tensors (already shape-checked) that must be finite at real tokens.
    One host synchronisation for all value checks.
    """
    import torch
    from torch import Tensor
    named = {"logp": logp, "ref_logp": ref_logp, "mask": mask}
    if old_logp is not None:
        named["old_logp"] = old_logp
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    for name, t in named.items():
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)} (the shape of logp)")
        if t.device != logp.device:
            raise ValueError(f"{name} is on {t.device}, logp on {logp.device}")
        if name != "mask" and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor of log-probabilities, got {t.dtype}")
    if mask.is_complex():
        raise TypeError(f"mask must be bool or 0/1, got {mask.dtype}")
    m = mask if mask.dtype == torch.bool else mask != 0
    not_binary = ((mask != 0) & (mask != 1)).any() if mask.dtype != torch.bool else torch.zeros((), dtype=torch.bool)
    flags = [("mask", not_binary.to(mask.device))]
    for name, t in named.items():
        if name != "mask":
            nonfinite_real_token = (~torch.isfinite(t.detach()) & m).any()
            flags.append((name, nonfinite_real_token))
    for name, t in (also_finite or {}).items():
        flags.append((name, (~torch.isfinite(t.detach()) & m).any()))
    bad = torch.stack([f for _, f in flags]).tolist()
    if bad[0]:
        raise ValueError("mask must contain only 0/1 (or bool) values")
    for (name, _), is_bad in zip(flags[1:], bad[1:]):
        if is_bad:
            raise ValueError(f"{name} has non-finite values (nan/inf) at unmasked tokens")
    return m


def check_statistics(cv_coef: Tensor, baseline: Tensor, alone: Tensor | None, logp: Tensor) -> dict[str, Tensor]:
    """KLStatistics rows must align with the [B, T] batch: cv_coef [B], baseline [B, T] floating, alone None or [B]
    bool, all on logp's device.

    Returns the tensors to check for finiteness at real tokens (broadcast to [B, T]) in check_batch's one sync.
    """
    from torch import Tensor
    for name, t, shape in (("statistics.cv_coef", cv_coef, logp.shape[:1]), ("statistics.baseline", baseline,
                                                                            logp.shape)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (rows aligned with logp "
                             f"{tuple(logp.shape)}: slice the statistics with the batch)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != logp.device:
            raise ValueError(f"{name} is on {t.device}, logp on {logp.device}")
    if alone is not None:
        import torch
        if not isinstance(alone, Tensor) or alone.dtype != torch.bool or alone.shape != logp.shape[:1]:
            raise TypeError(f"statistics.alone must be None or a bool tensor of shape ({logp.shape[0]},)")
        if alone.device != logp.device:
            raise ValueError(f"statistics.alone is on {alone.device}, logp on {logp.device}")
    return {"statistics.cv_coef": cv_coef[:, None].expand(logp.shape), "statistics.baseline": baseline}


def check_group(group: Tensor | None, logp: Tensor) -> None:
    """group, when given, holds one integer id per row of the batch ([B], on logp's device)."""
    if group is None:
        return
    import torch
    from torch import Tensor
    if not isinstance(group, Tensor):
        raise TypeError(f"group must be a torch.Tensor of integer ids, got {type(group).__name__}")
    if group.shape != logp.shape[:1]:
        raise ValueError(f"group has shape {tuple(group.shape)}, expected ({logp.shape[0]},): one id per sequence")
    if group.is_floating_point() or group.is_complex() or group.dtype == torch.bool:
        raise TypeError(f"group must hold integer ids, got {group.dtype}")
    if group.device != logp.device:
        raise ValueError(f"group is on {group.device}, logp on {logp.device}")


def check_beta(beta: float | Tensor) -> None:
    """beta must be a finite, non-negative real number (python number or 0-dim tensor)."""
    from torch import Tensor
    if isinstance(beta, Tensor):
        if beta.dim() != 0:
            raise ValueError(f"beta must be a scalar, got a tensor of shape {tuple(beta.shape)}")
        value = float(beta.detach())
    elif isinstance(beta, numbers.Real) and not isinstance(beta, bool):
        value = float(beta)
    else:
        raise TypeError(f"beta must be a real number, got {type(beta).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"beta must be finite and >= 0, got {value}")


def check_is_clip(is_clip: float | None) -> None:
    """is_clip, when given, is the cap on importance weights: a finite number >= 1."""
    if is_clip is None:
        return
    if isinstance(is_clip, bool) or not isinstance(is_clip, numbers.Real):
        raise TypeError(f"is_clip must be a number or None, got {type(is_clip).__name__}")
    if not math.isfinite(is_clip) or is_clip < 1:
        raise ValueError(f"is_clip must be finite and >= 1 (a cap on importance weights), got {is_clip}")
