"""One rank of tests/verl/test_data_parallel.py: verl's actor update (TrainingWorker, FSDP2 engine, micro-batching,
ppo_loss with ``kl_loss_type=kl_adapters:<preset>``) at data-parallel world size WORLD_SIZE on CPU (gloo; the
test-only platform shim), through engine_check.py's builders (its tiny model, engine and actor configuration, batch
layout and train call). Per case, rank r trains on its rows of engine_check's 8-row batch, as verl's dispatch hands
each data-parallel rank its share, with mini_batch_size 8 (verl splits it into 8 / WORLD_SIZE rows per rank,
micro-batches of 4), and the rows' uid (GRPO group) column where the case has one. One SGD step (lr 1) from the same
initial weights, after compute_log_prob's forward (which keeps the rows' pi(EOS) for the statistics): the parameter
update is the gradient, averaged over the ranks by FSDP2. A job with "ulysses": n runs verl's Ulysses sequence
parallelism over n ranks (engine_check --remove-padding, the test-only attention stand-in of ulysses_cpu.py; every
rank of a sequence-parallel group trains on the same rows). Arguments: a job file (torch.save'd by the test) and an
output file pattern; writes {case: update, (case, "eos"): the kept pi(EOS) rows in row order (a reduced preset),
"attention_lengths": the packed lengths the Ulysses attention stand-in saw}. The rank refuses to run another
kl_adapters than the test's (test_data_parallel.same_kl_adapters).
"""

import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
rank_env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
job_path, out_path = sys.argv[1:3]
import torch  # noqa: E402

job = torch.load(job_path, weights_only=False)
ULYSSES = job.get("ulysses", 1)
# engine_check parses its arguments and sets a world-size-1 environment at import
sys.argv[1:] = ["--device", "cpu", *(["--remove-padding"] if ULYSSES > 1 else [])]
import engine_check  # noqa: E402

import kl_adapters  # noqa: E402

os.environ.update(rank_env)
expected = os.environ.get("KL_ADAPTERS_DP_TEST_ROOT")  # test_data_parallel.same_kl_adapters
imported = os.path.dirname(os.path.dirname(os.path.realpath(kl_adapters.__file__)))
assert expected is None or imported == os.path.realpath(expected), f"rank runs {imported}'s kl_adapters, not {expected}'s"

from functools import partial  # noqa: E402

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils import losses  # noqa: E402

if ULYSSES > 1:
    import ulysses_cpu

    ulysses_cpu.install(engine_check, ULYSSES)


def compute_log_prob(worker) -> None:
    """compute_log_prob's forward (TrainingWorker.infer_batch), which keeps the rows' pi(EOS); its output is not read
    (under Ulysses only the first rank of a sequence-parallel group returns it)."""
    td = engine_check.batch()
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    worker.infer_batch(td)


def kept_eos() -> torch.Tensor:
    """The pi(EOS) rows compute_log_prob's forward kept, in the batch's row order (`engine_check.batch`)."""
    keys = engine_check.verl_adapter.eos._row_keys(engine_check.batch()["input_ids"])
    return torch.cat([engine_check.EOS_ROWS.rows[key][0] for key in keys])


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    path = tempfile.mkdtemp(prefix=f"tiny_llama_rank{rank}_")
    engine_check.save_model(path)  # the same seeded weights on every rank
    every_row, make_batch, out = engine_check.tokens, engine_check.batch, {}
    for case, spec in job["cases"].items():
        rows = spec["rows"][rank]
        engine_check.tokens = {k: v[rows] for k, v in every_row.items()}  # what engine_check.batch() lays out
        uid = {} if spec["uid"] is None else {"uid": spec["uid"][rows]}
        engine_check.batch = partial(make_batch, **uid)  # engine_check.train builds its batch with it
        worker = engine_check.build_worker(path, "SGD", 1.0)
        assert worker.engine.ulysses_sequence_parallel_size == ULYSSES
        theta0 = engine_check.params(worker)
        loss = partial(losses.ppo_loss, config=engine_check.actor_config(f"kl_adapters:{spec['preset']}"))
        worker.set_loss_fn(loss)  # compute_log_prob's forward, as before an update: it keeps the rows' pi(EOS)
        compute_log_prob(worker)
        if engine_check.get_preset(spec["preset"]).uses_batch_statistics:
            assert engine_check.EOS_ROWS.rows, "the termination control variate's input must reach the update"
            out[case, "eos"] = kept_eos()
        engine_check.train(worker, loss, *(job[k][rows] for k in ("old_log_probs", "ref_log_prob", "advantages")))
        out[case] = theta0 - engine_check.params(worker)
    out["attention_lengths"] = ulysses_cpu.CALLS if ULYSSES > 1 else []
    torch.save(out, out_path.format(rank=rank))


if __name__ == "__main__":
    main()
