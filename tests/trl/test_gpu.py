"""TRL on a GPU: a 63M-parameter random Llama (12 layers, hidden 768; built from a config, char tokenizer, no hub)
trained by the real GRPOTrainer.train(), generation on the GPU. Marked `gpu`; skipped without CUDA.
Run on the device: scripts/gpu.sh run trl (docs/gpu.md).

Checks, each against TRL itself:
- the gradient identity of tests/trl/test_grpo_gradients.py on CUDA (trainer gradient, flag on = TRL's task gradient
  + grad kl_surrogate), float32 to GPU_FP32_RTOL and bf16 autocast to GPU_BF16_RTOL (max |diff| / max |grad|);
- the flag off (KLGRPOConfig(kl_preset=None)) is bit-identical to unpatched TRL (GRPOConfig): same logs, same weights;
- train() with `sequence` (task advantages and the termination control variate's pi(EOS) from the CUDA forward),
  `reward`, `full` (bf16) and once with LoRA: finite losses, the adapter's seq_kl logged every step;
- use_liger_kernel=True with liger-kernel's Triton kernels: a train() and the gradient identity (bf16);
- the KL budget (kl_target) on CUDA: one finite, positive beta per optimizer step, beta moving;
- with beta 1 and a constant reward (the KL term is the whole loss) the sequence KL falls.
"""

import math
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the bit-identity test

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import logged, make_trainer, one_batch, perturb, replayed_budget  # noqa: E402
from test_grpo_gradients import expected_grad, trainer_grad  # noqa: E402

from kl_adapters.adapters import trl as adapter  # noqa: E402
from kl_adapters.tiny_models import save_tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: float32 on CUDA: the two sides sum the same terms in different kernels (fused vs separate backward). Measured on an
#: H200 (2026-11-26, docs/gpu.md): 9.2e-7 of the largest entry for `sequence` and `reward`; 1e-5 leaves 10x margin
GPU_FP32_RTOL = 1e-5
#: bf16 autocast: every matmul rounds to 8 mantissa bits (2^-8 = 0.4%) on each side independently, through 12 layers.
#: Measured on an H200: 7.7e-3 for both presets; 2e-2 leaves 2.6x margin
GPU_BF16_RTOL = 2e-2
MODEL = dict(hidden=768, layers=12, heads=12, max_positions=256)  # 63M parameters (test_model_size)
STEPS = 30
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("llama_63m"), **MODEL))


def gpu_args(**overrides):
    """grpo_args overrides for a GPU run: no use_cpu, eager attention (deterministic backward), longer completions."""
    return {"use_cpu": False, "max_completion_length": 32, "per_device_train_batch_size": 8, "num_generations": 8,
            "learning_rate": 3e-5, "model_init_kwargs": {"attn_implementation": "eager"}, **overrides}


def perturb_on_gpu(model, scale, seed):
    """conftest.perturb (CPU generator) on a CUDA model: before train() builds the optimizer, so moving is safe."""
    perturb(model.cpu(), scale=scale, seed=seed)
    model.cuda()


def test_model_size(gpu_model_dir):
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(gpu_model_dir).parameters())
    assert 50e6 <= n <= 150e6, n


@pytest.mark.parametrize("bf16,rtol", [(False, GPU_FP32_RTOL), (True, GPU_BF16_RTOL)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["sequence", "reward"])
def test_gradient_identity_on_cuda(gpu_model_dir, dataset, preset, bf16, rtol):
    trainer = make_trainer(gpu_model_dir, dataset, **gpu_args(bf16=bf16, loss_type="dapo"))
    assert next(trainer.model.parameters()).is_cuda
    perturb_on_gpu(trainer.model, scale=0.05, seed=1)
    batch = one_batch(trainer)
    assert batch["completion_ids"].is_cuda
    got, want = trainer_grad(trainer, batch, preset), expected_grad(trainer, batch, preset)
    scale = float(want.abs().max())
    error = float((got - want).abs().max()) / scale
    print(f"{preset} {'bf16' if bf16 else 'fp32'}: max |diff| / max |grad| = {error:.3e}")  # the log's record (-rA)
    assert scale > 0 and error < rtol


@pytest.mark.parametrize("preset", ["sequence", "reward", "full"])
def test_train_on_cuda(gpu_model_dir, dataset, preset):
    trainer = make_trainer(gpu_model_dir, dataset, **gpu_args(bf16=True, kl_preset=preset, max_steps=STEPS))
    trainer.train()
    seq_kl, loss = logged(trainer, "kl_adapters/seq_kl"), logged(trainer, "loss")
    assert len(seq_kl) == STEPS and all(math.isfinite(v) and v >= 0 for v in seq_kl)
    assert len(loss) == STEPS and all(math.isfinite(v) for v in loss)
    assert all(math.isfinite(v) for v in logged(trainer, "grad_norm"))


def test_kl_budget_on_cuda(gpu_model_dir, dataset):
    """KLGRPOConfig(kl_target=...) on CUDA: the controller (kl_adapters.budget) sets one beta per optimizer step from
    the logged sequence KL; all finite and positive, and beta leaves its start (the target is far from the start's KL)."""
    steps = STEPS // 3
    trainer = make_trainer(gpu_model_dir, dataset, **gpu_args(bf16=True, kl_target=0.5, max_steps=steps))
    trainer.train()
    betas, seq_kl = logged(trainer, "kl_adapters/beta"), logged(trainer, "kl_adapters/seq_kl")
    assert len(betas) == len(seq_kl) == steps and all(math.isfinite(b) and b > 0 for b in betas)
    assert logged(trainer, "kl_adapters/kl_target") == [0.5] * steps
    replayed_budget(betas, seq_kl, 0.5, trainer.args.beta)  # the logged betas are the controller's
    assert betas[-1] != betas[0], betas


def test_lora_on_cuda(gpu_model_dir, dataset):
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(gpu_model_dir, dataset, peft_config=lora, **gpu_args(bf16=True, max_steps=STEPS // 3))
    trainer.train()
    assert trainer.ref_model is None  # the adapter-disabled base is the reference
    assert len(logged(trainer, "kl_adapters/seq_kl")) == STEPS // 3
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


def test_liger_kernels_on_cuda(gpu_model_dir, dataset):
    """use_liger_kernel=True with liger-kernel's real Triton kernels (skipped where liger-kernel is not installed):
    Trainer.train() swaps the layer kernels (Liger binds its RMSNorm forward into the module), the loss still goes
    through the adapter (seq_kl every step, finite losses), and the gradient identity holds to bf16 rounding with the
    kernels in place (the CPU version, with the kernel step stubbed: tests/trl/test_liger.py)."""
    pytest.importorskip("liger_kernel")
    trainer = make_trainer(gpu_model_dir, dataset, **gpu_args(bf16=True, use_liger_kernel=True, max_steps=2))
    trainer.train()
    assert "forward" in vars(trainer.model.model.norm)  # Liger's kernel bound over LlamaRMSNorm.forward
    assert len(logged(trainer, "kl_adapters/seq_kl")) == 2
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))
    batch = one_batch(trainer)
    got, want = trainer_grad(trainer, batch, "sequence"), expected_grad(trainer, batch, "sequence")
    assert float((got - want).abs().max()) / float(want.abs().max()) < GPU_BF16_RTOL


def _history_and_params(trainer):
    history = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in trainer.state.log_history]
    return history, [p.detach().clone() for p in trainer.model.parameters()]


def test_flag_off_is_bit_identical_to_unpatched_trl_on_cuda(gpu_model_dir, dataset):
    from conftest import grpo_args
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401 (GRPOTrainer: its module must be loaded to unpatch it)

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        adapter.unpatch()
        native = make_trainer(gpu_model_dir, dataset,
                              args=grpo_args(config_cls=GRPOConfig, **gpu_args(bf16=True, max_steps=5)))
        native.train()
        reference = _history_and_params(native)
        adapter.patch("trl.trainer.grpo_trainer")
        flag_off = make_trainer(gpu_model_dir, dataset, **gpu_args(bf16=True, kl_preset=None, max_steps=5))
        flag_off.train()
        patched = _history_and_params(flag_off)
    finally:
        torch.use_deterministic_algorithms(False)
    assert patched[0] == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(patched[1], reference[1]))


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_kl_falls_with_large_beta(gpu_model_dir, dataset):
    """Constant reward: zero advantages, so the loss is the KL term alone; from a perturbed policy the sequence KL
    must fall (the last 5 logged steps' sum below the first 5's; a CPU dry run of this body on a 2-layer model fell
    8% in 10 steps, the GPU run's size is not measured yet)."""
    from conftest import grpo_args
    from trl import GRPOTrainer

    trainer = GRPOTrainer(model=gpu_model_dir, reward_funcs=constant_reward, train_dataset=dataset,
                          args=grpo_args(**gpu_args(bf16=True, beta=1.0, learning_rate=1e-4, max_steps=STEPS)))
    perturb_on_gpu(trainer.model, scale=0.3, seed=2)
    trainer.train()
    seq_kl = logged(trainer, "kl_adapters/seq_kl")
    assert len(seq_kl) == STEPS and seq_kl[0] > 0
    assert sum(seq_kl[-5:]) < sum(seq_kl[:5]), seq_kl
