"""GRPOTrainer with kl-adapters: the trainer's gradient is TRL's task gradient plus the gradient of kl_surrogate.

Identity pinned (every loss_type, on- and off-policy, LoRA, vLLM importance sampling, GMPO):
    grad[trainer loss, flag on, beta]  ==  grad[trainer loss, beta = 0]
                                           + grad kl_surrogate(logp, ref, mask, preset, beta * B / D, old_logp,
                                                               task, group, eos)
with D TRL's per-token normaliser of the policy loss (kl_adapters.adapters.trl.per_token_normaliser) and, for the
presets with batch statistics, task / group / eos computed by hand from the batch (conftest.statistics_inputs_by_hand:
TRL's advantages and beta, the rows' prompts, pi(EOS) from a separate full-logits forward). That D is TRL's own is
pinned independently: preset "token" reproduces TRL's native KL gradient (use_bias_correction_kl=True) exactly.
"""

import pytest
import torch
from conftest import flat_grad, make_trainer, one_batch, perturb, policy_logps, statistics_inputs_by_hand

from kl_adapters import kl_surrogate
from kl_adapters.adapters import trl as adapter

LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
CONSTANT_NORMALISER = ["dapo", "bnpo", "dr_grpo", "cispo", "luspo", "vespo"]


def set_flag(trainer, preset, beta=0.1):
    trainer.args.kl_preset = preset
    trainer.beta = beta


def trainer_grad(trainer, batch, preset, beta=0.1):
    set_flag(trainer, preset, beta)
    return flat_grad(trainer, lambda: trainer.compute_loss(trainer.model, dict(batch)))


def expected_grad(trainer, batch, preset, beta=0.1):
    """grad(task loss, beta = 0) + grad(kl_surrogate on the same tensors, with task / group / eos by hand)."""
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    mask = batch["completion_mask"]
    old = adapter.behaviour_logps(batch, batch["ref_per_token_logps"])
    beta_seq = beta * mask.shape[0] / adapter.per_token_normaliser(trainer, batch, mask)
    options = statistics_inputs_by_hand(trainer, batch, preset, beta)
    kl = flat_grad(trainer, lambda: kl_surrogate(policy_logps(trainer, batch), batch["ref_per_token_logps"], mask,
                                                 preset=preset, beta=beta_seq, old_logp=old, **options))
    return task + kl


def assert_close(a, b, rtol=1e-5):
    """max |a - b| / max |b| < rtol (float32 rounding of a tiny model's gradient is ~1e-7 of its scale)."""
    scale = float(b.abs().max())
    assert scale > 0
    assert float((a - b).abs().max()) / scale < rtol


@pytest.fixture(scope="module", params=LOSS_TYPES)
def setup(request, model_dir, dataset):
    """(trainer, on-policy batch, off-policy batch) for one loss_type; the policy moves between the two batches."""
    trainer = make_trainer(model_dir, dataset, loss_type=request.param)
    perturb(trainer.model, seed=1)
    batch = one_batch(trainer)
    assert batch.get("old_per_token_logps") is None  # TRL treats this batch as on-policy
    off = dict(batch)
    with torch.no_grad():
        off["old_per_token_logps"] = policy_logps(trainer, batch)  # what TRL stores when num_iterations > 1
    return trainer, batch, off


def _policy_moved(trainer, fn):
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    perturb(trainer.model, scale=0.2, seed=2)
    try:
        return fn()
    finally:
        trainer.model.load_state_dict(state)


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "reward", "token", "k3-loss"])
def test_on_policy_gradient_is_task_plus_kl_surrogate(setup, preset):
    trainer, batch, _ = setup
    assert_close(trainer_grad(trainer, batch, preset), expected_grad(trainer, batch, preset))


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "reward", "token"])
def test_off_policy_gradient_uses_rollout_logps(setup, preset):
    trainer, _, off = setup
    _policy_moved(trainer, lambda: assert_close(trainer_grad(trainer, off, preset), expected_grad(trainer, off, preset)))


@pytest.mark.compat
@pytest.mark.parametrize("setup", CONSTANT_NORMALISER, indirect=True)
@pytest.mark.parametrize("policy", ["on", "off"])
def test_token_preset_is_native_trl(setup, policy):
    """TRL 1.16's default KL term (k3 * pi/pi_old, token-level IS) has exactly the `token` preset's gradient, so the
    adapter's normaliser D is TRL's. (grpo/sapo deliberately differ: D = B * max_completion_length.)"""
    trainer, batch, off = setup

    def check():
        b = batch if policy == "on" else off
        assert_close(trainer_grad(trainer, b, "token"), trainer_grad(trainer, b, "off"))

    check() if policy == "on" else _policy_moved(trainer, check)


@pytest.mark.parametrize("setup", ["grpo", "sapo"], indirect=True)
def test_length_normalised_loss_types_use_max_completion_length(setup):
    trainer, batch, _ = setup
    mask = batch["completion_mask"]
    expected = mask.shape[0] * trainer.max_completion_length * trainer.current_gradient_accumulation_steps
    assert adapter.per_token_normaliser(trainer, batch, mask) == expected


def test_sequence_level_importance_sampling(model_dir, dataset):
    trainer = make_trainer(model_dir, dataset, importance_sampling_level="sequence", loss_type="dapo")
    perturb(trainer.model, seed=3)
    batch = one_batch(trainer)
    with torch.no_grad():
        batch["old_per_token_logps"] = policy_logps(trainer, batch)
    _policy_moved(trainer, lambda: assert_close(trainer_grad(trainer, batch, "sequence"),
                                                expected_grad(trainer, batch, "sequence")))


def test_vllm_importance_sampling_correction(model_dir, dataset):
    """With vLLM's sampling log-probs present the behaviour policy is vLLM's (NaN tokens fall back to old log-probs),
    while TRL's own truncated IS ratio keeps multiplying the task loss."""
    trainer = make_trainer(model_dir, dataset, loss_type="dapo")
    perturb(trainer.model, seed=4)
    batch = one_batch(trainer)
    with torch.no_grad():
        old = policy_logps(trainer, batch)
    sampling = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    sampling[0, 1] = float("nan")
    batch.update(old_per_token_logps=old, sampling_per_token_logps=sampling,
                 importance_sampling_ratio=torch.exp(old - sampling).nan_to_num(1.0).clamp(max=2.0))
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    behaviour = adapter.behaviour_logps(batch, old)
    assert behaviour[0, 1] == old[0, 1] and torch.equal(behaviour[1], sampling[1])
    _policy_moved(trainer, lambda: assert_close(trainer_grad(trainer, batch, "sequence"),
                                                expected_grad(trainer, batch, "sequence")))


def test_lora_reference_is_adapter_disabled_base(model_dir, dataset):
    from peft import LoraConfig

    trainer = make_trainer(model_dir, dataset, loss_type="dr_grpo",
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  task_type="CAUSAL_LM"))
    assert trainer.ref_model is None  # TRL uses the adapter-disabled base as the reference
    perturb(trainer.model, scale=3.0, seed=5)  # LoRA B starts at 0: move it so pi != pi_ref
    batch = one_batch(trainer)
    assert float((batch["ref_per_token_logps"] - policy_logps(trainer, batch).detach()).abs().max()) > 1e-4
    assert_close(trainer_grad(trainer, batch, "sequence"), expected_grad(trainer, batch, "sequence"))


def test_gmpo(model_dir, dataset):
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    import kl_adapters

    args = GMPOConfig(output_dir="/tmp/gmpo", use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, beta=0.1, max_steps=1, report_to="none", save_strategy="no", seed=0,
                      gradient_checkpointing=False, bf16=False)
    kl_adapters.enable("sequence")
    try:
        trainer = make_trainer(model_dir, dataset, trainer_cls=GMPOTrainer, args=args)
        perturb(trainer.model, seed=6)
        batch = one_batch(trainer)
        mask = batch["completion_mask"]
        assert adapter.per_token_normaliser(trainer, batch, mask) == mask.shape[0] * 8  # B * max_completion_length
        got = flat_grad(trainer, lambda: trainer.compute_loss(trainer.model, dict(batch)))
        kl_adapters.disable()
        trainer.beta = 0.0
        task = flat_grad(trainer, lambda: trainer.compute_loss(trainer.model, dict(batch)))
        options = statistics_inputs_by_hand(trainer, batch, "sequence", 0.1)
        kl = flat_grad(trainer, lambda: kl_surrogate(policy_logps(trainer, batch), batch["ref_per_token_logps"], mask,
                                                     beta=0.1 / 8, **options))
        assert_close(got, task + kl)
    finally:
        kl_adapters.disable()


def test_bf16_autocast(model_dir, dataset):
    """TRL's default on CPU is bf16 autocast: the identity then holds to bf16 rounding (matmuls round each backward)."""
    trainer = make_trainer(model_dir, dataset, loss_type="dapo", bf16=True)
    perturb(trainer.model, seed=7)
    batch = one_batch(trainer)
    assert_close(trainer_grad(trainer, batch, "sequence"), expected_grad(trainer, batch, "sequence"), rtol=2e-2)
