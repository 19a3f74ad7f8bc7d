"""Rollout-wide batch statistics of the variance-reduced presets inside OpenRLHF, and their inputs (used by
adapters/openrlhf.py).

The reduced presets ("sequence", "reward") take leave-one-out statistics (`kl_statistics`: `KLStatistics`) from other
samples, fitted to the gradient the trainer takes (task + KL). OpenRLHF's loss sees micro-batches of
``--train.micro_batch_size`` sequences per GPU (default 1 in 0.10.4-0.11.2), so the statistics are computed once per
rollout, where RemoteExperienceMaker holds every sample of it: from the rollout-time policy log-probs it already
computed (``action_log_probs``, no extra forward pass) and the reference log-probs, leave-one-out within each GRPO
group (``--rollout.n_samples_per_prompt`` > 1; group id = rollout position // n_samples_per_prompt, OpenRLHF's own
grouping in compute_advantages_and_returns, which is also the group its advantages are shifted / normalised over) or
over the whole rollout (n_samples_per_prompt = 1), with
  * the task term (`TaskAdvantages`): the rows' advantages as the policy loss weighs them, in units of the KL term's
    coefficient (adapters/openrlhf.py says which, path by path);
  * the end-of-sequence probabilities (`EndOfSequence`): pi(EOS | y_<t) read from the logits of the policy's own
    rollout-time forward (`end_of_sequence.eos_probabilities`) and carried to make_experience on its result (`LogProbsWithEos`).
Row b's statistics are functions of the other samples only, so every gradient stays exactly unbiased however the rows
are later split.

Positions. OpenRLHF right-pads ``[prompt, response]``, so a row's response starts at its prompt's length; the
statistics' baseline is per response position and the termination control variate counts the positions left to the
horizon from the response's start. The adapter therefore hands the core every [B, T] tensor `aligned` (each row shifted
left to its first action token): a permutation of each row's tokens, which changes no preset's value or gradient.

Carrying them: per-sample tensors in ``Experience.info`` are split, shuffled and re-batched with their rows by
OpenRLHF's own replay buffer (split_experience_batch / make_experience_batch, which turn them into per-row lists), so
each statistic rides in ``info`` under `KEYS` and `take` reads a micro-batch's rows back (and removes them, so that
OpenRLHF's metric logging never sees them). Pinned by tests/openrlhf/test_statistics.py and test_eos.py.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reductions import EndOfSequence, KLStatistics, TaskAdvantages
from ..surrogate import kl_statistics
from .end_of_sequence import eos_token_ids as read_eos_token_ids

#: Experience.info keys of one row's statistics (every KLStatistics field); not metrics, removed before OpenRLHF logs
KEYS = {f.name: f"kl_adapters.{f.name}" for f in fields(KLStatistics)}


def _pad(x: Tensor, width: int) -> Tensor:
    """[B, T] -> [B, width]: zero columns appended, or columns past `width` dropped."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x[..., :width]


# ---- positions -------------------------------------------------------------------------------------------------------


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


# ---- end-of-sequence probabilities -----------------------------------------------------------------------------------


def eos_token_ids(model: Any) -> tuple[int, ...]:
    """The end-of-sequence ids of an OpenRLHF Actor's model (DeepSpeed's engine / PEFT unwrapped by attribute access):
    its generation config's ``eos_token_id`` (int or list; what vLLM, which OpenRLHF samples with, stops at beside the
    tokenizer's eos) and its config's (`end_of_sequence.eos_token_ids`)."""
    inner = getattr(model, "module", model)
    return read_eos_token_ids(getattr(inner, "generation_config", None), getattr(inner, "config", None))


@dataclass(frozen=True)
class EosPayload:
    """pi(EOS | y_<t) and whether y_t is an end-of-sequence token, [B, T] each in the action layout (zero / False at
    padding), of one forward of the policy (what `end_of_sequence` turns into the core's `EndOfSequence`)."""

    prob: Tensor
    is_eos: Tensor

    def to(self, device) -> EosPayload:
        return EosPayload(self.prob.to(device), self.is_eos.to(device))


def action_eos(prob: Tensor, sequences: Tensor, action_mask: Tensor, eos_ids: Tensor) -> EosPayload:
    """The payload of an Actor.forward: prob [B, S] from `end_of_sequence.eos_probabilities` over its logits, cut as Actor.forward cuts
    its log-probs (``[:, :-1]`` then the last T = action_mask width columns), and y_t = sequences[:, -T:] in eos_ids."""
    width = action_mask.shape[1]
    real = action_mask.bool()
    tokens = sequences[:, -width:]
    return EosPayload(torch.where(real, prob[:, :-1][:, -width:], 0.0),
                      torch.isin(tokens, eos_ids.to(tokens.device)) & real)


class LogProbsWithEos(Tensor):
    """Action log-probs that carry the `EosPayload` of the forward that computed them (attribute ``eos``).

    What the policy's rollout-time forward returns under a reduced preset (adapters/openrlhf.py: Actor.forward inside
    PolicyModelActor.forward), so that its end-of-sequence probabilities reach make_experience with the log-probs:
    through PolicyModelActor.forward's ``.to("cpu")`` (kept, moved along) and Ray's pickling (a tensor subclass is
    pickled with its attributes; Ray's zero-copy reducer takes plain tensors only). Every other operation returns a
    plain tensor, so OpenRLHF computes with it as with its own result; `split_eos` takes the payload off. Pinned by
    tests/openrlhf/test_eos.py::test_payload_survives_to_and_pickling and test_ray.py."""

    eos: EosPayload

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is Tensor.to and isinstance(out, Tensor):
            return with_eos(out, args[0].eos.to(out.device))
        return out

    def __deepcopy__(self, memo):
        return with_eos(copy.deepcopy(self.as_subclass(Tensor), memo), copy.deepcopy(self.eos, memo))


def with_eos(log_probs: Tensor, eos: EosPayload) -> LogProbsWithEos:
    """`log_probs` (same data) carrying `eos`."""
    out = log_probs.as_subclass(LogProbsWithEos)
    out.eos = eos
    return out


def split_eos(log_probs: Tensor | None) -> tuple[Tensor | None, EosPayload | None]:
    """(the plain tensor, its EosPayload) of a `LogProbsWithEos`; (log_probs, None) for anything else."""
    if isinstance(log_probs, LogProbsWithEos):
        return log_probs.as_subclass(Tensor), log_probs.eos
    return log_probs, None


# ---- statistics ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutTask:
    """The task term of a rollout: advantages per sample batch ([B] or [B, T] in the action layout), the KL coefficient
    on their scale and whether they are std-normalised over rows that include the row (`TaskAdvantages`)."""

    advantages: Sequence[Tensor]
    beta: float
    normalized: bool


def rollout_statistics(experiences: Sequence[Any], logp: Sequence[Tensor], ref_logp: Sequence[Tensor],
                       n_samples_per_prompt: int, *, task: RolloutTask | None = None,
                       eos: Sequence[EosPayload] | None = None,
                       horizon: int | None = None) -> list[KLStatistics]:
    """`kl_statistics` of all the rollout's rows at once (`aligned`), returned per sample batch (its rows, at its
    width), fitted with `task` and `eos` (one payload per sample batch; horizon: the maximum response length).

    experiences[i] is a sample batch of make_experience (its ``action_mask`` and ``index``, the rows' rollout
    positions); logp[i] / ref_logp[i] its rollout-time policy and reference log-probs. On-policy statistics (no
    old_logp): at rollout time the policy is the behaviour policy.
    """
    width = max(e.action_mask.shape[1] for e in experiences)
    mask = torch.cat([_pad(e.action_mask, width) for e in experiences])
    view = aligned(mask, None if eos is None else horizon or width)
    cat = [view(torch.cat([_pad(x, width) for x in xs])) for xs in (logp, ref_logp)]
    group = None
    if n_samples_per_prompt > 1:
        positions = [i for e in experiences for i in e.index]
        group = torch.tensor(positions, device=mask.device) // n_samples_per_prompt
    advantages = None
    if task is not None:
        adv = [a.float() if a.dim() == 1 else _pad(a.float(), width) for a in task.advantages]
        adv = torch.cat(adv)
        advantages = TaskAdvantages(adv if adv.dim() == 1 else view(adv), task.beta, task.normalized)
    end = None
    if eos is not None:
        payload = EosPayload(*(torch.cat([_pad(getattr(p, f), width) for p in eos]) for f in ("prob", "is_eos")))
        end = view.end_of_sequence(payload, horizon or width)
    stats = kl_statistics(*cat, view(mask), group=group, task=advantages, eos=end)
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
