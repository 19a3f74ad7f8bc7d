"""TRL GRPOTrainer: training-step time with kl-adapters (preset "sequence") vs TRL's own KL term (beta > 0).

Two measurements on the same tiny random Llama, CPU (or CUDA with --device cuda):
  loss_backward  compute_loss + backward on one fixed prepared batch (where the adapter adds work: worst case)
  train_step     Trainer.training_step on fresh batches, generation included (TRL's own `step_time` metric)
Runs are interleaved (native, patched, native, ...) and the median per configuration is reported with the ratio.
Usage: .venvs/trl/bin/python bench/trl_step_overhead.py [--repeats 30] [--device cpu|cuda] [--hidden 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from timing import write_result  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from kl_adapters.adapters.trl import KLGRPOConfig  # noqa: E402
from kl_adapters.tiny_models import save_tiny_model  # noqa: E402


def build(model_dir: str, preset: str | None, device: str, steps: int) -> GRPOTrainer:
    args = KLGRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=device == "cpu", bf16=False, beta=0.04,
                        per_device_train_batch_size=8, num_generations=8, max_completion_length=32,
                        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                        gradient_checkpointing=False, kl_preset=preset or "off", disable_tqdm=True)
    dataset = Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(512)]})
    return GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [c.count("a") / 8 for c in completions],
                       args=args, train_dataset=dataset)


def loss_backward_times(trainer: GRPOTrainer, repeats: int, sync) -> list[float]:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    times = []
    for i in range(repeats + 3):
        trainer.model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        trainer.compute_loss(trainer.model, dict(batch)).backward()
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=64)
    a = parser.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    model_dir = str(save_tiny_model(tempfile.mkdtemp(), hidden=a.hidden))
    trainers = {name: build(model_dir, preset, a.device, a.repeats + 5) for name, preset in
                (("native", None), ("kl_adapters_sequence", "sequence"))}
    result = {"model": f"tiny Llama, hidden {a.hidden}, 2 layers", "batch": "8 sequences x 32 completion tokens",
              "beta": 0.04}
    lb = {name: [] for name in trainers}
    for _ in range(3):  # interleave blocks to spread drift over both configurations
        for name, trainer in trainers.items():
            lb[name] += loss_backward_times(trainer, a.repeats // 3, sync)
    for name, trainer in trainers.items():
        trainer.train()
    steps = {name: [r["step_time"] for r in t.state.log_history if "step_time" in r][3:] for name, t in trainers.items()}
    for label, data in (("loss_backward", lb), ("train_step", steps)):
        med = {name: statistics.median(v) for name, v in data.items()}
        result[label] = {"median_s": med, "n": {k: len(v) for k, v in data.items()},
                         "ratio": med["kl_adapters_sequence"] / med["native"]}
    path = write_result(f"trl_step_overhead_{a.device}", result)
    print(path.read_text())


if __name__ == "__main__":
    main()
