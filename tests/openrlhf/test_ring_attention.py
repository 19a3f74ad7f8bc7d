"""Ring attention (``--ds.ring_attn_size > 1``; issue 47): OpenRLHF's loss path with kl-adapters over a ring of two
gloo ranks gives the world-size-1 gradient, on CPU.

Under ring attention (which OpenRLHF runs with --ds.packing_samples) each rank's Actor.forward makes the logits of its
contiguous slice of the packed micro-batch; OpenRLHF gathers the per-token log-probs back to whole rows
(ring_attn_utils.gather_and_pad_tensor) before PolicyLoss and its KL, so the KL term sees whole rows, and the adapter
gathers pi(EOS | y_<t), read from the rank's slice of the logits, with the same call (adapters/openrlhf/eos.py:
`_padded`). Both ranks then compute the same loss on the same rows; the all-gathers' backward sums the ranks'
gradients and DeepSpeed averages over the world, which gives the gradient of one process.

The batch: openrlhf_harness.loss_path_batch (8 ragged rows, off-policy behaviour log-probs, 2 GRPO groups of 4) with
its rollout statistics (`sequence`: the termination control variate reads pi(EOS)). World size 1 (this process):
OpenRLHF's ppo_train on the plain padded forward (eager attention, no packing), micro-batches of 2, 2 per optimizer
step, 2 epochs; unshuffled, as ppo_train is under ring attention (ppo_actor.py: should_shuffle), so both worlds see the
same micro-batches. World size 2 (ring_worker_openrlhf.py): OpenRLHF's args parsed by the launcher with
``--ds.packing_samples --ds.ring_attn_size 2 --algo.kl.preset sequence`` (no longer refused), each rank on all 8 rows,
its model input half of each packed micro-batch, ring-flash-attn's attention a test-only stand-in (ring_attn_cpu.py).
Checks: the stand-in attended from each rank's half over the whole packed row; each rank's rollout forward returns the
whole rows' log-probs and pi(EOS) of the plain forward; each optimizer step's gradient equals world size 1's to
float32 rounding (RTOL), on both ranks.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from openrlhf_harness import (
    GAS,
    MICRO,
    base_argv,
    batch_statistics,
    cli_args,
    loss_path_batch,
    ppo_train_on,
    softmax_eos,
)
from test_data_parallel import RTOL, same_kl_adapters


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_parallel import relative_error, run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
RING = 2


@pytest.fixture(scope="module")
def worlds(actor_dir, ref_dir):
    """(world size 1's optimizer-step gradients, the batch, each ring rank's output)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_cpu_shim import cuda_shims

    args = cli_args(base_argv(actor_dir) + ["--ds.packing_samples", "--ds.ring_attn_size", str(RING),
                                            "--vllm.num_engines", "1", "--algo.kl.preset", "sequence"], wrapper=True)
    assert args.ds.ring_attn_size == RING and args.ds.packing_samples and str(args.algo.kl.preset) == "sequence"
    batch = loss_path_batch(actor_dir, ref_dir)
    statistics = batch_statistics(batch)

    single_args = cli_args(base_argv(actor_dir))  # no packing, no ring: the plain padded forward
    loader = ppo_actor.DataLoader
    with pytest.MonkeyPatch.context() as patch:
        for (owner, name), fn in cuda_shims().items():
            patch.setattr(owner, name, fn)
        patch.setattr(ppo_actor, "DataLoader", lambda *a, **kw: loader(*a, **{**kw, "shuffle": False}))
        trainer, steps, _ = ppo_train_on(single_args, actor_dir, batch, statistics=statistics)
    single = trainer.strategy.grad_log
    assert len(single) == len(steps) // GAS == 4

    folder = Path(tempfile.mkdtemp(prefix="ring_openrlhf_"))
    torch.save({"args": args, "actor_dir": actor_dir, "batch": batch, "statistics": statistics, "micro": MICRO,
                "gas": GAS}, folder / "job.pt")
    run_ranks(HERE / "ring_worker_openrlhf.py", RING, str(folder / "job.pt"), str(folder / "rank{rank}.pt"),
              timeout=180, env=same_kl_adapters())
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(RING)]
    return single, batch, ranks


def test_attention_ran_on_each_ranks_half_over_the_whole_row(worlds):
    """Every attention call on a rank: its queries are half of the (ring-padded) packed row, its keys the whole row;
    the rollout forward's calls cover the batch's tokens (2 layers)."""
    _, batch, ranks = worlds
    tokens = int(batch["attention_mask"].sum())
    for rank in ranks:
        calls = rank["rollout_calls"] + rank["train_calls"]
        assert calls and all(total == RING * local for local, total in calls)
        assert {total for _, total in rank["rollout_calls"]} == {tokens + (-tokens) % RING}


def test_rollout_forward_gathers_whole_rows(worlds, actor_dir):
    """Each ring rank's rollout forward (no gradient) returns the whole rows' log-probs and pi(EOS) of the plain padded
    forward of one process (a separate forward's softmax), and y_t == EOS."""
    from openrlhf_cpu_shim import load_actor

    _, batch, ranks = worlds
    actor = load_actor(actor_dir)
    args = batch["sequences"], batch["attention_mask"], batch["action_mask"]
    with torch.no_grad():
        plain = actor(batch["sequences"], batch["action_mask"], attention_mask=batch["attention_mask"])
    expected = softmax_eos(actor, *args)
    for rank in ranks:
        assert rank["eos"] is not None, "pi(EOS) was read under ring attention"
        torch.testing.assert_close(rank["log_probs"], plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["eos"], expected.prob, rtol=1e-5, atol=1e-7)
        assert torch.equal(rank["is_eos"], expected.is_eos)


def test_ring_attention_gradient_is_world_size_1(worlds):
    """`sequence` (pi(EOS) gathered for the termination control variate): every optimizer step's gradient of the two
    ring ranks (averaged over the world, as DeepSpeed does) is world size 1's, the same on both ranks."""
    single, _, ranks = worlds
    assert [len(rank["grads"]) for rank in ranks] == [len(single)] * RING
    for step, expected in enumerate(single):
        assert torch.equal(ranks[0]["grads"][step], ranks[1]["grads"][step])
        error = relative_error(ranks[0]["grads"][step], expected)
        print(f"openrlhf ring attention step {step}: max|g2 - g1| / max|g1| = {error:.2e}")
        assert error < RTOL
