"""TRL GRPOTrainer: what reading pi(EOS | y_<t) from TRL's own forward costs (issue 20), against the same preset
without it and against TRL's native KL term.

Three trainers on the same tiny random Llama, CPU (or CUDA with --device cuda), beta > 0:
  native          TRL's own KL term (kl_preset off)
  sequence-no-eos kl_preset="sequence" with the EOS read switched off (`adapters.trl.eos._eos_weight` returns None, as
                  for a head that is not hidden @ W.T): task advantages and groups only
  sequence        kl_preset="sequence" as shipped: the backbone hook computes the EOS gap of every forward it records
Measured (timing.alternating: one call of each per round, ABBA order): compute_loss + backward on one fixed prepared
batch, and training_step on fresh batches (generation, reward, reference pass, loss, backward; no optimizer step, so
the trainers keep their weights and, seeded alike, generate the same completions). --num-iterations 2 makes TRL run
the old-policy forward at generation, where the adapter reads pi(EOS) for the rollout statistics too.
Usage: .venvs/trl/bin/python bench/trl_eos_cost.py [--repeats 60] [--num-iterations 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402
from trl_step_overhead import build, loss_backward_fn, train_step_fn  # noqa: E402

from kl_adapters.adapters.trl import eos as trl_eos  # noqa: E402
from kl_adapters.tiny_models import save_tiny_model  # noqa: E402

NATIVE, NO_EOS, EOS = "native", "sequence-no-eos", "sequence"
REAL_EOS_WEIGHT = trl_eos._eos_weight


def switch_eos(config: str, _round: int) -> None:
    """The EOS read on for `sequence`, off for `sequence-no-eos` (untimed, before each call)."""
    trl_eos._eos_weight = (lambda trainer, lm: None) if config == NO_EOS else REAL_EOS_WEIGHT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=64)
    a = parser.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else None
    if a.device == "cpu":
        torch.set_num_threads(1)
    model_dir = str(save_tiny_model(tempfile.mkdtemp(), hidden=a.hidden))
    trainers = {NATIVE: build(model_dir, None, a.device), NO_EOS: build(model_dir, "sequence", a.device),
                EOS: build(model_dir, "sequence", a.device)}
    for trainer in trainers.values():
        trainer.args.num_iterations = trainer.num_iterations = a.num_iterations
    result = {"model": f"tiny Llama, hidden {a.hidden}, 2 layers", "batch": "8 sequences x 32 completion tokens",
              "beta": 0.04, "num_iterations": a.num_iterations, "threads": torch.get_num_threads(),
              "repeats": a.repeats}
    loss = alternating({n: loss_backward_fn(t) for n, t in trainers.items()}, repeats=a.repeats, sync=sync,
                       before=switch_eos)
    result["loss_backward"] = {"eos_vs_no_eos": compare(loss, NO_EOS, EOS), "eos_vs_native": compare(loss, NATIVE, EOS)}
    steps = alternating({n: train_step_fn(t) for n, t in trainers.items()}, repeats=a.repeats, sync=sync,
                        before=lambda config, i: (switch_eos(config, i), torch.manual_seed(i)))
    result["train_step"] = {"eos_vs_no_eos": compare(steps, NO_EOS, EOS), "eos_vs_native": compare(steps, NATIVE, EOS)}
    switch_eos(EOS, 0)
    lengths = {n: t._metrics["train"]["completions/mean_length"] for n, t in trainers.items()}
    assert lengths[NATIVE] == lengths[NO_EOS] == lengths[EOS], "the trainers must generate the same completions"
    path = write_result(f"trl_eos_cost_{a.device}_it{a.num_iterations}", result)
    for part in ("loss_backward", "train_step"):
        for key, c in result[part].items():
            print(f"{part:>13} {key:<14} medians {c['median_s']}  ratio {c['ratio']:.3f}  "
                  f"paired {c['median_paired_ratio']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
