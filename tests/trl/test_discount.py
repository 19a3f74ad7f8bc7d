"""The bias-variance dial in TRL's idiom (issue 22): KLGRPOConfig(kl_discount=gamma) / --kl_discount.

Identity pinned (on-policy micro-batch statistics, and rollout-time statistics with num_iterations = 2):
    grad[trainer loss, kl_preset, kl_discount = gamma]  ==  grad[trainer loss, beta = 0]
        + grad kl_surrogate(logp, ref, mask, preset, beta * B / D, old_logp, task, group, eos, discount=gamma)
kl_discount = 1 is the unset field bit for bit; bad values, presets without a future-KL return and a kl_discount
without kl_preset are refused at configuration.
"""

import tempfile

import pytest
import torch
from conftest import (eos_by_hand, flat_grad, groups_by_hand, grpo_args, make_trainer, one_batch, perturb, policy_logps,
                      statistics_inputs_by_hand)
from test_grpo_gradients import assert_close, trainer_grad
from test_statistics import generation_and_micro_batches

from kl_adapters import TaskAdvantages, kl_statistics, kl_surrogate
from kl_adapters.adapters import trl as adapter

GAMMA = 0.6  # far from 1 at max_completion_length 8, so that the discount visibly moves the gradient


@pytest.fixture(scope="module")
def on_policy(model_dir, dataset):
    trainer = make_trainer(model_dir, dataset, loss_type="dr_grpo")
    perturb(trainer.model, seed=1)
    return trainer, one_batch(trainer)


def discounted_grad(trainer, batch, preset, discount, beta=0.1):
    trainer.args.kl_discount = discount
    try:
        return trainer_grad(trainer, batch, preset, beta)
    finally:
        trainer.args.kl_discount = None


def expected_grad(trainer, batch, preset, discount, beta=0.1):
    """grad(task loss, beta = 0) + grad(kl_surrogate(..., discount=discount), task / group / eos by hand)."""
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    mask = batch["completion_mask"]
    beta_seq = beta * mask.shape[0] / adapter.per_token_normaliser(trainer, batch, mask)
    options = statistics_inputs_by_hand(trainer, batch, preset, beta)
    return task + flat_grad(trainer, lambda: kl_surrogate(
        policy_logps(trainer, batch), batch["ref_per_token_logps"], mask, preset=preset, beta=beta_seq,
        old_logp=adapter.behaviour_logps(batch, batch["ref_per_token_logps"]), discount=discount, **options))


@pytest.mark.parametrize("preset", ["sequence", "sequence-plain", "reward"])
def test_trainer_gradient_is_the_discounted_surrogate(on_policy, preset):
    trainer, batch = on_policy
    got = discounted_grad(trainer, batch, preset, GAMMA)
    assert_close(got, expected_grad(trainer, batch, preset, GAMMA))
    exact = discounted_grad(trainer, batch, preset, None)
    assert float((got - exact).norm() / exact.norm()) > 1e-3  # the dial moves the gradient


def test_discount_one_is_the_unset_field_bit_for_bit(on_policy):
    trainer, batch = on_policy
    exact = discounted_grad(trainer, batch, "sequence", None)
    assert torch.equal(discounted_grad(trainer, batch, "sequence", 1.0), exact)


def test_rollout_statistics_are_discounted(model_dir, dataset):
    """num_iterations = 2: the statistics stored at rollout are kl_statistics(..., discount=gamma) of the batch."""
    trainer = make_trainer(model_dir, dataset, num_iterations=2, gradient_accumulation_steps=2,
                           per_device_train_batch_size=8, kl_discount=GAMMA)
    perturb(trainer.model, seed=11)
    whole, _ = generation_and_micro_batches(trainer)
    mask = whole["completion_mask"]
    logp, ref = whole["old_per_token_logps"], whole["ref_per_token_logps"]
    group, eos = groups_by_hand(whole), eos_by_hand(trainer, whole)  # the policy has not moved since the rollout
    task = TaskAdvantages(whole["advantages"], 0.1, True)
    for discount in (GAMMA, 1.0):
        expected = kl_statistics(logp, ref, mask, group=group, preset="sequence", task=task, eos=eos,
                                 discount=discount)
        match = all(torch.allclose(whole[key], getattr(expected, field), rtol=1e-4, atol=1e-6)
                    for field, key in adapter.ROLLOUT_STATISTICS_KEYS.items())
        assert match == (discount == GAMMA), discount


@pytest.mark.parametrize("fields, message", [
    (dict(kl_preset=None, kl_discount=0.9), "kl_discount=0.9: kl_is_clip and kl_discount need kl_preset"),
    (dict(kl_preset="off", kl_discount=0.9), "kl_discount=0.9: kl_is_clip and kl_discount need kl_preset"),
    (dict(kl_preset="token", kl_discount=0.9), "no future-KL return to discount"),
    (dict(kl_preset="k3-loss", kl_discount=0.99), "no future-KL return to discount"),
    (dict(kl_discount=0.0), r"discount must be a number in \(0, 1\]"),
    (dict(kl_discount=1.5), r"discount must be a number in \(0, 1\]"),
    (dict(kl_discount=float("nan")), r"discount must be a number in \(0, 1\]"),
])
def test_bad_discounts_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        grpo_args(**fields)


def test_trl_parser_flag():
    from trl import TrlParser

    (args,) = TrlParser((adapter.KLGRPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", tempfile.mkdtemp(), "--kl_preset", "sequence", "--kl_discount", "0.99", "--beta", "0.1",
         "--use_cpu", "true", "--report_to", "none"])
    assert args.kl_discount == 0.99 and adapter.discount_of(args) == 0.99
    assert grpo_args(kl_preset="token", kl_discount=1.0).kl_discount == 1.0  # gamma = 1 is exact for every preset


def test_doctor_reports_the_dials_exact_bias():
    """`kl-adapters doctor trl ... --kl_discount gamma`: the audit's exact relative bias of the discounted return (a
    bias hazard, exit 1); gamma = 1 is unbiased; what KLGRPOConfig refuses is the verdict refused (exit 3)."""
    from kl_adapters.audit import audit
    from kl_adapters.doctor import diagnose
    from kl_adapters.doctor.report import AUDIT_ARGS

    def hazards(*flags):
        report = diagnose("trl", ["--beta", "0.04", *flags])
        return report, {h.code: h.message for h in report.hazards}

    report, found = hazards("--kl_preset", "sequence", "--kl_discount", "0.9")
    (row,) = [r for r in audit(*AUDIT_ARGS, presets=("sequence",), is_clip=None, discount=0.9)
              if r.discount == 0.9 and r.regime == "on-policy"]
    assert report.exit_code == 1 and f"exact relative bias {row.relative_bias:.2%}" in found["discounted"]
    report, found = hazards("--kl_preset", "sequence", "--kl_discount", "1")
    assert report.verdict == "unbiased" and not found
    for flags, message in [(("--kl_discount", "0.9"), "need kl_preset"),
                           (("--kl_preset", "token", "--kl_discount", "0.9"), "no future-KL return"),
                           (("--kl_preset", "sequence", "--kl_discount", "2"), "discount must be")]:
        report, found = hazards(*flags)
        assert report.verdict == "refused" and report.exit_code == 3 and message in found["refused"], flags
