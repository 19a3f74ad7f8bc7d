"""The rollout-wide statistics' plumbing (kl_adapters/adapters/openrlhf/statistics.py): reward increments, and the
statistics riding through OpenRLHF's own replay buffer (split, shuffled, re-batched) with their rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kl_adapters.adapters.openrlhf.statistics import KEYS, attach, reward_increments, take
from openrlhf_harness import RESPONSES, batch_statistics, experience_fields, rows_of


def test_reward_increments_sum_to_the_coefficients():
    """OpenRLHF's returns (gamma 1, rewards masked by action_mask) of the increments are c at every real token, with
    ragged lengths and holes in the mask; zero at padding."""
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    d = reward_increments(c, mask)
    returns = (d * mask).flip(1).cumsum(1).flip(1)  # get_cumulative_returns with gamma = 1
    torch.testing.assert_close(returns[mask], c[mask], rtol=0, atol=1e-12)
    assert torch.equal(d[~mask], torch.zeros_like(d[~mask]))


@pytest.mark.compat
def test_statistics_survive_the_replay_buffer(actor_dir, ref_dir, cpu_cuda):
    """Attached to a rollout Experience, each row's statistics come back with that row from OpenRLHF's replay buffer
    (split, padding removed, shuffled DataLoader, re-batched in micro-batches of 3) and from balance_experiences."""
    from openrlhf.trainer.ppo_utils.experience import Experience, balance_experiences
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf_harness import loss_path_batch

    batch = loss_path_batch(actor_dir, ref_dir)
    stats = batch_statistics(batch)
    experience = Experience(**experience_fields(batch), total_length=batch["attention_mask"].sum(-1),
                            index=list(range(len(RESPONSES))), info={})
    attach(experience, stats)
    buffer = NaiveReplayBuffer(3, limit=0, cpu_offload=True)
    args = SimpleNamespace(actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=2),
                           ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1))
    for part in balance_experiences([experience], args):  # two dp shards, interleaved by length
        buffer.append(part)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(buffer, batch_size=3, shuffle=True, collate_fn=buffer.collate_fn)
    seen = []
    for micro in loader:
        rows, width = rows_of(batch, micro), micro.action_mask.shape[1]
        got = take(micro)
        assert not any(key in micro.info for key in KEYS)
        for name in ("cv_coef", "eos_coef", "past_coef"):
            torch.testing.assert_close(getattr(got, name), getattr(stats, name)[rows], rtol=0, atol=0)
        torch.testing.assert_close(got.baseline * micro.action_mask, stats.baseline[rows, :width] * micro.action_mask,
                                   rtol=0, atol=0)
        seen += rows
    assert sorted(seen) == list(range(len(RESPONSES)))


def test_a_rows_statistics_ignore_its_own_tokens(actor_dir, ref_dir):
    """rollout_statistics is leave-one-out: changing row 0's log-probs, advantages and EOS probabilities leaves row 0's
    statistics unchanged (and changes those of its group mates)."""
    from openrlhf_harness import loss_path_batch

    batch = loss_path_batch(actor_dir, ref_dir)
    first = (torch.arange(len(RESPONSES)) == 0)[:, None] * batch["action_mask"]
    eos = batch["rollout_eos"]
    changed = batch_statistics(dict(batch, action_log_probs=batch["action_log_probs"] + 0.3 * first,
                                    advantages=batch["advantages"] + first,
                                    rollout_eos=type(eos)(eos.prob * (1 - 0.5 * first), eos.is_eos)))
    stats = batch_statistics(batch)
    torch.testing.assert_close(changed.cv_coef[0], stats.cv_coef[0])  # up to the rounding of (group sum - own)
    torch.testing.assert_close(changed.baseline[0], stats.baseline[0])
    torch.testing.assert_close(changed.eos_coef[0], stats.eos_coef[0])
    torch.testing.assert_close(changed.past_coef[0], stats.past_coef[0])
    assert not torch.equal(changed.cv_coef[1], stats.cv_coef[1])  # row 0 is in row 1's group (rows 0-3)
