"""KL budget under TRL's real GRPOTrainer: kl_target / --kl_target / KL_ADAPTERS, one beta update per optimizer step
from the step's sequence-KL estimate, metrics, checkpoint save and resume through train(resume_from_checkpoint=...),
bad input at configuration time, and nothing when no target is set."""

import json
import math
import tempfile

import pytest
import torch
from conftest import grpo_args, logged, make_trainer, replayed_budget, reward_a

import kl_adapters
from kl_adapters.adapters import trl as adapter

TARGET = 0.05


def budget_trainer(model_dir, dataset, **overrides):
    return make_trainer(model_dir, dataset, **{"kl_target": TARGET, "max_steps": 4, **overrides})


@pytest.mark.compat
def test_beta_follows_the_steps_sequence_kl_once_per_optimizer_step(model_dir, dataset):
    """Two micro-batches per optimizer step: the logged beta of step k + 1 is the controller's update of the logged
    beta of step k with that step's kl_adapters/seq_kl (the mean over its micro-batches and processes); the first
    beta is the configured one."""
    trainer = budget_trainer(model_dir, dataset, gradient_accumulation_steps=2)
    trainer.train()
    betas, seq_kl = logged(trainer, "kl_adapters/beta"), logged(trainer, "kl_adapters/seq_kl")
    assert len(betas) == len(seq_kl) == 4 and betas[0] == trainer.args.beta
    assert logged(trainer, "kl_adapters/kl_target") == [TARGET] * 4 and len(logged(trainer, "kl")) == 4
    replay = replayed_budget(betas, seq_kl, TARGET, trainer.args.beta)
    budget = adapter.budget_of(trainer)
    assert budget.steps == 4 and budget.beta == pytest.approx(replay.beta, rel=1e-6)  # the next step's beta
    assert len(set(betas)) == 4  # it moved every step


def test_checkpoint_resume_continues_with_the_same_beta(model_dir, dataset, tmp_path):
    """A real run saving at step 2 of 4; a second trainer resumed from that checkpoint with
    train(resume_from_checkpoint=...) starts from the saved beta (not the configured one) and ends where the
    uninterrupted run ended (TRL restores model, optimizer, RNG and data order, the budget its state)."""
    first = budget_trainer(model_dir, dataset, output_dir=str(tmp_path / "run"), save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    stored = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["KLBudgetCallback"]
    saved = stored["attributes"]["budget_state"]
    assert saved["steps"] == 2 and saved["beta"] != first.args.beta
    assert saved["beta"] == pytest.approx(logged(first, "kl_adapters/beta")[2], rel=1e-6)  # the beta step 3 used

    resumed = budget_trainer(model_dir, dataset, output_dir=str(tmp_path / "resumed"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after = logged(resumed, "kl_adapters/beta")  # the checkpoint's log history (steps 1-2), then steps 3-4
    assert len(after) == 4 and after[2] == pytest.approx(saved["beta"], rel=1e-6)
    end, expected = adapter.budget_of(resumed), adapter.budget_of(first)
    assert end.steps == 4 and end.beta == pytest.approx(expected.beta, rel=1e-5)


def test_trl_parser_flag():
    from trl import TrlParser

    (args,) = TrlParser((adapter.KLGRPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", tempfile.mkdtemp(), "--kl_preset", "sequence", "--kl_target", "0.25", "--beta", "0.1",
         "--use_cpu", "true", "--report_to", "none"])
    assert args.kl_target == 0.25 and adapter.settings_of(args).kl_target == 0.25


def test_environment_variable_route(model_dir, dataset, monkeypatch):
    """KL_ADAPTERS=sequence:kl_target=... with TRL's own GRPOConfig: the same controller."""
    from trl import GRPOConfig

    monkeypatch.delenv("KL_ADAPTERS", raising=False)
    kl_adapters.enable("sequence", kl_target=TARGET)
    try:
        trainer = make_trainer(model_dir, dataset, args=grpo_args(GRPOConfig, max_steps=2))
        trainer.train()
    finally:
        kl_adapters.disable()
    betas = logged(trainer, "kl_adapters/beta")
    assert betas[0] == 0.1 and len(betas) == 2 and adapter.budget_of(trainer).steps == 2


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(kl_target=-0.1), "kl_target must be a finite number > 0"),
    (dict(kl_target=float("nan")), "kl_target must be a finite number > 0"),
    (dict(kl_target=float("inf")), "kl_target must be a finite number > 0"),
    (dict(kl_target=0.5, kl_preset="off"), "needs a KL term"),
    (dict(kl_target=0.5, kl_preset=None), "needs a KL term"),
    (dict(kl_target=0.5, kl_preset="token"), "does not follow its gradient"),
    (dict(kl_target=0.5, kl_preset="k3-loss"), "does not follow its gradient"),
    (dict(kl_target=0.5, kl_preset="reward", num_iterations=2), "off-policy"),
    (dict(kl_target=0.5, kl_is_clip=3.0), "is_clip"),
    (dict(kl_target=0.5, kl_preset="sequence:is_clip=3"), "is_clip"),  # the value's is_clip is not dropped
    (dict(kl_target=0.5, kl_preset="sequence:kl_target=0.2"), "two KL budgets"),
])
def test_bad_budgets_are_refused_at_configuration(overrides, message, monkeypatch):
    monkeypatch.delenv("KL_ADAPTERS", raising=False)
    with pytest.raises(ValueError, match=message):
        grpo_args(**overrides)


def test_bad_budget_through_the_environment_is_refused_at_trainer_construction(model_dir, dataset, monkeypatch):
    from trl import GRPOConfig

    monkeypatch.delenv("KL_ADAPTERS", raising=False)
    kl_adapters.enable("reward", kl_target=0.5)
    try:
        with pytest.raises(ValueError, match="off-policy"):
            make_trainer(model_dir, dataset, args=grpo_args(GRPOConfig, num_iterations=2))
    finally:
        kl_adapters.disable()


@pytest.mark.parametrize("route", ["field", "KL_ADAPTERS"])
def test_budget_with_trls_default_beta_starts_at_the_start_beta(model_dir, dataset, monkeypatch, route):
    """A target with TRL's default beta = 0 (no KL term, no reference model): beta is only the controller's start,
    so the config starts it at BUDGET_START_BETA before GRPOTrainer decides whether to build a reference model; a real
    GRPOTrainer then has its reference and the budget moves beta from there."""
    from trl import GRPOConfig

    monkeypatch.delenv("KL_ADAPTERS", raising=False)
    if route == "field":
        args = grpo_args(beta=0.0, kl_target=0.5, max_steps=2)  # KLGRPOConfig(kl_preset="sequence", ...)
    else:
        kl_adapters.enable("sequence", kl_target=0.5)
        args = grpo_args(GRPOConfig, beta=0.0, max_steps=2)
    try:
        trainer = make_trainer(model_dir, dataset, args=args)
        assert args.beta == trainer.beta == adapter.BUDGET_START_BETA == 0.04 and trainer.ref_model is not None
        trainer.train()
    finally:
        kl_adapters.disable()
    betas = logged(trainer, "kl_adapters/beta")
    assert betas[0] == 0.04 and len(betas) == 2 and betas[1] != 0.04


@pytest.mark.compat
def test_without_a_target_there_is_no_budget(model_dir, dataset):
    """No kl_target: no callback, no kl_adapters/beta metric, beta fixed. And the budget acts only through beta: a
    budget whose beta never moves (gains 0) trains bit-identically to no budget."""
    plain = make_trainer(model_dir, dataset, max_steps=3)
    plain.train()
    assert adapter.budget_of(plain) is None and plain.beta == plain.args.beta
    assert not logged(plain, "kl_adapters/beta") and not logged(plain, "kl_adapters/kl_target")
    frozen = budget_trainer(model_dir, dataset, max_steps=3)
    frozen_budget = adapter.budget_of(frozen)
    frozen_budget.gains = {"k_i": 0.0, "k_p": 0.0}
    frozen.train()
    assert frozen_budget.steps == 3 and frozen.beta == plain.beta
    for a, b in zip(plain.model.parameters(), frozen.model.parameters()):
        assert torch.equal(a, b)
    keys = ("loss", "kl", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap")
    assert [[r.get(k) for k in keys] for r in plain.state.log_history] == \
        [[r.get(k) for k in keys] for r in frozen.state.log_history]


def test_rloo_refuses_a_budget(model_dir, dataset, monkeypatch):
    from trl import RLOOConfig, RLOOTrainer

    from kl_adapters.adapters._guard import UnsupportedFrameworkError

    monkeypatch.delenv("KL_ADAPTERS", raising=False)
    kl_adapters.enable("reward", kl_target=0.5)
    try:
        args = RLOOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=8, beta=0.1, report_to="none", bf16=False)
        with pytest.raises(UnsupportedFrameworkError, match="KL budget"):
            RLOOTrainer(model=model_dir, reward_funcs=reward_a, args=args, train_dataset=dataset)
    finally:
        kl_adapters.disable()


def test_budget_state_json_is_what_the_checkpoint_holds(model_dir, dataset):
    trainer = budget_trainer(model_dir, dataset, max_steps=1)
    trainer.train()
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, adapter.KLBudgetCallback)]
    state = json.loads(json.dumps(callback.state()))
    clone = adapter.KLBudgetCallback(**state["args"])  # how transformers rebuilds a callback
    clone.budget_state = state["attributes"]["budget_state"]
    assert clone.budget.state_dict() == callback.budget.state_dict() and math.isfinite(clone.budget.beta)
