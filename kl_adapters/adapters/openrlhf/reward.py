"""OpenRLHF adapter, the reward path (default, in PPOTrainer / TrainingActor; presets "reward" and "reward-plain"): k1
in the reward, and the reduced preset's KL reward-to-go once the whole rollout is known. Pinned by
tests/openrlhf/test_reward_path.py::test_reward_path_gradient_is_reward_preset."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ...activation import Settings
from ...surrogate import kl_coefficients, kl_reward, sequence_kl
from .._guard import UnsupportedFrameworkError
from ..metrics import SEQ_KL
from ..versions import supported_range
from .eos import _take_eos
from .eos_payload import EosPayload, split_eos
from .flags import _apply, _settings
from .positions import _horizon, aligned
from .state import ROLLOUT, Rollout
from .statistics import RolloutTask, reward_increments, rollout_statistics


def _wrap_make_experience(original: Callable) -> Callable:
    """Reward path (default), in the PPOTrainer / TrainingActor (presets "reward" and "reward-plain").

    ``RemoteExperienceMaker.make_experience`` is wrapped to hand each sample batch's action mask to
    experience_maker.py's binding of ``compute_approx_kl`` (`_wrap_reward_kl`), which returns k1_t = log pi_old/pi_ref
    from ``kl_reward`` (unclamped; OpenRLHF clamps every estimator to [-10, 10]). OpenRLHF's compute_reward makes it the
    per-token reward -kl_coef * k1_t and its returns (gamma = 1) the KL reward-to-go: preset "reward-plain". Preset
    "reward" then replaces each experience's per-token KL by increments d_t whose reward-to-go is the reduced
    coefficient c_t with the rollout-wide statistics, fitted with the scores (`_reward_task`) and the rollout forward's
    pi(EOS | y_<t) (`_reduce_reward_kl`). Either way the PPO gradient at the rollout policy is beta * (B / N_tok) *
    grad kl_surrogate(preset, statistics=the rows', eos=the rollout policy's), N_tok being OpenRLHF's token-mean
    divisor. Pinned by tests/openrlhf/test_reward_path.py::test_reward_path_gradient_is_reward_preset."""

    @functools.wraps(original)
    def make_experience(self, samples_list):
        settings = _settings(self.args)
        if settings is None:
            return original(self, samples_list)
        _apply(self.args, settings)
        if self.args.algo.kl.use_loss:  # loss path: statistics once the advantages exist (`_wrap_compute_advantages`)
            return original(self, samples_list)
        with ROLLOUT.bound(Rollout(iter(samples_list), [])) as rollout:
            experiences = original(self, samples_list)
        if next(rollout.pending, None) is not None or len(rollout.log_probs) != len(experiences):
            raise UnsupportedFrameworkError("OpenRLHF's make_experience computed fewer KLs than it has sample batches; "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        eos = _take_eos(experiences)
        if settings.spec.uses_batch_statistics:
            _reduce_reward_kl(self, experiences, rollout.log_probs, settings, eos)
        return experiences

    return make_experience


def _reduce_reward_kl(maker: Any, experiences: list, log_probs: list[tuple[Tensor, Tensor]], settings: Settings,
                      eos: list[EosPayload] | None) -> None:
    """Replace each experience's per-token KL (k1, from `_wrap_reward_kl`) by rewards whose reward-to-go is the reduced
    preset's coefficient c_t (rollout-wide statistics, fitted with `_reward_task` against beta = kl_coef, the
    coefficient compute_reward applies, and the rollout forward's end-of-sequence probabilities): compute_reward
    makes them -kl_coef * d_t and the returns (gamma = 1) -kl_coef * c_t, so the PPO gradient at the rollout policy is
    the reduced preset's. The score's baseline (group_norm, rloo, ...) acts on the scalar score only, before the KL is
    added (experience_maker.py)."""
    args, horizon = maker.args, _horizon(maker.args)
    task = RolloutTask(_reward_task(experiences, args), float(maker.kl_ctl.value),
                       args.algo.advantage.estimator == "group_norm")
    all_stats = rollout_statistics(experiences, *zip(*log_probs), args.rollout.n_samples_per_prompt, task=task, eos=eos,
                                   horizon=horizon)
    for i, (e, (logp, ref_logp), stats) in enumerate(zip(experiences, log_probs, all_stats)):
        view = aligned(e.action_mask, None if eos is None else horizon)
        end = None if eos is None else view.end_of_sequence(eos[i], horizon)
        c = kl_coefficients(view(logp), view(ref_logp), view(e.action_mask), preset=settings.spec,
                            statistics=stats.with_width(view.width), eos=end)
        e.kl = reward_increments(view.back(c), e.action_mask).to(e.kl.dtype)


def _reward_task(experiences: list, args: Any) -> list[Tensor]:
    """The task part of the advantage OpenRLHF's reward path trains on, per sample batch, from what make_experience
    holds when the KL rewards are made (compute_advantages_and_returns has not run yet): the score r (``rewards``;
    the length penalties OpenRLHF applies later are left out). Its per-prompt shift (rloo, reinforce_baseline,
    dr_grpo, group_norm's mean) and group_norm's std are the core's to remove (shift-invariant, normalized); rloo's
    leave-one-out baseline also scales it by n / (n - 1); gae's advantage at gamma = lambd = 1 is r - V_t (the critic's
    rollout values). The whitening of gae / reinforce / reinforce_baseline divides task and KL alike: beta stays
    kl_coef. Any choice keeps the gradient exact (statistics read other rows only); this one fits the trained one."""
    estimator, n = args.algo.advantage.estimator, args.rollout.n_samples_per_prompt
    out = []
    for e in experiences:
        r = e.rewards.float() * (n / (n - 1) if estimator == "rloo" and n > 1 else 1.0)
        if estimator == "gae" and e.values is not None:
            r = (r[:, None] - e.values.float()) * e.action_mask
        out.append(r)
    return out


def _wrap_reward_kl(original: Callable) -> Callable:
    @functools.wraps(original)
    def compute_approx_kl(log_probs, log_probs_base, *args, **kwargs):  # the rest differs by release (_wrap_loss_kl)
        rollout = ROLLOUT.get()
        if rollout is None:
            return original(log_probs, log_probs_base, *args, **kwargs)
        sample = next(rollout.pending, None)
        if sample is None or sample.action_mask.shape != log_probs.shape:
            raise UnsupportedFrameworkError("OpenRLHF's make_experience computed its KLs in an unexpected order; "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        rollout.log_probs.append((split_eos(log_probs)[0], split_eos(log_probs_base)[0]))
        sample.info[SEQ_KL] = sequence_kl(log_probs, log_probs_base, sample.action_mask)
        # k1_t (zero at padding, no clamp): compute_reward turns it into the reward -kl_coef * k1_t ("reward-plain");
        # the reduced "reward" replaces it once the whole rollout is known (`_reduce_reward_kl`)
        return (-kl_reward(log_probs, log_probs_base, sample.action_mask, beta=1.0)).float()

    return compute_approx_kl
