"""Ulysses sequence parallelism (docs/verl.md, docs/support.md): verl's actor update through its FSDP2 engine with
``ulysses_sequence_parallel_size=2`` on two gloo ranks gives the world-size-1 gradient, for a reduced preset that reads
pi(EOS) and for the unreduced ones (CPU; dp_worker_verl.py on engine_check.py's builders, the test-only platform shim
and ulysses_cpu.py's stand-in for flash-attention's varlen forward, which verl's Ulysses attention calls between its
all-to-alls).

Under Ulysses each rank's forward makes the logits of its shard of the packed micro-batch; verl gathers the log-probs
back (`_gather_and_unpad_packed`: verl's `gather_outputs_and_unpad`) before ppo_loss, and the adapter gathers pi(EOS)
with the same call, so the KL term sees whole sequences. The batch is test_data_parallel.py's (8 ragged rows, GRPO
groups of 4, one SGD step at lr 1: the update is the gradient). World size 1: one process, verl's padded forward, no
sequence parallelism. World size 2: both ranks form one sequence-parallel group (data-parallel size 1), each training
on all 8 rows with remove-padding, its model input half of each packed micro-batch. Checks: the attention ran on whole
micro-batches gathered from the ranks' shards (verl's all-to-all, not a rank's shard alone), the pi(EOS) rows
compute_log_prob's forward keeps equal world size 1's, and the updates agree to float32 rounding (RTOL).
"""

from pathlib import Path

import pytest
import torch
from test_data_parallel import GROUPS, ROWS, RTOL, WORLD, job, rank_updates
from verl_cases import make_tokens

from data_parallel import relative_error

SP = WORLD
#: forwards per case (compute_log_prob's, the update's) and attention calls per forward (tiny_llama's 2 layers)
PASSES, LAYERS = 2, 2
#: micro-batches per forward (8 rows, engine_check's micro-batches of 4): each may get one Ulysses pad token
MICRO_BATCHES = 2
#: `sequence` reads pi(EOS) (termination control variate); `sequence-plain` and `token` read none
PRESETS = ("sequence", "sequence-plain", "token")


def ulysses_job(world: int, folder: Path) -> Path:
    """test_data_parallel's batch, every preset a case with all rows on every rank; Ulysses over `world` ranks."""
    spec = torch.load(job(1, folder), weights_only=False)
    spec["cases"] = {preset: {"preset": preset, "uid": GROUPS, "rows": [list(range(ROWS))] * world}
                     for preset in PRESETS}
    spec["ulysses"] = world
    path = folder / f"ulysses{world}.pt"
    torch.save(spec, path)
    return path


@pytest.fixture(scope="module")
def updates():
    """{world size: [each rank's {case: update, (case, "eos"): kept pi(EOS), "attention_lengths": ...}]}."""
    return rank_updates(ulysses_job, "sp_verl_", timeout=300)


@pytest.mark.parametrize("preset", PRESETS)
def test_ulysses_gradient_is_world_size_1(updates, preset):
    """Each rank's kept pi(EOS) (`sequence` only: the others read none) is world size 1's, and the update of the two
    sequence-parallel ranks is world size 1's, to float32 rounding."""
    (single,), ranks = updates[1], updates[SP]
    for rank in ranks:  # every rank gathered the whole sequences' pi(EOS), as world size 1 computes it
        assert ((preset, "eos") in rank) == (preset == "sequence")
        if preset == "sequence":
            torch.testing.assert_close(rank[preset, "eos"], single[preset, "eos"], rtol=0, atol=1e-6)
    assert torch.equal(ranks[0][preset], ranks[1][preset])  # FSDP2: every rank applied the same update
    error = relative_error(ranks[0][preset], single[preset])
    print(f"verl Ulysses {preset}: max|u2 - u1| / max|u1| = {error:.2e}")
    assert error < RTOL


def test_attention_saw_whole_micro_batches(updates):
    """The stand-in runs behind verl's all-to-all only: on each rank its calls cover every token of each forward
    (the batch's T, plus at most one Ulysses pad per micro-batch), although each rank's model input was half."""
    tokens = int(make_tokens(seed=0)["attention_mask"].sum())
    for rank in updates[SP]:
        lengths = rank["attention_lengths"]
        assert lengths and all(n % SP == 0 for n in lengths)
        assert tokens <= sum(lengths) / (len(PRESETS) * PASSES * LAYERS) <= tokens + MICRO_BATCHES
