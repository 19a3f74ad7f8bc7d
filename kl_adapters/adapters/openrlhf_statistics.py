"""Rollout-wide batch statistics of the variance-reduced presets inside OpenRLHF (used by adapters/openrlhf.py).

The reduced presets ("sequence", "reward") take leave-one-out statistics (`kl_statistics`: `KLStatistics`)
from other samples. OpenRLHF's loss sees micro-batches of ``--train.micro_batch_size`` sequences per GPU (default 1 in
0.10.4-0.11.2), so the statistics are computed once per rollout, where RemoteExperienceMaker.make_experience holds
every sample of it: from the rollout-time policy log-probs it already computed (``action_log_probs``, no extra forward
pass) and the reference log-probs, leave-one-out within each GRPO group (``--rollout.n_samples_per_prompt`` > 1; group id =
rollout position // n_samples_per_prompt, OpenRLHF's own grouping in compute_advantages_and_returns) or over the whole
rollout (n_samples_per_prompt = 1). Row b's statistics are functions of the other samples only, so every gradient
stays exactly unbiased however the rows are later split.

Carrying them: per-sample tensors in ``Experience.info`` are split, shuffled and re-batched with their rows by
OpenRLHF's own replay buffer (split_experience_batch / make_experience_batch, which turn them into per-row lists), so
each statistic rides in ``info`` under `KEYS` and `take` reads a micro-batch's rows back (and removes them, so that
OpenRLHF's metric logging never sees them). Pinned by tests/openrlhf/test_statistics.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reductions import KLStatistics
from ..surrogate import kl_statistics

#: Experience.info keys of one row's statistics (every KLStatistics field); not metrics, removed before OpenRLHF logs
KEYS = {f.name: f"kl_adapters.{f.name}" for f in fields(KLStatistics)}


def _pad(x: Tensor, width: int) -> Tensor:
    """[B, T] -> [B, width]: zero columns appended, or columns past `width` dropped."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x[..., :width]


def rollout_statistics(experiences: Sequence[Any], logp: Sequence[Tensor], ref_logp: Sequence[Tensor],
                       n_samples_per_prompt: int) -> list[KLStatistics]:
    """`kl_statistics` of all the rollout's rows at once, returned per sample batch (rows and width of each).

    experiences[i] is a sample batch of make_experience (its ``action_mask`` and ``index``, the rows' rollout
    positions); logp[i] / ref_logp[i] its rollout-time policy and reference log-probs. On-policy statistics (no
    old_logp): at rollout time the policy is the behaviour policy.
    """
    width = max(e.action_mask.shape[1] for e in experiences)
    cat = [torch.cat([_pad(x, width) for x in xs]) for xs in (logp, ref_logp, [e.action_mask for e in experiences])]
    group = None
    if n_samples_per_prompt > 1:
        positions = [i for e in experiences for i in e.index]
        group = torch.tensor(positions, device=cat[0].device) // n_samples_per_prompt
    stats = kl_statistics(*cat, group=group)
    out, start = [], 0
    for e in experiences:
        rows, width = e.action_mask.shape
        out.append(stats[start:start + rows].with_width(width))
        start += rows
    return out


def attach(experience: Any, statistics: KLStatistics) -> None:
    """Store a sample batch's statistics in its info, one entry per row (see the module docstring)."""
    for name, value in statistics.as_dict().items():
        experience.info[KEYS[name]] = value


def take(experience: Any) -> KLStatistics | None:
    """Remove the micro-batch's rows' statistics from its info and return them at its width (None if absent).

    Entries are [B] / [B, T] tensors, or per-row lists after OpenRLHF's re-batching (baseline rows keep the width of
    their rollout sample batch: zero-padded or cut to this micro-batch's width; past a row's own tokens the baseline
    is never read, kl_term masks it)."""
    if KEYS["baseline"] not in experience.info:
        return None
    values = {name: experience.info.pop(key) for name, key in KEYS.items()}
    width = experience.action_mask.shape[1]
    values = {name: torch.stack([_pad(row, width) if row.dim() else row for row in v]) if isinstance(v, list) else v
              for name, v in values.items()}
    return KLStatistics(**values).with_width(width)


def reward_increments(coefficients: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards d whose reward-to-go over the real tokens is the given per-token coefficient c.

    d_t = c_t - c_{n(t)}, n(t) the next real token after t (c = 0 past the last): OpenRLHF's returns (gamma = 1, rewards
    masked by action_mask) then give sum_{s >= t real} d_s = c_t at every real token t, holes in the mask included.
    Zero at padding. Pinned by tests/openrlhf/test_statistics.py::test_reward_increments_sum_to_the_coefficients.
    """
    real = mask.bool()
    width = coefficients.shape[1]
    pos = torch.arange(width, device=coefficients.device).expand_as(coefficients)
    first_real_from = torch.cummin(torch.where(real, pos, width).flip(1), 1).values.flip(1)  # first real at >= t
    after = torch.cat([first_real_from[:, 1:], torch.full_like(first_real_from[:, :1], width)], 1)  # at > t
    c = torch.where(real, coefficients, 0.0)
    return (c - F.pad(c, (0, 1)).gather(1, after)) * real
