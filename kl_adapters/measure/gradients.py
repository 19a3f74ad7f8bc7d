"""The measured gradients: every KL surrogate as sum_t c_t grad log pi(y_t) with detached weights c, one backward each.

For a batch of whole prompt groups (`TokenBatch`) and the plan's quantities (`Plan.quantities`), `fold_vectors`
computes each quantity's per-token weights C_q [B, T] from the batch's detached log-probs (kl_adapters'
`kl_coefficients`: the same weights the adapters apply), then the vector

    v_q = sum_{b, t} scale * C_q[b, t] * grad_theta log pi(y_{b, t})

by one backward of sum(C_q * logp) through the model, seen through a `GradientView`: the gradient of the chosen
parameters, flattened (exact), or a count sketch of it (`GradientView(sketch=m)`: m buckets, each parameter added
with a random sign to one bucket; E<S x, S y> = <x, y> over the sketch, and for a fixed sketch
|S x|^2 / |x|^2 = 1 +- sqrt(2 / m)). Memory: the model, one transient gradient and the [Q, m] vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..reductions import EndOfSequence, TaskAdvantages
from ..surrogate import kl_coefficients
from .plan import Plan


@dataclass(frozen=True)
class TokenBatch:
    """Completions of whole prompt groups (G consecutive rows per prompt) as the KL term sees them."""

    logp: Tensor  # [B, T] log pi(y_t | x, y_<t) carrying the gradient to the measured parameters
    ref_logp: Tensor  # [B, T] log pi_ref
    mask: Tensor  # [B, T] bool
    group: Tensor  # [B] prompt-group ids
    old_logp: Tensor | None = None  # [B, T] the sampler's log-probs off-policy; None on-policy
    eos: EndOfSequence | None = None  # pi(EOS | prefix) for the termination control variate
    rewards: Tensor | None = None  # [B] one reward per completion


class GradientView:
    """The measured parameters' gradient as one vector: flattened (sketch None) or count-sketched to `sketch` values.

    The sketch's bucket and sign of each parameter entry come from a generator seeded by (seed, parameter index),
    regenerated at each call (no memory held for them)."""

    def __init__(self, parameters: Sequence[Tensor], sketch: int | None = None, seed: int = 0):
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise ValueError("no parameter requires a gradient: nothing to measure")
        if sketch is not None and sketch < 1:
            raise ValueError(f"the sketch needs at least one bucket, got {sketch}")
        self.numel = sum(p.numel() for p in self.parameters)
        self.sketch = sketch
        self.seed = seed
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.parameters) else torch.float32

    @property
    def dimension(self) -> int:
        return self.numel if self.sketch is None else self.sketch

    def project(self, grads: Sequence[Tensor | None]) -> Tensor:
        """The gradient (one tensor per parameter, None = zero) as a [dimension] vector of `dtype`."""
        device = self.parameters[0].device
        if self.sketch is None:
            return torch.cat([torch.zeros(p.numel(), dtype=self.dtype, device=device) if g is None
                              else g.reshape(-1).to(self.dtype) for p, g in zip(self.parameters, grads)])
        out = torch.zeros(self.sketch, dtype=self.dtype, device=device)
        for i, g in enumerate(grads):
            if g is None:
                continue
            gen = torch.Generator(device=g.device).manual_seed(self.seed * 1_000_003 + i)
            bucket = torch.randint(0, self.sketch, (g.numel(),), generator=gen, device=g.device)
            sign = torch.randint(0, 2, (g.numel(),), generator=gen, device=g.device).to(self.dtype) * 2 - 1
            out.index_add_(0, bucket.to(device), (g.reshape(-1).to(self.dtype) * sign.to(device)))
        return out


def advantages(rewards: Tensor, group: Tensor, scale: bool) -> Tensor:
    """GRPO's advantages per prompt group: r - mean, divided by (std + 1e-4) with Bessel's correction when `scale`
    (TRL 1.16 scale_rewards="group", verl's norm_adv_by_std_in_grpo); rows of a group need not be consecutive."""
    same = torch.unique(group, return_inverse=True)[1]
    r = rewards.to(torch.float64)
    size = torch.zeros(int(same.max()) + 1, dtype=torch.float64, device=r.device).index_add_(0, same,
                                                                                             torch.ones_like(r))
    mean = torch.zeros_like(size).index_add_(0, same, r) / size
    centred = r - mean[same]
    if not scale:
        return centred
    std = (torch.zeros_like(size).index_add_(0, same, centred.square()) / (size - 1).clamp(min=1)).sqrt()
    return centred / (std[same] + 1e-4)


def coefficients(batch: TokenBatch, plan: Plan) -> dict[str, Tensor]:
    """Each quantity's detached per-token weight C_q [B, T] (zero at padding) before the fold's scale."""
    dtype = torch.float64 if batch.logp.dtype == torch.float64 else torch.float32
    mask = batch.mask.to(dtype)
    statistics = {"group": batch.group, "eos": batch.eos}
    task = None
    if batch.rewards is not None:
        adv = advantages(batch.rewards, batch.group, plan.scale_rewards).to(dtype)
        task = TaskAdvantages(adv, plan.beta, plan.scale_rewards)

    def weights(preset, fit_task: bool) -> Tensor:
        extra = {**statistics, "task": task if fit_task else None} if preset.uses_batch_statistics else {}
        return kl_coefficients(batch.logp, batch.ref_logp, batch.mask, preset=preset, old_logp=batch.old_logp,
                               **extra).to(dtype)

    exact = weights(plan.reference, fit_task=False)
    by_preset = {name: weights(plan.presets[name], fit_task=True) - exact for name in plan.compared}
    judged = by_preset[plan.split]
    length = batch.mask.sum(-1)
    out = {}
    for b, (low, high) in enumerate(plan.bins):
        inside = ((length >= low) & (length < high)).to(dtype)[:, None]
        out[f"exact@{b}"] = exact * inside
        out[f"judged@{b}"] = judged * inside
    for name in plan.compared:
        if name != plan.split:
            out[f"diff:{name}"] = by_preset[name]
    if batch.rewards is not None:
        ratio = mask if batch.old_logp is None else torch.where(
            batch.mask, (batch.logp.detach() - batch.old_logp).to(dtype).exp(), torch.zeros((), dtype=dtype))
        out["task"] = -adv[:, None] * ratio  # the PPO / GRPO task loss -A * pi/mu per token, minimized
    return out


def fold_vectors(batch: TokenBatch, plan: Plan, view: GradientView, scale: float) -> Tensor:
    """[Q, dimension] the quantities' vectors on this batch, each times `scale` (1 / (G x units in the fold))."""
    weights = coefficients(batch, plan)
    out = torch.zeros(len(plan.quantities), view.dimension, dtype=view.dtype, device=view.parameters[0].device)
    live = [(i, weights[q]) for i, q in enumerate(plan.quantities) if bool(weights[q].ne(0).any())]
    for n, (i, c) in enumerate(live):
        surrogate = (scale * c * batch.logp).sum()
        grads = torch.autograd.grad(surrogate, view.parameters, retain_graph=n < len(live) - 1, allow_unused=True)
        out[i] = view.project(grads)
    return out
