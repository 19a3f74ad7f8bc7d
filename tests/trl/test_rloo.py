"""RLOOTrainer is already exact on-policy: k1 summed into the sequence reward with a leave-one-out baseline.

Two facts pinned here:
1. The real RLOOTrainer's advantage contains exactly -beta * (S_i - mean_{j != i} S_j), S = sum_t k1_t on the rollout
   log-probs (= kl_adapters.kl_reward summed), so its KL gradient is the `reward-sum` configuration plus a
   leave-one-out baseline.
2. That configuration's expected gradient is exactly beta * grad KL_seq: exact enumeration over every group of G
   sequences of a tabular policy (the baseline only adds zero-mean noise).
With the flag active, RLOO off-policy or with normalize_advantages (where it is biased) raises instead of silently
ignoring the flag; on-policy it is left bit-identical.
"""

import itertools
import tempfile

import pytest
import torch
from conftest import perturb

from kl_adapters import activation, kl_reward
from kl_adapters.adapters import _guard
from kl_adapters.audit import kl_seq, random_policies, relative_error, token_logps


def rloo(model_dir, dataset, **overrides):
    from trl import RLOOConfig, RLOOTrainer

    kwargs = dict(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=8, beta=0.1, max_steps=1, report_to="none",
                  save_strategy="no", seed=0, gradient_checkpointing=False)
    kwargs.update(overrides)
    return RLOOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                       args=RLOOConfig(**kwargs), train_dataset=dataset)


def test_rloo_advantage_is_loo_baselined_k1_sum(model_dir, dataset):
    trainer = rloo(model_dir, dataset)
    perturb(trainer.model, seed=1)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        k = batch["completion_ids"].size(1)
        logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k)[0]
        ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, am, k)[0]
    reward = kl_reward(logp, ref, batch["completion_mask"], beta=0.1).sum(-1)  # -beta * S (task reward is 0)
    group = reward.view(-1, 4)
    baseline = (group.sum(1, keepdim=True) - group) / 3
    assert torch.allclose(batch["advantages"], (group - baseline).view(-1), atol=1e-6)
    assert float(reward.abs().max()) > 1e-4


@pytest.mark.parametrize("group", [2, 3])
def test_loo_baselined_sequence_kl_reward_is_exact(group):
    """E over groups y_1..y_G ~ pi of sum_i A_i grad log pi(y_i) / G, A_i = -(S_i - mean_{j!=i} S_j), equals
    -grad KL_seq exactly (float64, every G-tuple of a V=3, T=3 tabular policy)."""
    pol = random_policies(3, 3, seed=group)
    theta = pol.logits.clone().requires_grad_(True)
    lp = token_logps(pol.space, theta)
    ref = token_logps(pol.space, pol.ref_logits)
    seq_lp = lp.sum(-1)
    s = (lp - ref).detach().sum(-1)
    q = seq_lp.detach().exp()
    surrogate = torch.zeros((), dtype=torch.float64)
    for idx in itertools.product(range(pol.space.num_sequences), repeat=group):
        i = torch.tensor(idx)
        adv = -(s[i] - (s[i].sum() - s[i]) / (group - 1))
        surrogate = surrogate + q[i].prod() * (adv * seq_lp[i]).sum() / group
    (g,) = torch.autograd.grad(-surrogate, theta)
    (exact,) = torch.autograd.grad(kl_seq(pol.space, theta, pol.ref_logits), theta)
    assert relative_error(g, exact) < 1e-9


@pytest.mark.parametrize("overrides", [dict(num_iterations=2), dict(normalize_advantages=True)])
def test_active_flag_refuses_biased_rloo(model_dir, dataset, overrides):
    activation.enable("sequence")
    try:
        with pytest.raises(_guard.UnsupportedFrameworkError, match="RLOOTrainer"):
            rloo(model_dir, dataset, **overrides)
    finally:
        activation.disable()


def test_active_flag_leaves_on_policy_rloo_unchanged(model_dir, dataset):
    activation.enable("sequence")
    try:
        trainer = rloo(model_dir, dataset)
        trainer.train()
        assert not any(k.startswith("kl_adapters") for r in trainer.state.log_history for k in r)
    finally:
        activation.disable()
