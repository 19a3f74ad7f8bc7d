"""One rank of tests/verl/test_data_parallel.py: verl's actor update (TrainingWorker, FSDP2 engine, micro-batching,
ppo_loss with ``kl_loss_type=kl_adapters:<preset>``) at data-parallel world size WORLD_SIZE on CPU (gloo; the
test-only platform shim), through engine_check.py's builders (its tiny model, engine and actor configuration, batch
layout and train call). Per case, rank r trains on its rows of engine_check's 8-row batch, as verl's dispatch hands
each data-parallel rank its share, with mini_batch_size 8 (verl splits it into 8 / WORLD_SIZE rows per rank,
micro-batches of 4), and the rows' uid (GRPO group) column where the case has one. One SGD step (lr 1) from the same
initial weights, after compute_log_prob's forward (which keeps the rows' pi(EOS) for the statistics): the parameter
update is the gradient, averaged over the ranks by FSDP2. Arguments: a job file
(torch.save'd by the test) and an output file pattern; writes {case: update}.
"""

import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
rank_env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
job_path, out_path = sys.argv[1:3]
sys.argv[1:] = ["--device", "cpu"]  # engine_check parses its arguments and sets a world-size-1 environment at import
import engine_check  # noqa: E402

os.environ.update(rank_env)

from functools import partial  # noqa: E402

import torch  # noqa: E402
from verl.workers.utils import losses  # noqa: E402


def main() -> None:
    job = torch.load(job_path, weights_only=False)
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
        theta0 = engine_check.params(worker)
        loss = partial(losses.ppo_loss, config=engine_check.actor_config(f"kl_adapters:{spec['preset']}"))
        worker.set_loss_fn(loss)  # compute_log_prob's forward, as before an update: it keeps the rows' pi(EOS)
        engine_check.log_probs(worker)
        assert engine_check.EOS_ROWS.rows, "the termination control variate's input must reach the update"
        engine_check.train(worker, loss, *(job[k][rows] for k in ("old_log_probs", "ref_log_prob", "advantages")))
        out[case] = theta0 - engine_check.params(worker)
    torch.save(out, out_path.format(rank=rank))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
