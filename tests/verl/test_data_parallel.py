"""Data parallelism (issue 37, part 4; docs/data-parallel.md): verl's actor update through its FSDP2 engine with
``kl_loss_type=kl_adapters:sequence`` at data-parallel world size 2 gives the parameter gradient of world size 1 on
the same global batch (CPU, gloo, the test-only platform shim; dp_worker_verl.py, built on engine_check.py).

The batch: engine_check's 8 ragged rows, behaviour and reference log-probs near the model's own, random advantages;
one SGD step (lr 1), so the update is the gradient. World size 1: one process trains on all 8 rows. World size 2:
rank r trains on its 4 rows (mini_batch_size 8 over 2 ranks, micro-batches of 4), FSDP2 averaging the gradient.
Cases: GRPO groups (a uid column, groups of 4) held whole by each rank; the same groups split across the ranks (rank
r holds rows r, r + 2, ...: what verl's balance_batch reordering can do); no uid column (the statistics are
leave-one-out over the whole batch). The updates must agree to float32 rounding: max |u2 - u1| / max |u1| < RTOL.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from verl_cases import flat_log_probs, make_tokens, padded, tiny_llama

import kl_adapters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_parallel import relative_error, run_ranks  # noqa: E402

#: environment variable naming the directory of the test process's kl_adapters (`same_kl_adapters`)
ROOT_VARIABLE = "KL_ADAPTERS_DP_TEST_ROOT"

HERE = Path(__file__).resolve().parent
#: float32 rounding of the gradient summed in another order (per rank, then reduced) is ~1e-7 of its scale
RTOL = 1e-5
WORLD, ROWS = 2, 8
GROUPS = torch.arange(ROWS) // 4
CONTIGUOUS = [list(range(r * ROWS // WORLD, (r + 1) * ROWS // WORLD)) for r in range(WORLD)]
INTERLEAVED = [list(range(r, ROWS, WORLD)) for r in range(WORLD)]
#: case -> (uid column or None, each rank's rows at world size 2)
CASES = {"whole_groups": (GROUPS, CONTIGUOUS), "split_groups": (GROUPS, INTERLEAVED), "no_uid": (None, CONTIGUOUS)}


def job(world: int, folder: Path) -> Path:
    tokens = make_tokens(seed=0)  # engine_check's batch
    mask = tokens["response_mask"]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = padded(flat_log_probs(tiny_llama(seed=0), tokens), tokens).float()
    path = folder / f"job{world}.pt"
    torch.save({"old_log_probs": (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask,
                "ref_log_prob": (current + 0.5 * torch.randn(current.shape, generator=gen)) * mask,
                "advantages": torch.randn(ROWS, 1, generator=gen) * mask,
                "cases": {case: {"preset": "sequence", "uid": uid,
                                 "rows": shards if world == WORLD else [list(range(ROWS))]}
                          for case, (uid, shards) in CASES.items()}}, path)
    return path


def same_kl_adapters() -> dict:
    """The ranks' environment: the directory holding this process's kl_adapters on their PYTHONPATH, so that they run
    the same one (under `python -m pytest` the checkout; the ranks, started in tests/verl, would otherwise import the
    copy installed in .venvs/verl); dp_worker_verl.py checks it (ROOT_VARIABLE)."""
    root = str(Path(kl_adapters.__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), root])), ROOT_VARIABLE: root}


def rank_updates(make_job, prefix: str, timeout: float = 240) -> dict:
    """{world size: [each rank's outputs of dp_worker_verl.py]} at world sizes 1 and WORLD, the job file of each
    made by make_job(world, folder) (also tests/verl/test_sequence_parallel.py)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    out = {}
    for world in (1, WORLD):
        run_ranks(HERE / "dp_worker_verl.py", world, str(make_job(world, folder)),
                  str(folder / f"w{world}r{{rank}}.pt"), timeout=timeout, env=same_kl_adapters())
        out[world] = [torch.load(folder / f"w{world}r{r}.pt", weights_only=False) for r in range(world)]
    return out


@pytest.fixture(scope="module")
def updates():
    """{world size: [each rank's {case: parameter update}]}."""
    return rank_updates(job, "dp_verl_")


@pytest.mark.parametrize("case", CASES)
def test_world_size_2_gradient_is_world_size_1(updates, case):
    single, ranks = updates[1][0][case], updates[WORLD]
    assert torch.equal(ranks[0][case], ranks[1][case])  # FSDP2: every rank applied the same update
    error = relative_error(ranks[0][case], single)
    print(f"verl {case}: max|u2 - u1| / max|u1| = {error:.2e}")  # docs/data-parallel.md (pytest -s)
    assert error < RTOL
