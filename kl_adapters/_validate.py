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
                also_finite: dict[str, Tensor | tuple[Tensor, tuple[float, float]]] | None = None,
                also_false: dict[str, Tensor] | None = None) -> Tensor:
    """`checked_batch`'s mask."""
    return checked_batch(logp, ref_logp, mask, old_logp, also_finite, also_false)[0]


def checked_batch(logp: Tensor, ref_logp: Tensor, mask: Tensor, old_logp: Tensor | None = None,
                  also_finite: dict[str, Tensor | tuple[Tensor, tuple[float, float]]] | None = None,
                  also_false: dict[str, Tensor] | None = None) -> tuple[Tensor, bool]:
    """Validate a [B, T] batch of per-token log-probs; return the mask as a bool tensor, and whether every checked
    tensor is finite (and within its bounds) at every token, padding included: then multiplying by the mask zeroes
    the padding as torch.where does, and costs less.

    Raises TypeError / ValueError naming the offending argument when: an argument is not a tensor, shapes or devices
    differ, tensors are not 2-D, log-probs are not floating point, the mask holds values other than 0/1, or a log-prob is
    non-finite at a real (unmasked) token. Padding may hold anything (it is never read past this check).
    also_finite: further [B, T] or [B, 1] tensors (already shape-checked) that must be finite at real tokens, or
    (tensor, (low, high)) for a tensor that must also lie within [low, high] there (0 in it); also_false: 0-dim bool
    tensors, each raising ValueError(its key) when true. One host synchronisation for all (a second one, for the exact
    check at real tokens, only where a tensor's padding holds non-finite or out-of-bounds values).
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
    checked = {name: (t, None) for name, t in named.items() if name != "mask"}
    checked |= {name: v if isinstance(v, tuple) else (v, None) for name, v in (also_finite or {}).items()}
    # one min and max per tensor over all its tokens, padding included (nan propagates): where they are finite and
    # within the tensor's bounds, so is every real token; otherwise `_check_real_tokens` decides on the real ones
    rules = [(message, flag) for message, flag in (also_false or {}).items()]
    flags = [not_binary, *(f for _, f in rules)]
    values = _values([f.to(mask.device) for f in flags] + [x for t, _ in checked.values() for x in _extremes(t)])
    for (message, _), is_bad in zip(rules, values[1:len(flags)]):
        if is_bad:
            raise ValueError(message)
    if values[0]:
        raise ValueError("mask must contain only 0/1 (or bool) values")
    extremes = values[len(flags):]
    everywhere = all(_within(extremes[2 * i: 2 * i + 2], bounds) for i, (_, bounds) in enumerate(checked.values()))
    if not everywhere:
        _check_real_tokens(checked, m)
    return m, everywhere


def _within(extremes: list[float], bounds: tuple[float, float] | None) -> bool:
    low, high = extremes
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    return bounds is None or bounds[0] <= low <= high <= bounds[1]


def _check_real_tokens(checked: dict, m: Tensor) -> None:
    """The exact check, at real tokens only (padding may hold anything): ValueError naming the first tensor that is
    non-finite or out of its bounds there. `checked`: name -> ([B, T] or [B, 1] tensor, (low, high) or None)."""
    import torch
    rows = m.any(-1, keepdim=True)
    values = _values([x for t, _ in checked.values()
                      for x in _extremes(torch.where(rows if t.shape[-1] == 1 else m, t.detach(), 0))])
    for i, (name, (_, bounds)) in enumerate(checked.items()):
        low, high = values[2 * i: 2 * i + 2]
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"{name} has non-finite values (nan/inf) at unmasked tokens")
        if not _within([low, high], bounds):
            raise ValueError(f"{name} has values outside [{bounds[0]}, {bounds[1]}] at unmasked tokens")


def _values(scalars: list[Tensor]) -> list[float]:
    """The values of 0-dim tensors of any dtypes (on one device), in order, in one host synchronisation: stacked per
    dtype (one stack of mixed dtypes promotes element by element, which is slower on CPU)."""
    import torch
    if not scalars:
        return []
    by_dtype: dict = {}
    for i, x in enumerate(scalars):
        by_dtype.setdefault(x.dtype, []).append(i)
    order = [i for positions in by_dtype.values() for i in positions]
    flat = torch.cat([torch.stack([scalars[i] for i in positions]).to(torch.float64)
                      for positions in by_dtype.values()]).tolist()
    out = [0.0] * len(scalars)
    for i, value in zip(order, flat):
        out[i] = value
    return out


def _extremes(t: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) of t, 0-dim (nan if t holds one); (0, 0) for an empty t (0 is within every bounds used)."""
    import torch
    if t.numel() == 0:
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        return zero, zero
    return torch.aminmax(t.detach())


def check_statistics(statistics, logp: Tensor) -> dict[str, Tensor]:
    """KLStatistics rows must align with the [B, T] batch: cv_coef, eos_coef, past_coef [B], baseline and eos_count
    [B, T], floating point, on logp's device.

    Returns the tensors to check for finiteness at real tokens ([B, 1] or [B, T]) in check_batch's one sync.
    """
    from torch import Tensor
    rows = tuple(logp.shape[:1])
    named = {"cv_coef": rows, "eos_coef": rows, "past_coef": rows, "baseline": tuple(logp.shape),
             "eos_count": tuple(logp.shape)}
    out = {}
    for field, shape in named.items():
        name, t = f"statistics.{field}", getattr(statistics, field)
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} (rows aligned with logp "
                             f"{tuple(logp.shape)}: slice the statistics with the batch, KLStatistics.with_width for "
                             "the positions)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != logp.device:
            raise ValueError(f"{name} is on {t.device}, logp on {logp.device}")
        out[name] = t if t.dim() == 2 else t[:, None]
    return out


def eos_rule(statistics, eos) -> dict[str, Tensor]:
    """check_batch's also_false rule for given statistics whose termination coefficient needs an EndOfSequence."""
    if statistics is None or eos is not None:
        return {}
    return {"statistics.eos_coef is nonzero (they were computed with eos=EndOfSequence(...)) but this call has no eos: "
            "pass the same batch's EndOfSequence, or statistics computed without it":
            (statistics.eos_coef.detach() != 0).any()}


def check_statistics_options(statistics, group, task) -> None:
    """Given statistics replace the ones group / task would shape: both together are a silent no-op."""
    if statistics is not None and group is not None:
        raise ValueError("group only selects the rows statistics are computed from: pass statistics or group, not both")
    if statistics is not None and task is not None:
        raise ValueError("task only shapes statistics computed from this batch: pass it to kl_statistics / "
                         "full_statistics, which made the given statistics")


def check_task(task, logp: Tensor) -> dict[str, Tensor]:
    """TaskAdvantages: advantages [B] or [B, T] floating on logp's device, beta finite and > 0, normalized a bool.

    Returns the advantages as [B, 1] or [B, T] for check_batch's finiteness check at real tokens.
    """
    import torch
    from torch import Tensor

    from .reductions import TaskAdvantages
    if not isinstance(task, TaskAdvantages):
        raise TypeError(f"task must be a kl_adapters.TaskAdvantages, got {type(task).__name__}")
    adv = task.advantages
    if not isinstance(adv, Tensor) or not adv.is_floating_point():
        raise TypeError(f"task.advantages must be a floating-point torch.Tensor, got {getattr(adv, 'dtype', type(adv))}")
    if tuple(adv.shape) not in (tuple(logp.shape[:1]), tuple(logp.shape)):
        raise ValueError(f"task.advantages has shape {tuple(adv.shape)}, expected ({logp.shape[0]},) or "
                         f"{tuple(logp.shape)}")
    if adv.device != logp.device:
        raise ValueError(f"task.advantages is on {adv.device}, logp on {logp.device}")
    beta, out = task.beta, {"task.advantages": adv if adv.dim() == 2 else adv[:, None]}
    if isinstance(beta, Tensor):  # one ratio per row: finite and > 0 (checked in check_batch's one sync)
        if beta.dim() not in (0, 1) or (beta.dim() == 1 and tuple(beta.shape) != tuple(logp.shape[:1])):
            raise ValueError(f"task.beta must be a number or a [B] tensor, B = {logp.shape[0]}; got shape "
                             f"{tuple(beta.shape)}")
        if not beta.is_floating_point() or beta.device != logp.device:
            raise TypeError(f"task.beta must be a floating-point tensor on {logp.device}")
        out["task.beta (> 0)"] = torch.where(beta > 0, beta, float("nan")).expand(logp.shape[:1])[:, None]
    elif isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"task.beta must be a finite number > 0 (the KL coefficient on the advantages' scale), got "
                         f"{task.beta!r}")
    if not isinstance(task.normalized, bool):
        raise TypeError(f"task.normalized must be a bool, got {type(task.normalized).__name__}")
    return out


def check_eos(eos, logp: Tensor) -> dict[str, tuple[Tensor, tuple[float, float]]]:
    """EndOfSequence: prob [B, T] floating, is_eos [B, T] bool, on logp's device; horizon None or an int >= T.

    Returns (prob, (0, 1)) for check_batch's one sync: prob must be finite and in [0, 1] at real tokens.
    """
    import torch
    from torch import Tensor

    from .reductions import EndOfSequence
    if not isinstance(eos, EndOfSequence):
        raise TypeError(f"eos must be a kl_adapters.EndOfSequence, got {type(eos).__name__}")
    for name, t in (("eos.prob", eos.prob), ("eos.is_eos", eos.is_eos)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)} (the shape of logp)")
        if t.device != logp.device:
            raise ValueError(f"{name} is on {t.device}, logp on {logp.device}")
    if not eos.prob.is_floating_point():
        raise TypeError(f"eos.prob must be floating point, got {eos.prob.dtype}")
    if eos.is_eos.dtype != torch.bool:
        raise TypeError(f"eos.is_eos must be a bool tensor, got {eos.is_eos.dtype}")
    h = eos.horizon
    if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < logp.shape[1]):
        raise ValueError(f"eos.horizon must be None or an int >= the batch width {logp.shape[1]}, got {h!r}")
    return {"eos.prob (a probability in [0, 1])": (eos.prob, (0.0, 1.0))}


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


def check_discount(discount: float, preset) -> None:
    """discount (gamma of the future-KL return) is a number in (0, 1]; < 1 only for a preset that has that return."""
    if isinstance(discount, bool) or not isinstance(discount, numbers.Real) or not 0.0 < discount <= 1.0:
        raise ValueError(f"discount must be a number in (0, 1] (1 = the exact sequence-level KL gradient), got "
                         f"{discount!r}")
    if discount < 1.0 and not preset.discountable:
        raise ValueError(f"preset {preset.name!r} has no future-KL return to discount, so discount={discount} would be "
                         "a silent no-op; discountable: sequence, reward, sequence-plain, reward-plain, full")


def check_is_clip(is_clip: float | None, preset=None) -> None:
    """is_clip, when given, is the cap on importance weights: a finite number >= 1; with `preset` (a Preset), also one
    that has importance weights to cap (`full`'s are exact and uncapped; `k3-loss` and the like apply none)."""
    if is_clip is None:
        return
    if isinstance(is_clip, bool) or not isinstance(is_clip, numbers.Real):
        raise TypeError(f"is_clip must be a number or None, got {type(is_clip).__name__}")
    if not math.isfinite(is_clip) or is_clip < 1:
        raise ValueError(f"is_clip must be finite and >= 1 (a cap on importance weights), got {is_clip}")
    if preset is not None and preset.needs_full_logits:
        raise ValueError(f"is_clip does not apply to preset {preset.name!r}: its importance weights are exact "
                         "(uncapped); drop is_clip")
    if preset is not None and not preset.uses_importance_weights:
        raise ValueError(f"preset {preset.name!r} applies no importance weights, so is_clip would be a silent no-op; "
                         "drop is_clip or use a preset that has them (sequence, reward, token)")
