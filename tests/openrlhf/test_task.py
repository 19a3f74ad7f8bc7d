"""The task term the adapter fits the reduced presets' statistics with (adapters/openrlhf/: statistics.py `_normalized`,
`_loss_task`, reward.py `_reward_task`), checked against OpenRLHF's own compute_advantages_and_returns, estimator by
estimator."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from kl_adapters.adapters.openrlhf import reward as openrlhf_reward
from kl_adapters.adapters.openrlhf import statistics as openrlhf_statistics
from openrlhf_harness import BETA, GROUP, HAS_LOSS_AGG_MODE, base_argv, cli_args

ESTIMATORS = ["group_norm", "rloo", "dr_grpo", "reinforce_baseline", "reinforce", "gae"]
WIDTH = 7


@pytest.fixture(scope="module")
def args(actor_dir):
    return cli_args(base_argv(actor_dir))  # group_norm, 2 prompts x 4 samples, the loss path


def experiences(seed: int = 0, scale: float = 1.0) -> list:
    """Two sample batches of 4 rows (rollout positions 0..7) as make_experience leaves them on the loss path: ragged
    action masks, scores, a zero KL, critic values (scores and values multiplied by `scale`)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen = torch.Generator().manual_seed(seed)
    out = []
    for part in range(2):
        lengths = torch.randint(2, WIDTH + 1, (4,), generator=gen)
        mask = torch.arange(WIDTH)[None] < lengths[:, None]
        out.append(Experience(action_mask=mask, rewards=scale * torch.rand(4, generator=gen),
                              kl=torch.zeros(4, WIDTH), values=0.1 * scale * torch.randn(4, WIDTH, generator=gen) * mask,
                              index=list(range(4 * part, 4 * part + 4)), info={}))
    return out


def openrlhf_advantages(args, estimator: str, no_std_norm: bool, scale: float = 1.0) -> torch.Tensor:
    """[8, WIDTH] OpenRLHF's advantages of `experiences` (its own compute_advantages_and_returns, lambd = gamma = 1)."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    args = copy.deepcopy(args)
    args.algo.advantage.estimator, args.algo.advantage.no_std_norm = estimator, no_std_norm
    maker = RemoteExperienceMaker(None, None, None, None, FixedKLController(BETA), SimpleNamespace(args=args), None)
    return torch.cat([e.advantages for e in maker.compute_advantages_and_returns(experiences(scale=scale))])


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("no_std_norm", [False, True])
def test_normalized_is_openrlhfs_scale_invariance(args, estimator, no_std_norm):
    """TaskAdvantages.normalized (the advantages were divided by a std over rows including the row) holds exactly when
    OpenRLHF's advantages do not change as every score (and critic value) is doubled."""
    mine = copy.deepcopy(args)
    mine.algo.advantage.estimator, mine.algo.advantage.no_std_norm = estimator, no_std_norm
    invariant = torch.allclose(openrlhf_advantages(args, estimator, no_std_norm, 2.0),
                               openrlhf_advantages(args, estimator, no_std_norm), rtol=1e-5, atol=1e-6)
    assert openrlhf_statistics._normalized(mine) == invariant


def standardized(x: torch.Tensor, mask: torch.Tensor, normalized: bool) -> torch.Tensor:
    """x at the real tokens of each GRPO group, its mean over them removed (and divided by its std if normalized):
    what the core keeps of the other rows' advantages (reductions.TaskAdvantages)."""
    out = []
    for g in range(len(x) // GROUP):
        rows = slice(GROUP * g, GROUP * (g + 1))
        values = x[rows][mask[rows]]
        values = values - values.mean()
        out.append(values / values.std(unbiased=False) if normalized else values)
    return torch.cat(out)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_reward_task_is_the_score_part_of_openrlhfs_advantages(args, estimator):
    """Reward path: the task `_reward_task` fits with (from what make_experience holds) is, up to the shift (and
    group_norm's scale) the core removes per group, OpenRLHF's advantage with a zero KL (gae: lambd = gamma = 1),
    before the whitening that scales task and KL alike (no_std_norm)."""
    mine = copy.deepcopy(args)
    mine.algo.advantage.estimator = estimator
    exps = experiences()
    mask = torch.cat([e.action_mask for e in exps])
    task = torch.cat([t if t.dim() == 2 else t[:, None].expand(-1, WIDTH) for t in openrlhf_reward._reward_task(exps, mine)])
    normalized = estimator == "group_norm"
    expected = openrlhf_advantages(args, estimator, no_std_norm=True)
    torch.testing.assert_close(standardized(task, mask, normalized), standardized(expected, mask, normalized),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.skipif(
    not HAS_LOSS_AGG_MODE, reason="--actor.loss_agg_mode arrived in OpenRLHF 0.11.2"))])
def test_loss_task_scale(args, agg):
    """Loss path: the KL shares the policy loss's normaliser, so token-mean weighs (kl_ctl c - A) / N_tok: A against
    beta = kl_ctl, from the first rollout on; seq-mean-token-mean weighs (kl_ctl c / H - A / L_b) / N_seq: A / L_b
    against kl_ctl / H, H the horizon (--rollout.max_new_tokens)."""
    mine = copy.deepcopy(args)
    mine.actor.loss_agg_mode = agg
    maker = SimpleNamespace(args=mine, kl_ctl=SimpleNamespace(value=BETA))
    for exps in (experiences(0), experiences(1)):
        for e in exps:
            e.advantages = torch.randn(e.action_mask.shape) * e.action_mask
        task = openrlhf_statistics._loss_task(maker, exps)
        assert task.normalized
        if agg == "token-mean":
            assert task.beta == BETA
            assert all(a is e.advantages for a, e in zip(task.advantages, exps))
        else:
            assert task.beta == pytest.approx(BETA / mine.rollout.max_new_tokens)
            for a, e in zip(task.advantages, exps):
                torch.testing.assert_close(a, e.advantages / e.action_mask.sum(-1, keepdim=True))