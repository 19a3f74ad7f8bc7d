"""Data parallelism (issue 37, part 4; docs/data-parallel.md): OpenRLHF's loss path (--algo.kl.use_loss) with
kl-adapters at data-parallel world size 2 gives the parameter gradient of world size 1 on the same global batch.

The batch: openrlhf_harness.loss_path_batch (8 ragged sequences, off-policy behaviour log-probs, 2 GRPO groups of 4)
with its rollout-wide statistics attached (openrlhf_harness.batch_statistics, as the experience maker computes them
once per rollout). World size 1 (this process): ppo_train on all 8 rows, micro-batches of 2, 4 per optimizer step.
World size 2 (dp_worker_openrlhf.py, two processes, gloo): rank r trains on rows r, r + 2, ... (so each GRPO group is
split across the ranks), micro-batches of 2, 2 per optimizer step, the gradient averaged over the ranks as DeepSpeed
does. 2 epochs: 2 optimizer steps, the second from the parameters the first moved. Each step's gradient must agree to
float32 rounding: max |g2 - g1| / max |g1| < RTOL.

What runs: OpenRLHF's ActorPPOTrainer.ppo_train, replay buffer, iter_grad_accum_global_norm (its token and sequence
counts all-reduced over the real gloo group), training_step, PolicyLoss and aggregate_loss with dp_size 2, and the
adapter's loss path. What does not: DeepSpeed's engine (the CPU strategy shim stands in for it, its gradient
averaging done by one all-reduce; DeepSpeed's CPU accelerator does fall back to gloo, but its init_distributed first
JIT-compiles a C++ shared-memory op, minutes on a 2-core machine and a compiler in CI), Ray and the experience maker
(the statistics are the adapter's own rollout-wide ones, computed here as test_loss_path.py does).

Both worlds run the same kl_adapters: the ranks get the directory of the one this process imported on their PYTHONPATH
(`same_kl_adapters`). Without it, under `python -m pytest` (the checkout on this process's sys.path) the ranks, started
in tests/openrlhf, would import the copy installed in the environment by scripts/envs.sh, which lags the checkout
until the environment is rebuilt: world size 2 would then run an older adapter than world size 1.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from dp_worker_openrlhf import ROOT_VARIABLE, train_rows
from openrlhf_harness import base_argv, batch_statistics, cli_args, loss_path_batch

import kl_adapters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_parallel import relative_error, run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
#: float32 rounding of the gradient summed in another order (per rank, then all-reduced) is ~1e-7 of its scale
RTOL = 1e-5
WORLD, MICRO, ROWS = 2, 2, 8


def same_kl_adapters() -> dict:
    """The ranks' environment: the directory holding this process's kl_adapters after the suite's PYTHONPATH (the CPU
    stubs and tests/openrlhf, conftest.py), so every rank imports the kl_adapters this process runs (the checkout under
    `python -m pytest`, the installed package under scripts/test.sh's bin/pytest); dp_worker_openrlhf.py checks it
    (ROOT_VARIABLE)."""
    root = str(Path(kl_adapters.__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), root])), ROOT_VARIABLE: root}


@pytest.mark.parametrize("preset", ["sequence"])
def test_world_size_2_gradient_is_world_size_1(actor_dir, ref_dir, cpu_cuda, preset):
    args = cli_args(base_argv(actor_dir))  # --train.max_epochs 2: two optimizer steps
    batch = loss_path_batch(actor_dir, ref_dir)
    statistics = batch_statistics(batch)
    kl_adapters.enable(preset)
    single = train_rows(args, actor_dir, batch, statistics, list(range(ROWS)), MICRO, ROWS // MICRO)
    folder = Path(tempfile.mkdtemp(prefix="dp_openrlhf_"))
    torch.save({"args": args, "actor_dir": actor_dir, "batch": batch, "statistics": statistics, "preset": preset,
                "rows": [list(range(r, ROWS, WORLD)) for r in range(WORLD)], "micro": MICRO,
                "gas": ROWS // WORLD // MICRO}, folder / "job.pt")
    run_ranks(HERE / "dp_worker_openrlhf.py", WORLD, str(folder / "job.pt"), str(folder / "rank{rank}.pt"),
              timeout=180, env=same_kl_adapters())
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 2
    for step, expected in enumerate(single):
        assert torch.equal(ranks[0][step], ranks[1][step])  # one averaged gradient on both ranks
        error = relative_error(ranks[0][step], expected)
        print(f"openrlhf {preset} step {step}: max|g2 - g1| / max|g1| = {error:.2e}")  # docs/data-parallel.md
        assert error < RTOL
