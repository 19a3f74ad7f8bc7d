"""OpenRLHF adapter, the rollout-wide batch statistics of the variance-reduced presets and their inputs; on the loss
path fitted once OpenRLHF has made the advantages (`_wrap_compute_advantages`).

The reduced presets ("sequence", "reward") take leave-one-out statistics (`kl_statistics`: `KLStatistics`) from other
samples, fitted to the gradient the trainer takes (task + KL). OpenRLHF's loss sees micro-batches of
``--train.micro_batch_size`` sequences per GPU (default 1 in 0.10.4-0.11.2), so the statistics are computed once per
rollout, where RemoteExperienceMaker holds every sample of it: from the rollout-time policy log-probs it already
computed (``action_log_probs``, no extra forward pass) and the reference log-probs, leave-one-out within each GRPO
group (``--rollout.n_samples_per_prompt`` > 1; group id = rollout position // n_samples_per_prompt, OpenRLHF's own
grouping in compute_advantages_and_returns, which is also the group its advantages are shifted / normalised over) or
over the whole rollout (n_samples_per_prompt = 1), with
  * the task term (`TaskAdvantages`): the rows' advantages as the policy loss weighs them, in units of the KL term's
    coefficient (`_loss_task` on the loss path, `reward._reward_task` on the reward path);
  * the end-of-sequence probabilities (`EndOfSequence`): pi(EOS | y_<t) read from the logits of the policy's own
    rollout-time forward (`end_of_sequence.eos_probabilities`) and carried to make_experience on its result
    (`eos_payload.LogProbsWithEos`).
Row b's statistics are functions of the other samples only, so every gradient stays exactly unbiased however the rows
are later split.
Positions: every [B, T] tensor goes to the core `positions.aligned`.

Carrying them: per-sample tensors in ``Experience.info`` are split, shuffled and re-batched with their rows by
OpenRLHF's own replay buffer (split_experience_batch / make_experience_batch, which turn them into per-row lists), so
each statistic rides in ``info`` under `KEYS` and `take` reads a micro-batch's rows back (and removes them, so that
OpenRLHF's metric logging never sees them). Pinned by tests/openrlhf/test_statistics.py and test_eos.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...reductions import KLStatistics, TaskAdvantages
from ...surrogate import kl_statistics
from .eos import _take_eos
from .eos_payload import EosPayload
from .flags import _settings
from .positions import _horizon, _pad, aligned


#: Experience.info keys of one row's statistics (every KLStatistics field); not metrics, removed before OpenRLHF logs
KEYS = {f.name: f"kl_adapters.{f.name}" for f in fields(KLStatistics)}


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


def _wrap_compute_advantages(original: Callable) -> Callable:
    """Wrap ``compute_advantages_and_returns`` (PPOTrainer's RemoteExperienceMaker) so that, once OpenRLHF has made the
    advantages, the loss path's statistics are fitted on the whole rollout with them (`_loss_task`) and with the
    rollout forward's pi(EOS | y_<t) (`_wrap_actor_forward`), and stored in each row's info
    (`_attach_loss_statistics`), from which `_wrap_training_step` hands them to the loss. Pinned by
    tests/openrlhf/test_reward_path.py::test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages."""

    @functools.wraps(original)
    def compute_advantages_and_returns(self, experiences):
        experiences = original(self, experiences)
        eos = _take_eos(experiences)  # (also with the flag off: OpenRLHF's experiences hold plain tensors only)
        settings = _settings(self.args)
        if settings is not None and self.args.algo.kl.use_loss and settings.spec.uses_batch_statistics:
            _attach_loss_statistics(self, experiences, eos)
        return experiences

    return compute_advantages_and_returns


def _attach_loss_statistics(maker: Any, experiences: list, eos: list[EosPayload] | None) -> None:
    """Store in each row's info its leave-one-out statistics of the whole rollout, fitted with the advantages OpenRLHF
    has just computed (`_loss_task`) and the rollout forward's end-of-sequence probabilities."""
    args = maker.args
    stats = rollout_statistics(
        experiences, [e.action_log_probs for e in experiences], [e.base_action_log_probs for e in experiences],
        args.rollout.n_samples_per_prompt, task=_loss_task(maker, experiences), eos=eos, horizon=_horizon(args))
    for e, rows in zip(experiences, stats):
        attach(e, rows)


def _loss_task(maker: Any, experiences: list) -> RolloutTask:
    """The task term of the loss path: OpenRLHF's final advantages A, on the scale of the adapter's KL term, which
    shares the policy loss's normaliser (`loss._loss_term`).

    Under PolicyLoss's token mean the step's descent weight per token is (kl_ctl c - A) / N_tok: A against
    beta = kl_ctl. Under seq-mean-token-mean (0.11.2) or gspo it is (kl_ctl c / H - A / L_b) / N_seq, H the horizon
    (`positions._horizon`): A / L_b against beta = kl_ctl / H. normalized: `_normalized`. Pinned by
    tests/openrlhf/test_task.py::test_loss_task_scale.
    """
    args, kl_ctl = maker.args, float(maker.kl_ctl.value)
    normalized = _normalized(args)
    if _token_level(args):
        return RolloutTask([e.advantages for e in experiences], kl_ctl, normalized)
    advantages = [e.advantages / e.action_mask.sum(-1, keepdim=True).clamp(min=1) for e in experiences]
    return RolloutTask(advantages, kl_ctl / _horizon(args), normalized)


def _normalized(args: Any) -> bool:
    """Whether OpenRLHF (compute_advantages_and_returns, 0.10.4-0.11.2) divided the advantages by a standard deviation
    over rows that include the row: group_norm's group std, and the whitening of gae / reinforce / reinforce_baseline
    unless --algo.advantage.no_std_norm."""
    adv = args.algo.advantage
    return adv.estimator == "group_norm" or (adv.estimator in ("gae", "reinforce", "reinforce_baseline")
                                              and not adv.no_std_norm)


def _token_level(args: Any) -> bool:
    """PolicyLoss's aggregation is the token mean (--actor.loss_agg_mode token-mean, 0.11.2's default and the only
    mode before it, and not gspo, which forces the sequence mean)."""
    return getattr(args.actor, "loss_agg_mode", "token-mean") == "token-mean" and args.actor.policy_loss_type != "gspo"
