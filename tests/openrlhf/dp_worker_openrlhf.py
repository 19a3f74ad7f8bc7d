"""One rank of tests/openrlhf/test_data_parallel.py: OpenRLHF's ActorPPOTrainer.ppo_train on this rank's share of the
rows, torch.distributed initialised with gloo (the rank's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

OpenRLHF's own code runs as in a DeepSpeed data-parallel group: its loss normalisers (iter_grad_accum_global_norm,
get_loss_batch_info) all-reduce token and sequence counts over the gloo world, and aggregate_loss multiplies by dp_size.
DeepSpeed's engine is replaced by the suite's CPU strategy shim (openrlhf_cpu_shim.CPUStrategy) plus the one thing
DeepSpeed's engine does across ranks for a gradient, averaging it (`DataParallelCPUStrategy`). Arguments: a job file
(torch.save'd by the test) and an output file pattern; writes this rank's logged optimizer-step gradients. The rank
refuses to run another kl_adapters than the test's (ROOT_VARIABLE: the directory holding it, which the test also puts
on the rank's PYTHONPATH; test_data_parallel.same_kl_adapters).
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import openrlhf_cpu_shim  # noqa: E402

#: environment variable naming the directory of the test process's kl_adapters (test_data_parallel.same_kl_adapters)
ROOT_VARIABLE = "KL_ADAPTERS_DP_TEST_ROOT"


class DataParallelCPUStrategy(openrlhf_cpu_shim.CPUStrategy):
    """CPUStrategy with DeepSpeed's data-parallel gradient averaging: at the end of each window of gas micro-batches,
    before the step, every gradient is all-reduced (sum) over the gloo world and divided by its size."""

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs) -> None:
        if dist.is_initialized() and (self._micro_steps + 1) % self.accumulated_gradient == 0:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        super().optimizer_step(optimizer, model, scheduler, name, **kwargs)


def train_rows(args, actor_dir: str, batch: dict, statistics, rows: list[int], micro: int, gas: int) -> list:
    """ppo_train on the batch's `rows` (their rollout statistics attached, as make_experience does), micro-batches of
    `micro`, `gas` per optimizer step; the gradient of every optimizer step (strategy shim's log)."""
    from openrlhf_cpu_shim import load_actor
    from openrlhf_harness import build_trainer, experience_fields

    from kl_adapters.adapters.openrlhf.statistics import attach
    from openrlhf.trainer.ppo_utils.experience import Experience

    trainer = build_trainer(args, load_actor(actor_dir), micro_batch=micro, gas=gas)
    experience = Experience(**{k: v[rows].clone() for k, v in experience_fields(batch).items()},
                            total_length=batch["attention_mask"][rows].sum(-1), index=rows, info={})
    attach(experience, statistics[rows])
    trainer.replay_buffer.append(experience)
    torch.manual_seed(0)  # ppo_train shuffles the replay buffer
    trainer.ppo_train(kl_ctl=args.algo.kl.init_coef)
    return trainer.strategy.grad_log


def main(job_path: str, out_path: str) -> None:
    import kl_adapters

    expected = os.environ.get(ROOT_VARIABLE)
    imported = os.path.dirname(os.path.dirname(os.path.realpath(kl_adapters.__file__)))
    assert expected is None or imported == os.path.realpath(expected), (
        f"rank imports kl_adapters from {imported}, the test from {expected}")
    job = torch.load(job_path, weights_only=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    openrlhf_cpu_shim.install_cuda_shims()
    openrlhf_cpu_shim.CPUStrategy = DataParallelCPUStrategy  # what openrlhf_harness.build_trainer builds
    dist.init_process_group("gloo", rank=rank, world_size=world)
    kl_adapters.enable(job["preset"])
    grads = train_rows(job["args"], job["actor_dir"], job["batch"], job["statistics"], job["rows"][rank],
                       job["micro"], job["gas"])
    torch.save(grads, out_path.format(rank=rank))


if __name__ == "__main__":
    main(*sys.argv[1:3])
