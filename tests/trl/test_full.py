"""GRPOTrainer with kl_preset="full": the trainer's gradient is TRL's task gradient plus full_kl_surrogate's.

Identity pinned (loss types, on- and off-policy, LoRA):
    grad[trainer loss, flag "full", beta]  ==  grad[trainer loss, beta = 0]
        + grad full_kl_surrogate(logits / temperature, ref_logits / temperature, completion_ids, mask,
                                 beta * B / D, old_logp, task, group, eos)
with the logits of both models computed here independently (the models' own forward, full [B, T, V] logits), so the
adapter's hidden-state capture, position shift, temperature and reference choice are all checked, and task / group /
eos by hand (conftest.statistics_inputs_by_hand); full_kl_surrogate itself is pinned exact by
tests/core/test_full_vocab.py. Flag off stays bit-identical.
"""

import pytest
import torch
from conftest import (completion_logits, flat_grad, make_trainer, one_batch, perturb, policy_logps,
                      statistics_inputs_by_hand)
from test_grpo_gradients import assert_close, set_flag, trainer_grad

from kl_adapters.adapters import trl as adapter
from kl_adapters.full_vocab import full_kl_surrogate


def reference_logits(trainer, batch):
    with torch.no_grad():
        if trainer.ref_model is not None:
            return completion_logits(trainer.ref_model, batch, trainer.temperature)
        with trainer.model.disable_adapter():
            return completion_logits(trainer.model, batch, trainer.temperature)


def expected_grad(trainer, batch, beta=0.1):
    """grad(task loss, beta = 0) + grad(full_kl_surrogate on full logits of the same batch, task / group / eos by
    hand)."""
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    mask = batch["completion_mask"]
    old = adapter.behaviour_logps(batch, None)
    beta_seq = beta * mask.shape[0] / adapter.per_token_normaliser(trainer, batch, mask)
    ref = reference_logits(trainer, batch)
    kl = flat_grad(trainer, lambda: full_kl_surrogate(
        completion_logits(trainer.model, batch, trainer.temperature), ref, batch["completion_ids"], mask,
        beta=beta_seq, old_logp=old, **statistics_inputs_by_hand(trainer, batch, "full", beta)))
    assert float(kl.abs().max()) > 1e-3 * float(task.abs().max())  # the KL part is not negligible: the check bites
    return task + kl


def full_trainer(model_dir, dataset, seed, **overrides):
    trainer = make_trainer(model_dir, dataset, kl_preset="full", temperature=0.7, **overrides)
    perturb(trainer.model, seed=seed, scale=3.0 if "peft_config" in overrides else 0.3)
    return trainer


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_on_policy_gradient_is_task_plus_full_kl(model_dir, dataset, loss_type):
    trainer = full_trainer(model_dir, dataset, seed=11, loss_type=loss_type)
    batch = one_batch(trainer)
    assert batch.get("ref_per_token_logps") is None  # generation skipped TRL's reference pass
    assert_close(trainer_grad(trainer, batch, "full"), expected_grad(trainer, batch))


def test_off_policy_gradient_uses_rollout_logps(model_dir, dataset):
    trainer = full_trainer(model_dir, dataset, seed=12, loss_type="dapo")
    batch = one_batch(trainer)
    with torch.no_grad():
        batch["old_per_token_logps"] = policy_logps(trainer, batch)  # what TRL stores when num_iterations > 1
    perturb(trainer.model, scale=0.2, seed=13)  # the policy moved since the rollout
    got, want = trainer_grad(trainer, batch, "full"), expected_grad(trainer, batch)
    assert_close(got, want)


def test_lora_reference_is_adapter_disabled_base(model_dir, dataset):
    from peft import LoraConfig

    trainer = full_trainer(model_dir, dataset, seed=14, loss_type="dr_grpo",
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  task_type="CAUSAL_LM"))
    assert trainer.ref_model is None
    batch = one_batch(trainer)
    assert_close(trainer_grad(trainer, batch, "full"), expected_grad(trainer, batch))


def test_metrics_and_flag_off_bit_identical(model_dir, dataset):
    trainer = full_trainer(model_dir, dataset, seed=15, loss_type="dapo")
    batch = one_batch(trainer)
    trainer._metrics["train"].clear()
    set_flag(trainer, "full")
    trainer.compute_loss(trainer.model, dict(batch))
    assert trainer._metrics["train"]["kl_adapters/seq_kl"][0] > 0
    # flag off: TRL's own code; the same call with and without the wrappers installed gives the same bits
    native = make_trainer(model_dir, dataset, loss_type="dapo", kl_preset="off", temperature=0.7)
    perturb(native.model, seed=15)
    nbatch = one_batch(native)
    wrapped = flat_grad(native, lambda: native.compute_loss(native.model, dict(nbatch)))
    adapter.unpatch()
    try:
        plain = flat_grad(native, lambda: native.compute_loss(native.model, dict(nbatch)))
    finally:
        adapter.patch("trl.trainer.grpo_trainer")
    assert torch.equal(wrapped, plain)


def test_refusals(model_dir, dataset):
    from kl_adapters import kl_surrogate

    with pytest.raises(ValueError, match="full_kl_surrogate"):
        kl_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), preset="full")
    with pytest.raises(ValueError, match="kl_is_clip"):
        make_trainer(model_dir, dataset, kl_preset="full", kl_is_clip=2.0)


def test_expected_gradient_is_grad_kl_seq_by_enumeration():
    """Every pair of completions of the demo's toy policy (horizon 2: 7 sequences) through TRL's real compute_loss with
    kl_preset="full" (the reference at loss time from the trainer's ref_model): E[g] = grad KL(pi || pi_ref) to
    float32 rounding (kl_adapters/demo/gradient_check.py states the enumeration)."""
    from kl_adapters.demo import gradient_check, trl_runner
    from kl_adapters.demo.problem import ToyProblem, completion_logprobs, enumerated_input_ids

    problem = ToyProblem(horizon=2)
    model, losses, scale = trl_runner.check_losses(problem, ["sequence"])
    trainer = losses["sequence"][0]().trainer

    def full_loss():
        loss = trl_runner.CheckLoss(trainer, "sequence")
        loss.overrides = {"kl_preset": "full"}
        return loss

    with torch.no_grad():
        ref = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
    rows = gradient_check.check(problem, model, ref, {"full": (full_loss, gradient_check.batch_rows("full"))}, scale)
    assert [r.batch_rows for r in rows] == [2, 2]
    for row in rows:
        assert row.relative_bias < 1e-4 and row.cosine > 1 - 1e-6, row
