"""One rank of tests/openrlhf/test_ring_attention.py: OpenRLHF's ActorPPOTrainer.ppo_train with ring attention over
the gloo world (every rank one ring rank: --ds.ring_attn_size = world size, data-parallel size 1), on CPU.

What runs is OpenRLHF's: the device mesh ("dp", "sp", "tp") and DeepspeedStrategy.setup_ring_attn on it (the ring
group, ring_flash_attn.substitute_hf_flash_attn), ppo_train (not shuffled under ring attention, ppo_actor.py), the
replay buffer, iter_grad_accum_global_norm over the "dp" group, training_step, Actor.forward with --ds.packing_samples
and the ring group (unpad_and_slice_tensor: this rank's slice of each packed micro-batch; gather_and_pad_tensor: the
log-probs of the whole rows), PolicyLoss and aggregate_loss; and the adapter's loss path. What stands in, tests only:
ring_attn_cpu.py for ring-flash-attn's attention and flash-attn's all_gather, the suite's CPU strategy shim for
DeepSpeed's engine with its gradient averaging over the world (dp_worker_openrlhf.DataParallelCPUStrategy), and the
model's attention set to "flash_attention_2" after loading (loading with it would ask for flash-attn).

Arguments: the job file (torch.save'd by the test: OpenRLHF's parsed args, whose --algo.kl.preset activates
kl-adapters when unpickled, as in a Ray actor) and an output file pattern; writes this rank's optimizer-step gradients,
its rollout forward's log-probs and pi(EOS), and its attention calls.
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
import ring_attn_cpu  # noqa: E402
from dp_worker_openrlhf import ROOT_VARIABLE, DataParallelCPUStrategy  # noqa: E402


class RingCPUStrategy(DataParallelCPUStrategy):
    """The CPU strategy shim with DeepspeedStrategy's ring_attn_group (OpenRLHF's module-level ring group)."""

    @property
    def ring_attn_group(self):
        from openrlhf.models.ring_attn_utils import get_ring_attn_group

        return get_ring_attn_group()

    @ring_attn_group.setter
    def ring_attn_group(self, value) -> None:  # CPUStrategy.__init__ sets None
        assert value is None


def ring_actor(path: str):
    """OpenRLHF's Actor as PolicyModelActor builds it under ring attention: --ds.packing_samples, flash_attention_2."""
    actor = openrlhf_cpu_shim.load_actor(path)
    actor.packing_samples = True
    actor.model.config._attn_implementation = "flash_attention_2"
    return actor


def main(job_path: str, out_path: str) -> None:
    import kl_adapters

    expected = os.environ.get(ROOT_VARIABLE)
    imported = os.path.dirname(os.path.dirname(os.path.realpath(kl_adapters.__file__)))
    assert expected is None or imported == os.path.realpath(expected), (
        f"rank imports kl_adapters from {imported}, the test from {expected}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    openrlhf_cpu_shim.install_cuda_shims()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ring_attn_cpu.install()
    job = torch.load(job_path, weights_only=False)  # the args' PresetFlag enables kl-adapters here
    args, batch = job["args"], job["batch"]
    assert args.ds.ring_attn_size == world and kl_adapters.activation.active() is not None

    from torch.distributed.device_mesh import init_device_mesh

    from kl_adapters.adapters.openrlhf.eos_payload import split_eos
    from kl_adapters.adapters.openrlhf.statistics import attach
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf_harness import build_trainer, experience_fields, record_steps

    openrlhf_cpu_shim.CPUStrategy = RingCPUStrategy  # what openrlhf_harness.build_trainer builds
    actor = ring_actor(job["actor_dir"])
    trainer = build_trainer(args, actor, micro_batch=job["micro"], gas=job["gas"])
    strategy = trainer.strategy
    strategy.ring_attn_size = args.ds.ring_attn_size
    strategy.ds_device_mesh = init_device_mesh("cpu", (world // strategy.ring_attn_size, strategy.ring_attn_size, 1),
                                               mesh_dim_names=("dp", "sp", "tp"))
    DeepspeedStrategy.setup_ring_attn(strategy, strategy.ds_device_mesh)
    assert dist.get_world_size(strategy.ring_attn_group) == world

    # rollout time (PolicyModelActor.forward: no gradient), the initial parameters
    with torch.no_grad():
        out = actor(batch["sequences"], batch["action_mask"], attention_mask=batch["attention_mask"],
                    ring_attn_group=strategy.ring_attn_group)
    log_probs, eos = split_eos(out)
    rollout_calls = len(ring_attn_cpu.CALLS)

    steps = record_steps(trainer)
    experience = Experience(**{k: v.clone() for k, v in experience_fields(batch).items()},
                            total_length=batch["attention_mask"].sum(-1), index=list(range(len(batch["sequences"]))),
                            info={})
    attach(experience, job["statistics"])
    trainer.replay_buffer.append(experience)
    torch.manual_seed(0)
    trainer.ppo_train(kl_ctl=args.algo.kl.init_coef)
    torch.save({"grads": strategy.grad_log, "log_probs": log_probs, "eos": None if eos is None else eos.prob,
                "is_eos": None if eos is None else eos.is_eos, "rollout_calls": ring_attn_cpu.CALLS[:rollout_calls],
                "train_calls": ring_attn_cpu.CALLS[rollout_calls:], "steps": len(steps)}, out_path.format(rank=rank))


if __name__ == "__main__":
    main(*sys.argv[1:3])
