"""verl on a GPU: the FSDP2 actor update through verl's TrainingWorker on one GPU (NCCL, world size 1), a 63M-parameter
random Llama, kl_loss_type=kl_adapters:sequence and the flag off (gpu_worker_check.py, one subprocess per dtype); and
verl's Megatron engine (megatron_check.py, `test_megatron_actor_update_on_gpu`). Marked `gpu`; skipped without CUDA.
Run on the device: scripts/gpu.sh run verl (docs/gpu.md).

Checks: the gradient identity (flagged update = oracle update: verl's loss without KL + kl_surrogate) relative to the
KL part of the update, float32 to FP32_RTOL and bf16 compute to BF16_RTOL; the flag off bit-identical to verl's own
ppo_loss after 5 AdamW steps; finite metrics; the policy's log-probs approach the reference's when the KL term is the
whole loss (mean |log pi - log pi_ref| falls below half its first value in 20 steps).

Megatron (issue 47): verl's MegatronEngineWithLMHead driven by verl's TrainingWorker (compute_log_prob, then one actor
update) on a tiny megatron-core GPTModel, TP 1, float32, NCCL, CUDA kernels, on verl's remove-padding (thd) forward and
on its padded (bshd) one; the core attention is megatron_cpu.py's (verl's Megatron forward is written for Transformer
Engine's attention, which is not in the device image; megatron's own DotProductAttention takes neither format's
inputs). What a CPU cannot show: megatron-core's and verl's code on CUDA tensors and NCCL. Checks: pi(EOS) kept by
compute_log_prob and handed to ppo_loss = softmax of the full logits of a separate forward (1e-5); the flagged
update = the oracle (verl's loss without KL + kl_surrogate with the task and those pi(EOS)) to FP32_RTOL of its KL
part, which pi(EOS) changes; the flag off bit-identical to the adapter unpatched; the logits processor's pi(EOS) =
the softmax of the full logits.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: float32: CPU's engine check holds 1e-4 on a 2-layer model; the same bound on CUDA, 12 layers
FP32_RTOL = 1e-4
#: bf16 compute (float32 master weights and gradient reduction): each side's backward rounds to 8 mantissa bits. Measured
#: on an H200 (2026-11-26): 0.0 (both sides run the same engine kernels on the same batch); the bound allows a kernel
#: choice that differs between the two steps
BF16_RTOL = 5e-2


def run_check(tmp_path: Path, *args: str) -> dict:
    """gpu_worker_check.py in its own process (it initialises torch.distributed), without KL_ADAPTERS."""
    result = tmp_path / "result.json"
    command = [sys.executable, str(HERE / "gpu_worker_check.py"), "--result", str(result), *args]
    done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=540,
                          env={k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"})
    assert done.returncode == 0 and result.exists(), (done.stdout + done.stderr)[-4000:]
    return json.loads(result.read_text())


@pytest.mark.parametrize("dtype,rtol", [("float32", FP32_RTOL), ("bfloat16", BF16_RTOL)])
def test_fsdp_actor_update_on_gpu(tmp_path, dtype, rtol):
    result = run_check(tmp_path, "--dtype", dtype, "--preset", "sequence")
    print({k: result[k] for k in ("dtype", "kl_rel_error", "kept_eos_error", "flag_off_equal")})  # the log (-rA)
    assert 50e6 <= result["parameters"] <= 150e6
    assert result["kl_rel_error"] < rtol, result["kl_rel_error"]
    assert result["flag_off_equal"], "flag off: the weights differ from verl's own ppo_loss"
    history = result["kl_history"]
    assert len(history) == 20
    assert all(math.isfinite(v) for step in history for v in step.values()), history
    assert {"kl_adapters/seq_kl", "grad_norm"} <= set(history[0])
    gaps = [step["mean_abs_logp_gap"] for step in history]
    assert gaps[-1] < 0.5 * gaps[0], gaps


def run_megatron_check(*args: str) -> dict:
    """megatron_check.py on the GPU in its own process (world size 1: it initialises torch.distributed and megatron's
    model parallelism), without KL_ADAPTERS."""
    env = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, str(HERE / "megatron_check.py"), "--device", "cuda", *args], cwd=HERE,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[6:])


def test_megatron_actor_update_on_gpu():
    result = run_megatron_check("--variant", "thd", "--variant", "bshd")
    engines = result["engine"]
    print({variant: {k: engine[k] for k in ("kept_eos_error", "training_eos_error", "eos_effect", "kl_rel_error",
                                             "flag_off_equal")} for variant, engine in engines.items()})  # the log
    for entropy in ("entropy=False", "entropy=True"):  # the logits processor alone, on the GPU
        case = result["processor_tp1"][entropy]
        assert case["eos_error"] < 1e-6 and case["is_eos"] and case["log_probs_equal"], case
    assert set(engines) == {"thd", "bshd"}
    for variant, engine in engines.items():
        assert engine["kept_eos_error"] is not None and engine["kept_eos_error"] < 1e-5, variant
        assert engine["kept_is_eos"] and engine["training_eos_error"] < 1e-5, variant
        assert engine["log_probs_error"] < 1e-4, variant  # packed vs one sequence: other CUDA matmul shapes
        assert engine["kl_vs_task"] > 0.05 and engine["eos_effect"] > 1e-2, variant
        assert engine["kl_rel_error"] < FP32_RTOL, (variant, engine["kl_rel_error"])
        assert engine["flag_off_equal"], variant
        assert {"kl_loss", "grad_norm", "kl_adapters/seq_kl"} <= set(engine["metric_keys"])
        assert engine["attention_calls"] and engine["micro_batch_rows"] == [4, 4], variant
