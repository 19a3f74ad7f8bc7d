"""One rank of tests/trl/test_data_parallel.py: GRPOTrainer with kl-adapters under accelerate's MULTI_CPU (gloo).

Run as a script by the test, once per rank, with the environment accelerate reads (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Arguments: a job file (torch.save'd dict, written by the test) and an
output file. The job holds the saved tiny model's folder, the perturbed policy's weights and, per case, the global
generation batch TRL prepared at world size 1; this rank takes its contiguous slice of the rows (as TRL's
RepeatSampler deals a global batch to processes), trims the completion padding to its own rows' longest (as its own
generation would), and computes the gradient of TRL's compute_loss through the DistributedDataParallel model accelerate
prepares (gloo all-reduce, mean over ranks). Then a short trainer.train() with a KL budget, through TRL's own
distributed generation, and the budget's beta. Writes {case: gradient, "groups_ok": ..., "betas": [...]}.
"""

import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from conftest import make_trainer  # noqa: E402
from datasets import Dataset  # noqa: E402
from test_data_parallel import loss_grad, with_rollout_statistics  # noqa: E402

from kl_adapters.adapters import trl as adapter  # noqa: E402


def shard(batch: dict, rank: int, world: int) -> dict:
    """This rank's contiguous slice of a global generation batch's rows, completion columns trimmed to its own
    longest completion (TRL pads each process's generations to that process's longest); num_items_in_batch, TRL's
    count over every process, stays."""
    rows = batch["completion_ids"].shape[0] // world
    own = slice(rank * rows, (rank + 1) * rows)
    longest = int(batch["completion_mask"][own].sum(0).nonzero().max()) + 1

    def part(key, value):
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        assert value.shape[0] == rows * world, key
        value = value[own]
        return value[:, :longest] if value.dim() == 2 and not key.startswith("prompt") else value

    return {key: part(key, value) for key, value in batch.items()}


def main(job_path: str, out_path: str) -> None:
    job = torch.load(job_path, weights_only=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out, dataset = {"groups_ok": True}, Dataset.from_dict(job["dataset"])
    for case, spec in job["cases"].items():
        rows = spec["batch"]["completion_ids"].shape[0] // world
        trainer = make_trainer(job["model_dir"], dataset, kl_preset=spec["preset"], per_device_train_batch_size=rows,
                               num_generations=spec["num_generations"], num_iterations=spec["num_iterations"])
        assert trainer.accelerator.num_processes == world and trainer.accelerator.process_index == rank
        trainer.model.load_state_dict(job["state"])
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        part = shard(spec["batch"], rank, world)
        # the adapter's prompt-group ids of this rank's rows (process_index offset) are the global batch's
        out["groups_ok"] &= torch.equal(adapter.group_ids(trainer, rows), part[adapter.GROUP_KEY])
        if spec["num_iterations"] > 1:
            part = with_rollout_statistics(trainer, part, spec["preset"])
        out[case] = loss_grad(trainer, trainer.accelerator.prepare_model(trainer.model), part)
    trainer = make_trainer(job["model_dir"], dataset, per_device_train_batch_size=job["budget_rows"],
                           num_generations=job["budget_generations"], kl_target=0.01, beta=0.1,
                           max_steps=job["budget_steps"])
    trainer.model.load_state_dict(job["state"])
    trainer.train()
    out["betas"] = [r["kl_adapters/beta"] for r in trainer.state.log_history if "kl_adapters/beta" in r]
    out["final_beta"] = adapter.budget_of(trainer).beta
    torch.save(out, out_path.format(rank=rank))


if __name__ == "__main__":
    main(*sys.argv[1:3])
