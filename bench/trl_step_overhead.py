"""TRL GRPOTrainer: training-step time with kl-adapters (preset "sequence") vs TRL's own KL term (beta > 0).

Two measurements on the same tiny random Llama, CPU (or CUDA with --device cuda):
  loss_backward  compute_loss + backward on one fixed prepared batch (where the adapter adds work: worst case)
  train_step     GRPOTrainer.training_step on a fresh batch: generation, reward, reference and old log-probs, loss,
                 backward (no optimizer step, so both trainers keep the initial weights and, seeded alike each round,
                 generate the very same completions: equal work apart from the KL term)
The two trainers alternate call by call (ABBA); the medians, their ratio and the median per-round ratio are reported.
Usage: .venvs/trl/bin/python bench/trl_step_overhead.py [--repeats 40] [--device cpu|cuda] [--hidden 64] [--layers 2]
       [--completion-length 32] [--name NAME]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from kl_adapters.adapters.trl import KLGRPOConfig  # noqa: E402
from kl_adapters.tiny_models import save_tiny_model  # noqa: E402

NATIVE, ADAPTER = "native", "kl_adapters_sequence"


def build(model_dir: str, preset: str | None, device: str, completion_length: int = 32) -> GRPOTrainer:
    args = KLGRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=device == "cpu", bf16=False, beta=0.04,
                        per_device_train_batch_size=8, num_generations=8, max_completion_length=completion_length,
                        logging_steps=1, report_to="none", save_strategy="no", seed=0,
                        gradient_checkpointing=False, kl_preset=preset or "off", disable_tqdm=True)
    dataset = Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(512)]})
    return GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [c.count("a") / 8 for c in completions],
                       args=args, train_dataset=dataset)


def loss_backward_fn(trainer: GRPOTrainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))

    def run():
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, dict(batch)).backward()

    return run


def train_step_fn(trainer: GRPOTrainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batches = iter(trainer.get_train_dataloader())

    def run():
        trainer.model.zero_grad(set_to_none=True)
        trainer.training_step(trainer.model, next(batches), None)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--name", default=None, help="bench/results/<name>.json (default trl_step_overhead_<device>)")
    a = parser.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else None
    if a.device == "cpu":
        torch.set_num_threads(1)  # as the other benchmarks: reproducible, and fair on a shared machine
    model_dir = str(save_tiny_model(tempfile.mkdtemp(), hidden=a.hidden, layers=a.layers,
                                    max_positions=max(128, 64 + a.completion_length)))
    trainers = {name: build(model_dir, preset, a.device, a.completion_length) for name, preset in
                ((NATIVE, None), (ADAPTER, "sequence"))}
    result = {"model": f"tiny Llama, hidden {a.hidden}, {a.layers} layers",
              "batch": f"8 sequences x {a.completion_length} completion tokens",
              "beta": 0.04, "threads": torch.get_num_threads(), "repeats": a.repeats}
    result["loss_backward"] = compare(alternating({n: loss_backward_fn(t) for n, t in trainers.items()},
                                                  repeats=a.repeats, sync=sync), NATIVE, ADAPTER)
    steps = {n: train_step_fn(t) for n, t in trainers.items()}
    result["train_step"] = compare(alternating(steps, repeats=a.repeats, sync=sync,
                                               before=lambda _config, i: torch.manual_seed(i)), NATIVE, ADAPTER)
    lengths = {n: [round(x, 3) for x in t._metrics["train"]["completions/mean_length"]] for n, t in trainers.items()}
    assert lengths[NATIVE] == lengths[ADAPTER], "both trainers must generate the same completions"
    result["train_step"]["completion_mean_length"] = sum(lengths[NATIVE]) / len(lengths[NATIVE])
    path = write_result(a.name or f"trl_step_overhead_{a.device}", result)
    print(path.read_text())


if __name__ == "__main__":
    main()
