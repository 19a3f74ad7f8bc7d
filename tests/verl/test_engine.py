"""verl's real actor update path (TrainingWorker + FSDP2 engine + micro-batching + ppo_loss), driven by the flag in the
actor config, against an oracle built from kl_surrogate with the task advantages and the end-of-sequence probabilities
of a separate forward (see engine_check.py). CPU: gloo and the test-only platform
shim. GPU: the same check plus real AdamW update steps on CUDA; skipped without CUDA."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def run_engine_check(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    out = subprocess.run([sys.executable, str(HERE / "engine_check.py"), *args], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[6:])


def check(result: dict, steps: int) -> None:
    assert result["kl_vs_task"] > 0.05  # the KL term is a sizeable part of the update: the comparison is not vacuous
    # pi(EOS | y_<t) from compute_log_prob's forward (kept for the update's statistics) and from the training forward
    # (model_output) = softmax(logits)[EOS] of a separate transformers forward; they change the statistics (the oracle
    # without them makes another update), so kl_rel_error below shows they reached the core
    assert result["kept_eos_error"] is not None and result["kept_eos_error"] < 1e-5
    assert result["training_eos_error"] < 1e-5
    assert result["eos_effect"] > 1e-3
    assert result["kl_rel_error"] < 1e-4
    assert result["flag_off_equal"]  # verl's own kl_loss_type: compute_log_prob's outputs and the update as upstream
    assert result["grad_norms"][0] == pytest.approx(result["grad_norms"][1], rel=1e-5)
    assert {"actor/pg_loss", "kl_loss", "kl_coef", "grad_norm", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap",
            "kl_adapters/is_ess"} <= set(result["metric_keys"])
    assert len(result["history"]) == steps
    for step in result["history"]:
        assert all(torch.isfinite(torch.tensor(v)).all() for v in step.values()), step


@pytest.mark.skipif(importlib.metadata.version("verl") in ("0.8.0", "0.9.0")
                    and not importlib.util.find_spec("flash_attn"),
                    reason="verl < 0.9.1 unpads batches with flash_attn.bert_padding (CUDA only; 0.9.1 added a "
                    "pure-torch fallback), so its engine cannot run on CPU")
def test_fsdp2_engine_on_cpu_matches_the_oracle():
    check(run_engine_check("--device", "cpu", "--steps", "2"), steps=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_engine_on_gpu_update_steps():
    check(run_engine_check("--device", "cuda", "--steps", "5"), steps=5)
