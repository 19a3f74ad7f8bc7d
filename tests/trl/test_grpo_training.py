"""Real GRPOTrainer.train() runs with the flag on (each recommended preset), off, with LoRA and num_iterations=2."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import grpo_args, logged, make_trainer

from kl_adapters.adapters import trl as adapter
from kl_adapters.adapters.trl import loss as trl_loss

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def train(model_dir, dataset, **overrides):
    trainer = make_trainer(model_dir, dataset, **overrides)
    trainer.train()
    return trainer


@pytest.mark.parametrize("preset", ["sequence", "reward"])
def test_train_with_preset_logs_native_and_new_metrics(model_dir, dataset, preset):
    trainer = train(model_dir, dataset, kl_preset=preset, max_steps=3)
    assert len(logged(trainer, "kl")) == 3  # TRL's own metric name is kept
    seq_kl = logged(trainer, "kl_adapters/seq_kl")
    assert len(seq_kl) == 3 and all(math.isfinite(v) and v >= 0 for v in seq_kl)
    assert seq_kl[-1] > 0  # the policy moved away from the reference
    assert logged(trainer, "kl_adapters/is_ess") == [1.0] * 3  # on-policy: every importance weight is 1
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


def test_num_iterations_2_trains_off_policy(model_dir, dataset, monkeypatch):
    seen = []
    real = adapter.behaviour_logps
    monkeypatch.setattr(trl_loss, "behaviour_logps", lambda inputs, logp: seen.append(real(inputs, logp)) or seen[-1])
    trainer = train(model_dir, dataset, num_iterations=2, max_steps=4)
    assert any(b is not None for b in seen)  # later minibatches carry the rollout-time log-probs
    ess = logged(trainer, "kl_adapters/is_ess")
    assert len(ess) == 4 and all(0 < v <= 1 for v in ess) and min(ess) < 1  # off-policy batches: weights != 1
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


def test_lora_trains(model_dir, dataset):
    from peft import LoraConfig

    trainer = train(model_dir, dataset, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               task_type="CAUSAL_LM"), max_steps=3)
    assert trainer.ref_model is None and len(logged(trainer, "kl_adapters/seq_kl")) == 3


def _history_and_params(trainer):
    history = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in trainer.state.log_history]
    return history, [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.compat
def test_flag_off_is_bit_identical_to_unpatched_trl(model_dir, dataset):
    """Unpatched TRL with GRPOConfig vs patched TRL with KLGRPOConfig(kl_preset=None): same metrics, same weights."""
    from trl import GRPOConfig

    adapter.unpatch()
    reference = _history_and_params(train(model_dir, dataset, args=grpo_args(config_cls=GRPOConfig)))
    adapter.patch("trl.trainer.grpo_trainer")
    patched = _history_and_params(train(model_dir, dataset, kl_preset=None))
    assert patched[0] == reference[0]
    assert all((a == b).all() for a, b in zip(patched[1], reference[1]))


def test_environment_variable_activates_without_code_change(model_dir, tmp_path):
    """KL_ADAPTERS=sequence on a script that never imports kl_adapters: the installed .pth hook patches GRPOTrainer."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import tempfile, warnings
        warnings.filterwarnings("ignore")
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        ds = Dataset.from_dict({{"prompt": [f"q{{i}}: say a" for i in range(16)]}})
        args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, beta=0.1, max_steps=1, logging_steps=1,
                          report_to="none", save_strategy="no", gradient_checkpointing=False)
        trainer = GRPOTrainer(model={model_dir!r}, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                              args=args, train_dataset=ds)
        trainer.train()
        print("KEYS", sorted(k for r in trainer.state.log_history for k in r if k.startswith("kl")))
    """))
    env = {**os.environ, "KL_ADAPTERS": "sequence", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kl_adapters/seq_kl" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bf16", [False, True])
def test_train_on_cuda(model_dir, dataset, bf16):
    """The same real GRPOTrainer.train() on a GPU (float32 and bf16 autocast): the adapter's metrics are logged."""
    trainer = train(model_dir, dataset, kl_preset="sequence", use_cpu=False, bf16=bf16, num_iterations=2, max_steps=4)
    assert next(trainer.model.parameters()).is_cuda
    seq_kl = logged(trainer, "kl_adapters/seq_kl")
    assert len(seq_kl) == 4 and all(math.isfinite(v) and v >= 0 for v in seq_kl)
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))
