"""What the reduced presets' statistics are fitted with in GRPOTrainer (issue 20): TRL's advantages, the rows' prompt
groups and the policy's pi(EOS | y_<t), each checked against TRL's real batches and a separate forward.

Pinned here:
1. pi(EOS | y_<t) that the adapter reads from TRL's own policy forward (backbone hook, no logits) equals
   softmax(logits / temperature) summed over the EOS ids of a separate full-logits forward, at loss time (current
   policy) and at generation (the forward that produced old_per_token_logps); the EOS ids are all of TRL's;
2. with two prompt groups in one shuffled micro-batch, the trainer's gradient is TRL's task gradient plus
   kl_surrogate / full_kl_surrogate with task = TRL's advantages (normalized unless scale_rewards="none"),
   group = the rows' prompts and eos by hand, for constant (dapo) and length (grpo) normalisers; and each of the three
   inputs changes that gradient (the identity would notice a missing one);
3. a head that is not hidden @ W.T: a warning, and the presets run without the termination control variate.
"""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import (completion_logits, eos_by_hand, eos_ids_by_hand, flat_grad, groups_by_hand, make_trainer,
                      one_batch, perturb, policy_logps, same_groups, statistics_inputs_by_hand)
from test_full import reference_logits
from test_grpo_gradients import assert_close, trainer_grad

from kl_adapters import full_kl_surrogate, kl_surrogate
from kl_adapters.adapters import trl as adapter
from kl_adapters.adapters.trl import loss as trl_loss
from kl_adapters.adapters.trl import rollout as trl_rollout
from kl_adapters.tiny_models import char_tokenizer, save_tiny_model

#: extra end-of-sequence token in the model's generation config: trl >= 1.14.2 stops at it too
EXTRA_EOS = "."


@pytest.fixture(scope="module")
def two_eos_model_dir(tmp_path_factory):
    """The tiny Llama with generation_config.eos_token_id = [<eos>, EXTRA_EOS] (the tokenizer's eos and one more)."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny_llama_two_eos"))
    config = json.loads((path / "generation_config.json").read_text())
    ids = [char_tokenizer().convert_tokens_to_ids(t) for t in ("<eos>", EXTRA_EOS)]
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": ids}))
    return str(path)


def test_advantages_normalized():
    """TRL divides by a std unless scale_rewards="none" under sum_then_normalize; normalize_then_sum always does."""
    def trainer(scale, aggregation="sum_then_normalize", funcs=1):
        return SimpleNamespace(scale_rewards=scale, multi_objective_aggregation=aggregation, reward_funcs=[0] * funcs)

    assert [adapter.advantages_normalized(trainer(s)) for s in ("group", "batch", "none")] == [True, True, False]
    assert adapter.advantages_normalized(trainer("none", "normalize_then_sum"))
    inputs = {"advantages": torch.ones(3)}
    task = adapter.task_advantages(trainer("none"), inputs, 0.3)
    assert task.beta == 0.3 and task.normalized is False and task.advantages is inputs["advantages"]
    assert adapter.task_advantages(trainer("group", "normalize_then_sum", funcs=1), inputs, 0.3).normalized
    assert adapter.task_advantages(trainer("group", "normalize_then_sum", funcs=2), inputs, 0.3) is None


def test_eos_token_ids_are_all_of_trls(two_eos_model_dir, dataset):
    trainer = make_trainer(two_eos_model_dir, dataset)
    assert list(adapter.eos_token_ids(trainer)) == eos_ids_by_hand(trainer)
    eos, extra = (char_tokenizer().convert_tokens_to_ids(t) for t in ("<eos>", EXTRA_EOS))
    assert eos_ids_by_hand(trainer) in ([eos], sorted([eos, extra]))  # trl 1.14.0 / 1.14.1: the tokenizer's alone


@pytest.fixture(scope="module")
def captured(two_eos_model_dir, dataset):
    """(trainer, batch, what end_of_sequence returned in compute_loss) at temperature 0.7, EOS likelier than at init."""
    trainer = make_trainer(two_eos_model_dir, dataset, temperature=0.7, per_device_train_batch_size=8)
    perturb(trainer.model, seed=21)
    batch = one_batch(trainer)
    seen = []
    real = trl_loss.end_of_sequence
    trl_loss.end_of_sequence = lambda *a: seen.append(real(*a)) or seen[-1]
    try:
        trainer.compute_loss(trainer.model, dict(batch))
    finally:
        trl_loss.end_of_sequence = real
    return trainer, batch, seen[0]


@pytest.mark.compat
def test_eos_probabilities_are_the_policys(captured):
    trainer, batch, eos = captured
    want = eos_by_hand(trainer, batch)
    torch.testing.assert_close(eos.prob, want.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(eos.is_eos, want.is_eos) and eos.is_eos.any()
    assert eos.horizon == trainer.max_completion_length == 8
    assert float(eos.prob[batch["completion_mask"].bool()].max()) > 0.01  # not vanishing (0.03 at TRL 1.14)


@pytest.mark.compat
def test_rollout_eos_probabilities_are_the_sampling_policys(two_eos_model_dir, dataset, monkeypatch):
    """num_iterations = 2: the statistics at generation get pi(EOS) of the forward that made old_per_token_logps."""
    trainer = make_trainer(two_eos_model_dir, dataset, num_iterations=2, temperature=0.7)
    perturb(trainer.model, seed=22)
    seen = []
    real = adapter.rollout_statistics
    monkeypatch.setattr(trl_rollout, "rollout_statistics",
                        lambda tr, batch, preset, eos: seen.append((batch, eos)) or real(tr, batch, preset, eos))
    one_batch(trainer)
    batch, eos = seen[0]
    want = eos_by_hand(trainer, batch)  # the policy has not moved since the rollout
    torch.testing.assert_close(eos.prob, want.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(eos.is_eos, want.is_eos)


def kl_grad(trainer, batch, preset, beta=0.1, **override):
    """grad of kl_surrogate (full_kl_surrogate for `full`, on both models' full logits) with task / group / eos by
    hand, any of them replaced by `override`."""
    mask = batch["completion_mask"]
    beta_seq = beta * mask.shape[0] / adapter.per_token_normaliser(trainer, batch, mask)
    options = {**statistics_inputs_by_hand(trainer, batch, preset, beta), **override}
    if preset == "full":
        ref = reference_logits(trainer, batch)
        return flat_grad(trainer, lambda: full_kl_surrogate(
            completion_logits(trainer.model, batch, trainer.temperature), ref, batch["completion_ids"], mask,
            beta=beta_seq, **options))
    return flat_grad(trainer, lambda: kl_surrogate(policy_logps(trainer, batch), batch["ref_per_token_logps"], mask,
                                                   preset=preset, beta=beta_seq, **options))


@pytest.fixture(scope="module", params=[("dapo", "group"), ("grpo", "none")], ids=["dapo-group", "grpo-none"])
def two_groups(request, model_dir, dataset):
    """One on-policy micro-batch of 8 shuffled rows from 2 prompts x 4 generations."""
    loss_type, scale = request.param
    trainer = make_trainer(model_dir, dataset, loss_type=loss_type, scale_rewards=scale, per_device_train_batch_size=8,
                           temperature=0.7)
    perturb(trainer.model, seed=23)
    batch = one_batch(trainer)
    assert batch.get("old_per_token_logps") is None and same_groups(batch[adapter.GROUP_KEY], groups_by_hand(batch))
    assert not torch.equal(groups_by_hand(batch), groups_by_hand(batch).sort().values)  # TRL shuffled the rows
    return trainer, batch


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "reward", "full"])
def test_gradient_with_task_groups_and_eos(two_groups, preset):
    trainer, batch = two_groups
    got = trainer_grad(trainer, batch, preset)
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    assert_close(got, task + kl_grad(trainer, batch, preset))
    kl_scale = float((got - task).abs().max())
    for missing in ({"task": None}, {"group": None}, {"eos": None}):  # each moves the KL part by 26-155% (measured)
        assert float((got - task - kl_grad(trainer, batch, preset, **missing)).abs().max()) > 0.1 * kl_scale, missing


def test_unsupported_head_runs_without_the_termination_term(model_dir, dataset, caplog):
    """A logit scale TRL's head applies (read from the config) is not hidden @ W.T: warned once, eos left out."""
    trainer = make_trainer(model_dir, dataset)
    perturb(trainer.model, seed=24)
    batch = one_batch(trainer)
    trainer.model.config.logit_scale = 0.5  # after TRL built its head: TRL's logits unchanged, the adapter refuses
    with caplog.at_level(logging.WARNING, logger=adapter.logger.name):
        got = trainer_grad(trainer, batch, "sequence")
        trainer_grad(trainer, batch, "sequence")
    assert sum("termination control variate" in r.message for r in caplog.records) == 1
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    assert_close(got, task + kl_grad(trainer, batch, "sequence", eos=None))
