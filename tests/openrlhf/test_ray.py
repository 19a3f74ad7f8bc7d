"""Activation inside OpenRLHF's real Ray actors: a local Ray cluster (2 CPUs, 1 logical GPU) whose workers never see
KL_ADAPTERS, and real PolicyModelActors built by OpenRLHF's own init_model_from_pretrained (CPU strategy shim).

A patch made in the driver does not reach the workers (Ray re-imports OpenRLHF there); the flag does, because
OpenRLHF ships its args to every actor and unpickling args.algo.kl.preset activates kl-adapters in that process."""

from __future__ import annotations

import os

import pytest
import torch

import kl_adapters
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters.openrlhf.eos_payload import LogProbsWithEos, split_eos
from openrlhf_cpu_shim import EOS, CPUStrategy, load_actor, random_batch
from openrlhf_harness import base_argv, cli_args, probe, softmax_eos, use_cpu_device

pytestmark = pytest.mark.ray


def experience(actor_dir, ref_dir):
    from openrlhf.trainer.ppo_utils.experience import Experience

    sequences, attention_mask, action_mask = random_batch(4, 4, [5, 3, 5, 4], seed=0)
    sequences[1, 4 + 3 - 1] = EOS
    with torch.no_grad():
        old = load_actor(actor_dir)(sequences, action_mask, attention_mask=attention_mask)
        base = load_actor(ref_dir)(sequences, action_mask, attention_mask=attention_mask)
    return Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                      action_log_probs=old, base_action_log_probs=base, advantages=0.1 * action_mask.float(),
                      index=list(range(4)), info={})


def rollout_forward(handle, batch):
    """The call RemoteExperienceMaker.make_experience makes (RayActorGroup.async_run_method_batch): execute_batch of
    "forward" on a list of sample batches; the results come back through Ray's object store."""
    import ray

    chunk = {"sequences": [batch.sequences], "action_mask": [batch.action_mask],
             "attention_mask": [batch.attention_mask]}
    return ray.get(handle.execute_batch.remote("forward", chunk, 0, 1))[0]


def test_flag_activates_real_policy_actor(ray_cluster, actor_dir, ref_dir):
    """--algo.kl.preset (through the wrapper CLI) patches a real PolicyModelActor, whose fit() then reports the
    adapter's metrics and whose rollout forward returns OpenRLHF's log-probs carrying pi(EOS | y_<t) of that forward
    through Ray (zero-copy tensors on, as under train_ppo_ray); an actor given the same args without the flag stays
    OpenRLHF (plain tensors), although the driver is patched."""
    ray = ray_cluster
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    plain_args = cli_args(base_argv(actor_dir))
    flagged_args = cli_args(base_argv(actor_dir) + ["--algo.kl.preset", "sequence"], wrapper=True)
    assert "ActorPPOTrainer.training_step" in adapter.patched()  # in the driver
    flagged, plain = (PolicyModelActor.options(num_gpus=0.2).remote(1, 0, None, None) for _ in range(2))
    try:
        before = ray.get(flagged.__ray_call__.remote(probe))
        assert before["active"] is None and before["patched"] == [] and not before["env"]
        ray.get([flagged.init_model_from_pretrained.remote(CPUStrategy(flagged_args), actor_dir),
                 plain.init_model_from_pretrained.remote(CPUStrategy(plain_args), actor_dir)])
        after, control = ray.get([flagged.__ray_call__.remote(probe), plain.__ray_call__.remote(probe)])
        assert after["pid"] == before["pid"] != os.getpid()
        assert after["active"] == "sequence" and "ActorPPOTrainer.training_step" in after["patched"]
        assert control["active"] is None and control["patched"] == []

        batch = experience(actor_dir, ref_dir)
        ray.get([handle.__ray_call__.remote(use_cpu_device) for handle in (flagged, plain)])
        carried, native = rollout_forward(flagged, batch), rollout_forward(plain, batch)
        assert isinstance(carried, LogProbsWithEos) and type(native) is torch.Tensor
        log_probs, eos = split_eos(carried)
        assert type(log_probs) is torch.Tensor and log_probs.shape == native.shape
        local = load_actor(actor_dir, torch.bfloat16)  # as init_model_from_pretrained loads it (param_dtype bf16)
        expected = softmax_eos(local, batch.sequences, batch.attention_mask, batch.action_mask)
        torch.testing.assert_close(eos.prob, expected.prob, rtol=2e-2, atol=1e-4)
        assert torch.equal(eos.is_eos, expected.is_eos) and eos.is_eos.any()

        statuses = []
        for handle in (flagged, plain):
            ray.get(handle.append.remote(batch))
            statuses.append(ray.get(handle.fit.remote(kl_ctl=0.1)))
        assert {adapter.SEQ_KL, adapter.GRAD_WEIGHT_GAP, "kl", "logprobs_diff"} <= set(statuses[0])
        assert adapter.SEQ_KL not in statuses[1] and "kl" in statuses[1]
    finally:
        for handle in (flagged, plain):
            ray.kill(handle)


def test_kl_adapters_env_activates_real_policy_actor(ray_cluster):
    """KL_ADAPTERS in a worker's environment (what kl_adapters.activation.ray_runtime_env_hook adds to a job's
    runtime_env) activates it at interpreter start (.pth hook); importing PolicyModelActor's module patches it."""
    ray = ray_cluster
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    kl_adapters.disable()
    env = {"KL_ADAPTERS": "sequence", "PYTHONPATH": os.environ["PYTHONPATH"]}
    handle = PolicyModelActor.options(num_gpus=0.2, runtime_env={"env_vars": env}).remote(1, 0, None, None)
    try:
        state = ray.get(handle.__ray_call__.remote(probe))
        assert state["active"] == "sequence" and "ActorPPOTrainer.training_step" in state["patched"]
    finally:
        ray.kill(handle)
