"""Data parallelism (issue 37, part 4; docs/data-parallel.md): GRPOTrainer with kl-adapters at world size 2 (two
processes, accelerate's MULTI_CPU with gloo) gives the parameter gradient of world size 1 on the same global batch.

World size 1 (this process): TRL prepares a global generation batch of 12 rows (its generation, rewards, advantages,
reference log-probs, the adapter's prompt-group ids) and takes compute_loss's gradient with KLGRPOConfig(kl_preset=...).
World size 2 (dp_worker_trl.py, two processes): each rank takes its 6 rows, as TRL deals them, and takes compute_loss's
gradient through accelerate's DistributedDataParallel model (gloo all-reduce). The two must agree to float32 rounding:
max |g2 - g1| / max |g1| < RTOL. Cases (CASES): GRPO groups of 6 (each rank holds whole groups) and of 4 (the middle
group's rows 4-7 are split across the ranks), on-policy (statistics fitted at loss time) and off-policy (fitted at
rollout time). Then a 3-step trainer.train() at world size 2 with a KL budget (kl_target) through TRL's own
distributed generation: both ranks hold the same beta at every step, and it moved.
"""

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import flat_grad, make_trainer, perturb

from kl_adapters.adapters import trl as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_parallel import relative_error, run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
#: float32 rounding of the tiny model's gradient summed in another order (per rank, then all-reduced) is ~1e-7 of its
#: scale; 1e-5 leaves room and is far below any statistics difference (a row's leave-one-out over other rows)
RTOL = 1e-5
ROWS, WORLD, BUDGET_STEPS = 12, 2, 3
#: case -> (preset, num_generations, num_iterations): 6 generations = each rank holds whole groups; 4 = the group of rows
#: 4-7 spans both ranks; num_iterations 2 = off-policy, TRL keeps the rollout log-probs and the statistics are fitted
#: at rollout (`adapter.rollout_statistics`, recomputed here on each rank's rows without pi(EOS))
CASES = {"whole_groups": ("sequence", 6, 1), "split_group": ("sequence", 4, 1),
         "split_group_reward": ("reward", 4, 1), "split_group_rollout_statistics": ("sequence", 4, 2)}


def generation_batch(trainer) -> dict:
    """TRL's prepared global generation batch in its generation order (conftest.one_batch without the row shuffle
    _prepare_inputs applies after it): prompt groups are contiguous, so a rank's contiguous slice is its share."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))


def with_rollout_statistics(trainer, batch: dict, preset: str) -> dict:
    """The batch with its rows' rollout statistics computed by the adapter on this process (every process's rows
    at world size 2), without end-of-sequence probabilities (the rollout forward that has them is not rerun)."""
    statistics = adapter.rollout_statistics(trainer, batch, preset)
    return {**batch, **{key: getattr(statistics, name) for name, key in adapter.ROLLOUT_STATISTICS_KEYS.items()}}


def loss_grad(trainer, model, batch: dict):
    return flat_grad(trainer, lambda: trainer.compute_loss(model, dict(batch)))


@pytest.fixture(scope="module")
def runs(model_dir, dataset):
    """(world-size-1 gradients, world-size-2 outputs of both ranks)."""
    trainer = make_trainer(model_dir, dataset, per_device_train_batch_size=ROWS, num_generations=4)
    perturb(trainer.model, seed=1)
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    cases, single = {}, {}
    for case, (preset, generations, iterations) in CASES.items():
        trainer = make_trainer(model_dir, dataset, per_device_train_batch_size=ROWS, num_generations=generations,
                               num_iterations=iterations, kl_preset=preset)
        trainer.model.load_state_dict(state)
        batch = generation_batch(trainer)
        cases[case] = {"preset": preset, "num_generations": generations, "num_iterations": iterations,
                       "batch": batch}
        if iterations > 1:
            assert batch["old_per_token_logps"] is not None  # TRL kept the rollout log-probs
            batch = with_rollout_statistics(trainer, batch, preset)
        single[case] = loss_grad(trainer, trainer.model, batch)
    folder = Path(tempfile.mkdtemp(prefix="dp_trl_"))
    torch.save({"model_dir": model_dir, "dataset": dataset.to_dict(), "state": state, "cases": cases,
                "budget_rows": ROWS // WORLD, "budget_generations": 4, "budget_steps": BUDGET_STEPS},
               folder / "job.pt")
    run_ranks(HERE / "dp_worker_trl.py", WORLD, str(folder / "job.pt"), str(folder / "rank{rank}.pt"), timeout=240)
    return single, [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES)
def test_world_size_2_gradient_is_world_size_1(runs, case):
    single, ranks = runs
    assert all(r["groups_ok"] for r in ranks)  # the adapter's prompt-group ids of each rank's rows are the global ones
    assert torch.equal(ranks[0][case], ranks[1][case])  # DDP: one all-reduced gradient on both ranks
    error = relative_error(ranks[0][case], single[case])
    print(f"trl {case}: max|g2 - g1| / max|g1| = {error:.2e}")  # docs/data-parallel.md (pytest -s)
    assert error < RTOL


def test_kl_budget_beta_is_the_same_on_both_ranks(runs):
    _, ranks = runs
    betas = [r["betas"] for r in ranks]
    assert len(betas[0]) == BUDGET_STEPS and betas[0] == betas[1]
    assert ranks[0]["final_beta"] == ranks[1]["final_beta"] != 0.1  # the controller moved it, alike on both
