"""OpenRLHF's `kl` metric over replay epochs: the calibration of tests/openrlhf/test_gpu.py's KL-falls run.

The run of that test, on CPU: OpenRLHF's ActorPPOTrainer.ppo_train on the loss-path batch of
tests/openrlhf/openrlhf_harness.py (8 ragged sequences, behaviour log-probs from the actor perturbed by
--behaviour-scale), zero advantages (beta * KL is the whole loss), `--epochs` epochs, Adam (betas 0.9 / 0.95, OpenRLHF's
defaults; --bf16: the actor in bfloat16 with float32 master weights, as DeepSpeed's bf16 engine at ZeRO stage 0) at each
`--lr`, for OpenRLHF's own k3 loss and for kl-adapters' `sequence`. It prints and records the sum of
the logged `kl` (k3 token mean at the current parameters, on the fixed batch) over the first and the last 4
micro-batches. OpenRLHF's k3 loss minimises exactly that quantity on those tokens; `sequence` follows the
importance-weighted gradient of the sequence-level KL, whose weights leave 1 as the epochs move the policy off the
batch's behaviour policy, so the metric need not fall for it at a large step size.
Usage: .venvs/openrlhf/bin/python bench/openrlhf_replay_kl.py [--hidden 2048] [--behaviour-scale 1e-3]
       [--epochs 10] [--lr 1e-4 1e-5 1e-6] [--bf16] [--presets k3 sequence] [--name openrlhf_replay_kl_h2048]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import openrlhf_paths  # noqa: F401  (tests/openrlhf and, without CUDA, its TEST-ONLY import stubs on sys.path)

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from openrlhf_cpu_shim import CPUStrategy, cuda_shims, save_tiny_model  # noqa: E402
from openrlhf_harness import base_argv, cli_args, loss_path_batch, ppo_train_on  # noqa: E402
from timing import write_result_and_table  # noqa: E402

import kl_adapters  # noqa: E402


class MasterAdam(torch.optim.Adam):
    """Adam on float32 master copies of low-precision parameters, written back after each step (what DeepSpeed's
    bf16 engine at ZeRO stage 0 does: FP16_Optimizer with float32 master weights)."""

    def __init__(self, params, **kwargs):
        self.model_params = list(params)
        super().__init__([p.detach().float().clone().requires_grad_(True) for p in self.model_params], **kwargs)

    def _pairs(self):
        return zip(self.model_params, self.param_groups[0]["params"])

    @torch.no_grad()
    def step(self, closure=None):
        for p, master in self._pairs():
            master.grad = None if p.grad is None else p.grad.float()
        super().step()
        for p, master in self._pairs():
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none)


def adam_strategy(lr: float, bf16: bool) -> None:
    """CPUStrategy with Adam at `lr` (OpenRLHF's betas) in place of its SGD, recording nothing (84M parameters); bf16:
    the actor in bfloat16 with float32 master weights (`MasterAdam`)."""

    def prepare(self, model_and_config):
        actor, _ = model_and_config
        self.model, self.record = actor, False
        if bf16:
            actor.model.to(torch.bfloat16)
        optimizer = (MasterAdam if bf16 else torch.optim.Adam)(actor.parameters(), lr=lr, betas=(0.9, 0.95))
        return actor, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    CPUStrategy.prepare = prepare


def run(actor_dir: str, batch: dict, preset: str | None, lr: float, epochs: int, bf16: bool) -> list[float]:
    """The `kl` OpenRLHF logs at every micro-batch of ppo_train, under `preset` (None: its own k3 loss)."""
    adam_strategy(lr, bf16)
    kl_adapters.disable()
    if preset:
        kl_adapters.enable(preset)
    try:
        args = cli_args(base_argv(actor_dir) + ["--train.max_epochs", str(epochs)])
        _, steps, _ = ppo_train_on(args, actor_dir, batch)
    finally:
        kl_adapters.disable()
    return [float(exp.info["kl"]) for exp, _ in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--behaviour-scale", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-4, 1e-5, 1e-6])
    parser.add_argument("--bf16", action="store_true", help="the actor in bfloat16, float32 master weights")
    parser.add_argument("--presets", nargs="+", default=["k3", "sequence"], help="k3: OpenRLHF's own k3 loss")
    parser.add_argument("--name", default="openrlhf_replay_kl_h2048")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    for (owner, name), fn in cuda_shims().items():
        setattr(owner, name, fn)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29577", rank=0, world_size=1)
    folder = tempfile.mkdtemp()
    actor_dir = save_tiny_model(os.path.join(folder, "actor"), seed=1, hidden=opts.hidden)
    ref_dir = save_tiny_model(os.path.join(folder, "ref"), seed=2, hidden=opts.hidden)
    batch = loss_path_batch(actor_dir, ref_dir, behaviour_scale=opts.behaviour_scale)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    rows, lines = [], [f"{'KL':<10} {'Adam lr':>8} {'first 4':>8} {'last 4':>8}  falls"]
    for preset in (None if p == "k3" else p for p in opts.presets):
        for lr in opts.lr:
            kl = run(actor_dir, batch, preset, lr, opts.epochs, opts.bf16)
            first, last = sum(kl[:4]), sum(kl[-4:])
            rows.append(dict(preset=preset or "k3 loss", lr=lr, first4=first, last4=last, kl=kl))
            lines.append(f"{preset or 'k3 loss':<10} {lr:>8.0e} {first:>8.3f} {last:>8.3f}  {last < first}")
            print(lines[-1], flush=True)
    data = dict(hidden=opts.hidden, behaviour_scale=opts.behaviour_scale, epochs=opts.epochs, bf16=opts.bf16, runs=rows)
    print(write_result_and_table(opts.name, data, "\n".join(lines)))


if __name__ == "__main__":
    main()
