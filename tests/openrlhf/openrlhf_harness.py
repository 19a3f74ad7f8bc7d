"""Test helpers of the OpenRLHF suite (tests only): OpenRLHF's real command-line parsing, and the argument vector of a
small run."""

from __future__ import annotations

import runpy
import sys


def base_argv(model_dir: str) -> list[str]:
    """train_ppo_ray arguments of a 1-GPU group_norm run with the KL as a k3 loss (init_coef 0.1)."""
    return ["--actor.model_name_or_path", model_dir, "--reward.remote_url", "http://127.0.0.1:1",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
            "--rollout.batch_size", "4", "--rollout.micro_batch_size", "4", "--actor.num_gpus_per_node", "1",
            "--ref.num_gpus_per_node", "1", "--train.micro_batch_size", "2", "--train.batch_size", "4",
            "--train.max_epochs", "2", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--algo.kl.init_coef", "0.1", "--ds.attn_implementation", "eager"]


class _Parsed(Exception):
    pass


def cli_args(argv: list[str], *, wrapper: bool = False):
    """OpenRLHF's real argument parsing and validation (train_ppo_ray run as __main__), stopped where train() builds
    its strategy; wrapper=True goes through `python -m kl_adapters.adapters.openrlhf_cli` instead."""
    import ray

    import openrlhf.utils

    def capture(args):
        raise _Parsed(args)

    saved = openrlhf.utils.get_strategy, ray.is_initialized, sys.argv
    openrlhf.utils.get_strategy, ray.is_initialized = capture, (lambda: True)
    try:
        if wrapper:
            from kl_adapters.adapters import openrlhf_cli

            openrlhf_cli.main(argv)
        else:
            sys.argv = ["train_ppo_ray", *argv]
            runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        openrlhf.utils.get_strategy, ray.is_initialized, sys.argv = saved
    raise AssertionError("train_ppo_ray did not reach get_strategy")


def build_trainer(args, actor, *, micro_batch: int, gas: int, lr: float = 0.5, device: int | str = "cpu",
                  record: bool = True):
    """OpenRLHF's ActorPPOTrainer around `actor` with the CPU strategy shim (gas micro-batches per optimizer step).

    device "cpu": torch.cuda.current_device() (cpu_cuda shim) is 0 while the replay buffer is built, then "cpu", where
    ppo_train moves its batches; "cuda": left alone (a real GPU)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_cpu_shim import CPUStrategy, set_current_device

    strategy = CPUStrategy(args, accumulated_gradient=gas, lr=lr, record=record)
    _, optimizer, scheduler = strategy.prepare((actor, None))
    if device == "cpu":
        set_current_device(0)
    trainer = ppo_actor.ActorPPOTrainer(strategy, actor, None, optimizer, scheduler, micro_train_batch_size=micro_batch,
                                        dataloader_pin_memory=False)
    if device == "cpu":
        set_current_device("cpu")
    return trainer


def record_steps(trainer) -> list:
    """Record (experience, loss_batch_info) of every training_step call ppo_train makes, in order."""
    calls = []

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        calls.append((experience, loss_batch_info))
        return type(trainer).training_step(trainer, experience, kl_ctl, step, loss_batch_info)

    trainer.training_step = training_step
    return calls


def probe(actor) -> dict:
    """Run inside a Ray actor (``handle.__ray_call__.remote(probe)``): kl-adapters' state in that process."""
    import os

    from kl_adapters import activation

    adapter = sys.modules.get("kl_adapters.adapters.openrlhf")
    settings = activation.active()
    return {"pid": os.getpid(), "active": None if settings is None else str(settings),
            "patched": adapter.patched() if adapter else [], "env": os.environ.get("KL_ADAPTERS")}


def use_cpu_device(actor) -> None:
    """Run inside a PolicyModelActor after init_model_from_pretrained: ppo_train then moves batches to "cpu"."""
    from openrlhf_cpu_shim import set_current_device

    set_current_device("cpu")
