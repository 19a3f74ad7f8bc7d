"""Rollout-time statistics of the variance-reduced presets in GRPOTrainer (issue 11, item 2).

Pinned here, on real TRL batches:
1. where TRL has the policy's log-probs of the whole generation batch at rollout time (num_iterations = 2: old log-probs),
   the batch carries kl_statistics(old, ref, mask, group = prompt ids, task = TRL's advantages, eos = the rollout
   policy's pi(EOS)) of the WHOLE generation batch, and TRL's own shuffle + split into micro-batches keeps each row's
   statistics (and prompt-group id) with the row;
2. the trainer's gradient on such a micro-batch is the task gradient plus the gradient of
   kl_surrogate(..., statistics = those rows' statistics, eos = the current policy's pi(EOS)) -- not of the
   micro-batch's own leave-one-out statistics;
3. without rollout log-probs (TRL's on-policy default) the batch carries none and the loss uses the micro-batch's rows;
4. flag off: the generation batch is TRL's, key for key.
Units: which rollout log-probs are used (old, vLLM's, NaN handling) and the GRPO group ids of a process's slice.
"""

import pytest
import torch
from conftest import (eos_by_hand, flat_grad, groups_by_hand, make_trainer, perturb, policy_logps, same_groups,
                      statistics_inputs_by_hand)
from test_grpo_gradients import assert_close, trainer_grad

from kl_adapters import TaskAdvantages, kl_statistics, kl_surrogate
from kl_adapters.adapters import trl as adapter

KEYS = (*adapter.ROLLOUT_STATISTICS_KEYS.values(), adapter.GROUP_KEY)


def generation_and_micro_batches(trainer):
    """(the whole generation batch as _generate_and_score_completions returned it, TRL's buffered micro-batches)."""
    seen = []
    real = type(trainer)._generate_and_score_completions

    def spy(batch):
        seen.append(real(trainer, batch))
        return seen[-1]

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer._generate_and_score_completions = spy
    try:
        torch.manual_seed(0)
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    finally:
        del trainer._generate_and_score_completions
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in seen[0].items()}, trainer._buffered_inputs


@pytest.fixture(scope="module")
def off_policy(model_dir, dataset):
    """num_iterations=2, gradient accumulation 2: TRL computes old log-probs of the 16-row generation batch (4 prompts
    x 4 generations) and trains on shuffled micro-batches of 8 rows."""
    trainer = make_trainer(model_dir, dataset, num_iterations=2, gradient_accumulation_steps=2,
                           per_device_train_batch_size=8)
    perturb(trainer.model, seed=11)
    whole, micro = generation_and_micro_batches(trainer)
    return trainer, whole, micro


@pytest.mark.compat
def test_statistics_are_leave_one_out_over_the_whole_generation_batch(off_policy):
    trainer, whole, micro = off_policy
    assert whole["old_per_token_logps"] is not None and len(micro) == 2
    assert same_groups(whole[adapter.GROUP_KEY], groups_by_hand(whole)) and whole[adapter.GROUP_KEY].max() == 3
    eos = eos_by_hand(trainer, whole)  # the policy has not moved since the rollout
    assert eos.is_eos.any()
    expected = kl_statistics(whole["old_per_token_logps"], whole["ref_per_token_logps"], whole["completion_mask"],
                             group=groups_by_hand(whole), task=TaskAdvantages(whole["advantages"], 0.1, True), eos=eos)
    for field, key in adapter.ROLLOUT_STATISTICS_KEYS.items():
        torch.testing.assert_close(whole[key], getattr(expected, field), rtol=1e-4, atol=1e-6)
    for field in ("baseline", "eos_coef", "past_coef"):  # real statistics from the others, the EOS term included
        assert float(whole[adapter.ROLLOUT_STATISTICS_KEYS[field]].abs().max()) > 0, field


@pytest.mark.compat
def test_statistics_survive_trl_shuffle_and_split(off_policy):
    _, whole, micro = off_policy
    rows = torch.cat([whole["prompt_ids"], whole["completion_ids"]], 1)
    for batch in micro:
        assert batch[KEYS[0]].shape[0] == 8
        own = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        for i in range(own.shape[0]):
            (j,) = [j for j in range(rows.shape[0]) if torch.equal(rows[j], own[i])
                    and torch.equal(whole["advantages"][j], batch["advantages"][i])][:1]
            for key in KEYS:
                assert torch.equal(batch[key][i], whole[key][j])
    shuffled = torch.cat([b["completion_ids"] for b in micro])
    assert not torch.equal(shuffled, whole["completion_ids"])  # TRL did permute the rows


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "reward"])
def test_gradient_uses_the_rows_rollout_statistics(off_policy, preset):
    """grad = task + grad kl_surrogate(..., statistics = the micro-batch rows' stored statistics, eos = the current
    policy's), and that differs from the micro-batch's own leave-one-out statistics (so the stored ones are what the
    loss used)."""
    trainer, _, micro = off_policy
    batch = micro[0]
    mask = batch["completion_mask"]
    beta_seq = 0.1 * mask.shape[0] / adapter.per_token_normaliser(trainer, batch, mask)
    old = adapter.behaviour_logps(batch, batch["ref_per_token_logps"])

    def kl_grad(**stats):
        return flat_grad(trainer, lambda: kl_surrogate(policy_logps(trainer, batch), batch["ref_per_token_logps"],
                                                       mask, preset=preset, beta=beta_seq, old_logp=old, **stats))

    got = trainer_grad(trainer, batch, preset)
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    assert_close(got, task + kl_grad(statistics=adapter.statistics_of(batch), eos=eos_by_hand(trainer, batch)))
    own = kl_grad(**statistics_inputs_by_hand(trainer, batch, preset, 0.1))
    assert float((got - task - own).abs().max()) > 1e-3 * float(got.abs().max())


def test_on_policy_default_stores_nothing_and_uses_the_micro_batch(model_dir, dataset):
    trainer = make_trainer(model_dir, dataset)
    perturb(trainer.model, seed=12)
    whole, micro = generation_and_micro_batches(trainer)
    assert "old_per_token_logps" not in whole and not any(k in whole for k in KEYS[:-1])
    batch = micro[0]
    assert adapter.statistics_of(batch) is None  # the loss computes leave-one-out over the micro-batch's rows
    assert same_groups(batch[adapter.GROUP_KEY], groups_by_hand(batch))  # ... within its prompt groups


@pytest.mark.compat
def test_flag_off_generation_batch_is_trls(model_dir, dataset):
    """kl_preset off: the wrapped _generate_and_score_completions returns TRL's batch, bit for bit."""
    outputs = []
    for patched in (False, True):
        adapter.unpatch() if not patched else adapter.patch("trl.trainer.grpo_trainer")
        trainer = make_trainer(model_dir, dataset, kl_preset=None, num_iterations=2)
        outputs.append(generation_and_micro_batches(trainer)[0])
    assert outputs[0].keys() == outputs[1].keys()
    for key, value in outputs[0].items():
        assert torch.equal(value, outputs[1][key]) if torch.is_tensor(value) else value == outputs[1][key]


def test_rollout_logps_sources():
    """Old log-probs; vLLM's where it scored the token (NaN -> old); vLLM's alone with unscored tokens masked out."""
    mask = torch.ones(2, 3)
    old, sampling = torch.full((2, 3), -1.0), torch.full((2, 3), -2.0)
    sampling[0, 1] = float("nan")
    assert adapter.rollout_logps({"completion_mask": mask}) is None
    logp, m = adapter.rollout_logps({"completion_mask": mask, "old_per_token_logps": old})
    assert torch.equal(logp, old) and torch.equal(m, mask)
    logp, m = adapter.rollout_logps({"completion_mask": mask, "old_per_token_logps": old,
                                     "sampling_per_token_logps": sampling})
    assert logp[0, 1] == -1.0 and logp[1, 1] == -2.0 and torch.equal(m, mask)
    logp, m = adapter.rollout_logps({"completion_mask": mask, "sampling_per_token_logps": sampling})
    assert m[0, 1] == 0 and m.sum() == 5 and torch.isfinite(logp).all()


def test_group_ids_follow_the_process_slice():
    """Process 1 of a 2-process run holds global rows 6..11; with num_generations 4 they are prompts 1, 1, 2, 2, 2, 2."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(num_generations=4, num_generations_eval=2, model=SimpleNamespace(training=True),
                              accelerator=SimpleNamespace(process_index=1))
    assert adapter.group_ids(trainer, 6).tolist() == [1, 1, 2, 2, 2, 2]
    trainer.model.training = False
    assert adapter.group_ids(trainer, 6).tolist() == [3, 3, 4, 4, 5, 5]
