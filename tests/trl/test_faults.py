"""What the TRL adapter does with what real runs produce (issue 25), through GRPOTrainer's real compute_loss / train():

- an empty micro-batch (B = 0): TRL's own forward refuses it (ValueError from its batching) with the flag on as off,
  so no empty micro-batch reaches a KL term; TRL splits each generation batch evenly and never makes one;
- all-masked micro-batches and rows: loss 0 / the exact identity on the remaining rows, finite gradient, and the
  kl / kl_adapters/* metrics finite (no 0/0);
- non-finite numbers: a -inf reference log-prob or a NaN logit at a real token is refused with a one-line ValueError
  naming the tensor before any backward pass or optimizer step (TRL's own loss goes on with inf / NaN); -inf at
  padding is ignored; importance weights that would overflow after off-policy steps are capped by the core
  (finite loss, gradient and is_ess);
- two trainers in one process with different presets (kl_preset on each KLGRPOConfig) work independently: each one's
  gradient is its own preset's;
- a run stopped and resumed with train(resume_from_checkpoint=...) continues with the same preset (its kl_adapters/*
  metrics and final weights are the uninterrupted run's); the KL budget's beta across a resume is pinned by
  tests/trl/test_budget.py::test_checkpoint_resume_continues_with_the_same_beta.
"""

import math

import pytest
import torch
from conftest import make_trainer, one_batch, perturb, policy_logps
from test_grpo_gradients import assert_close, expected_grad

METRICS = ("kl", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap", "kl_adapters/is_ess")


@pytest.fixture(scope="module")
def setup(model_dir, dataset):
    trainer = make_trainer(model_dir, dataset)
    perturb(trainer.model, seed=1)
    return trainer, one_batch(trainer)


def rows(batch, index):
    """The micro-batch of `batch`'s rows `index`, as TRL's split_tensor_dict slices it (per-row tensors only)."""
    size = batch["completion_ids"].shape[0]
    return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size else v for k, v in batch.items()}


def loss_and_grad(trainer, batch, preset):
    """compute_loss and its parameter gradient with kl_preset=preset and beta 0.1 (expected_grad leaves beta 0);
    also the micro-batch's logged metrics."""
    trainer.args.kl_preset, trainer.beta = preset, 0.1
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("preset", ["off", "sequence"])
def test_empty_micro_batch_is_refused_by_trl_itself(setup, preset):
    trainer, batch = setup
    trainer.args.kl_preset = preset
    with pytest.raises(ValueError, match="range"):  # TRL's chunked forward: range(0, 0, batch_size=0)
        trainer.compute_loss(trainer.model, rows(batch, slice(0, 0)))


@pytest.mark.parametrize("preset", ["sequence", "token", "full"])
def test_all_masked_micro_batch(setup, preset):
    trainer, batch = setup
    masked = {**batch, "completion_mask": torch.zeros_like(batch["completion_mask"])}
    loss, grads, metrics = loss_and_grad(trainer, masked, preset)
    assert loss.item() == 0.0 and all(torch.isfinite(g).all() for g in grads)
    logged = {k: metrics[k] for k in METRICS if k in metrics}
    assert logged["kl"] == [0.0] and logged["kl_adapters/seq_kl"] == [0.0]
    assert all(math.isfinite(v) for values in logged.values() for v in values)


@pytest.mark.parametrize("preset", ["sequence", "reward"])
def test_masked_rows_keep_the_identity(setup, preset):
    """Two of four rows all-masked (truncated to nothing): the trainer's gradient is still task + kl_surrogate with
    the leave-one-out statistics of the rows' prompt group."""
    trainer, batch = setup
    mask = batch["completion_mask"].clone()
    mask[:2] = 0
    masked = {**batch, "completion_mask": mask}
    _, grads, _ = loss_and_grad(trainer, masked, preset)
    assert_close(torch.cat([g.flatten() for g in grads]), expected_grad(trainer, masked, preset))


def test_minus_infinity_reference_log_prob_at_a_real_token_is_refused(setup):
    trainer, batch = setup
    ref = batch["ref_per_token_logps"].clone()
    ref[0, 0] = -math.inf  # a token the reference forbids: KL(pi || pi_ref) is infinite
    bad = {**batch, "ref_per_token_logps": ref}
    native, _, _ = loss_and_grad(trainer, bad, "off")
    assert not torch.isfinite(native)  # TRL's own k3 term goes on with inf
    with pytest.raises(ValueError, match="ref_logp has non-finite values"):
        loss_and_grad(trainer, bad, "sequence")


def test_minus_infinity_at_padding_is_ignored(setup):
    trainer, batch = setup
    mask = batch["completion_mask"].clone()
    mask[0, -1] = 0
    ref = batch["ref_per_token_logps"].clone()
    ref[0, -1] = -math.inf
    clean, _, _ = loss_and_grad(trainer, {**batch, "completion_mask": mask}, "sequence")
    padded, grads, _ = loss_and_grad(trainer, {**batch, "completion_mask": mask, "ref_per_token_logps": ref},
                                     "sequence")
    assert padded == clean and all(torch.isfinite(g).all() for g in grads)


def test_nan_logit_is_refused_before_any_update(setup):
    """A NaN in the policy's logits (an overflowing bf16 activation, a corrupted weight): TRL's own loss is NaN and
    an optimizer step would write NaN into every weight; the flag raises first."""
    trainer, batch = setup
    head = trainer.model.get_output_embeddings().weight
    saved = head.detach().clone()
    with torch.no_grad():
        head[5] = math.nan
    try:
        native, _, _ = loss_and_grad(trainer, batch, "off")
        assert torch.isnan(native)
        with pytest.raises(ValueError, match="logp has non-finite values"):
            loss_and_grad(trainer, batch, "sequence")
    finally:
        with torch.no_grad():
            head.copy_(saved)


@pytest.mark.parametrize("preset", ["sequence", "reward", "token"])
def test_overflowing_importance_weights_stay_finite(setup, preset):
    """old log-probs 20 nats per token below the policy's (a batch many optimizer steps old): the sequence weights
    w_{1:t} reach e^160, past float32's range; the core caps them, so loss, gradient and is_ess stay finite."""
    trainer, batch = setup
    with torch.no_grad():
        old = policy_logps(trainer, batch) - 20.0
    loss, grads, metrics = loss_and_grad(trainer, {**batch, "old_per_token_logps": old}, preset)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert all(math.isfinite(v) for k in METRICS for v in metrics[k])
    assert 0.0 < metrics["kl_adapters/is_ess"][0] <= 1.0


def test_two_trainers_with_different_presets_are_independent(model_dir, dataset):
    """Two GRPOTrainers alive in one process, kl_preset "sequence" and "token": calls interleaved, each trainer's
    gradient is task + kl_surrogate of its own preset."""
    first, second = make_trainer(model_dir, dataset), make_trainer(model_dir, dataset, kl_preset="token")
    for trainer in (first, second):
        perturb(trainer.model, seed=1)
    batch = one_batch(first)
    grads = {}
    for trainer, preset in ((first, "sequence"), (second, "token"), (first, "sequence")):
        assert trainer.args.kl_preset == preset
        _, g, _ = loss_and_grad(trainer, batch, preset)
        grads.setdefault(preset, []).append(torch.cat([x.flatten() for x in g]))
    assert torch.equal(*grads["sequence"])  # the second trainer changed nothing of the first's
    for trainer, preset in ((first, "sequence"), (second, "token")):
        assert_close(grads[preset][0], expected_grad(trainer, batch, preset))
        trainer.args.kl_preset = preset  # expected_grad sets it
    assert not torch.allclose(grads["sequence"][0], grads["token"][0])


def test_resume_continues_with_the_same_preset(model_dir, dataset, tmp_path):
    """kl_preset "reward", 4 steps saving at step 2; a new trainer resumed from checkpoint-2 logs the same
    kl_adapters/* metrics at steps 3-4 (grad_weight_gap depends on the preset) and ends at the same weights."""
    def run(output, **overrides):
        return make_trainer(model_dir, dataset, kl_preset="reward", max_steps=4, output_dir=str(tmp_path / output),
                            **overrides)

    first = run("run", save_strategy="steps", save_steps=2)
    first.train()
    resumed = run("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for key in METRICS:
        logged = [[r[key] for r in t.state.log_history if key in r][2:] for t in (first, resumed)]
        assert len(logged[0]) == 2 and logged[1] == pytest.approx(logged[0], rel=1e-5, abs=1e-7)
    for a, b in zip(first.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
