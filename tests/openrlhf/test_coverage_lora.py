"""A LoRA actor (``--ds.lora.rank``): OpenRLHF wraps the policy in a PEFT model whose adapters are the trained
parameters, while its reference model stays the base checkpoint (a separate actor). Identity pinned, as in
test_loss_path.py::test_gradient_is_task_plus_kl_surrogate: with ``sequence`` on, every optimizer step's gradient of
the adapters = grad(OpenRLHF's task loss) + beta * grad[(1/N_tok) sum_b kl_surrogate_b], each row with its rollout
statistics and the current policy's pi(EOS) (the adapter reads the EOS ids through the PEFT wrapper)."""

from __future__ import annotations

import openrlhf_cpu_shim
import torch
from openrlhf_harness import BETA, GAS, batch_statistics, load_params, ppo_train_on, reference_grad
from test_coverage_packing import args, batch  # noqa: F401  (the loss path's arguments and batch, as fixtures)

import kl_adapters
from kl_adapters import activation


def lora_actor(path, dtype=torch.float32):
    """OpenRLHF's Actor with LoRA (rank 4 on q_proj, v_proj) around the saved model, its adapters initialised alike."""
    from openrlhf.models import Actor

    torch.manual_seed(0)
    actor = Actor(path, attn_implementation="eager", param_dtype="bf16", lora_rank=4, lora_alpha=8,
                  target_modules=["q_proj", "v_proj"])
    actor.model.to(dtype)
    return actor


def test_lora_actor_gradient_is_task_plus_kl_surrogate(args, actor_dir, batch, cpu_cuda, monkeypatch):
    monkeypatch.setattr(openrlhf_cpu_shim, "load_actor", lora_actor)
    kl_adapters.enable("sequence")
    stats = batch_statistics(batch)
    trainer, steps, _ = ppo_train_on(args, actor_dir, batch, statistics=stats)
    log = trainer.strategy
    assert len(log.grad_log) == len(steps) // GAS == 4
    assert all("lora_" in name for name in log.params_log[0])  # only the adapters are trained
    for k, grad in enumerate(log.grad_log):
        model = load_params(actor_dir, log.params_log[k])
        window = steps[GAS * k:GAS * (k + 1)]
        expected = reference_grad(model, window, trainer, activation.parse("sequence"), BETA, statistics=(batch, stats))
        task_only = reference_grad(model, window, trainer, activation.parse("sequence"), 0.0,
                                   statistics=(batch, stats))
        kl_part = (expected - task_only).norm()
        assert kl_part > 0.1 * expected.norm(), "the KL term must matter in this test"
        assert (grad - expected).norm() < 1e-4 * kl_part, f"step {k}"
