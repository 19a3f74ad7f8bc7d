"""One task run through TRL's real GRPOTrainer.train(), from the cached reference, evaluated on held-out prompts.

TRL's own defaults wherever the task allows (loss_type "dapo", scale_rewards "group", PPO clip 0.2, gradient clipping
1.0, temperature 1, num_iterations 1): what a TRL user runs. Set by the benchmark: the model and reference (TRL loads
both from the reference folder), `RLSettings` (prompts per step x G completions in one micro-batch, Adam learning rate
decayed linearly to 0, beta, steps_per_generation = lag), max_completion_length per format, and the configuration's
KLGRPOConfig fields (`long_horizon_trl.overrides`: "trl-default", "k3-loss", "token", "sequence", "sequence-plain",
"full", "beta=0", any preset, with "+field=value" options, e.g. "sequence+kl_target=0.8").

Evaluation (`evaluate.evaluate`) before the first step, every `eval_every` steps and after the last, on the
in-domain and out-of-domain test prompts, with a seed that depends on (run seed, step) only.
"""

from __future__ import annotations

import math
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from . import arithmetic
from .evaluate import Scorer, evaluate
from .settings import RLSettings

#: TRL's per-step metrics kept in the results (6 significant digits)
TRL_METRICS = ("reward", "kl", "kl_adapters/seq_kl", "kl_adapters/is_ess", "kl_adapters/beta", "grad_norm",
               "completions/mean_length", "loss", "entropy")

#: reward name -> reward function of TRL's signature, built from the setting's scorer
RewardFn = Callable[..., list[float]]


def verifier(completions: list[str], examples: list[arithmetic.Example]) -> list[float]:
    """The exact verifier as a `Scorer`."""
    return [arithmetic.reward(c, e.answer) for c, e in zip(completions, examples)]


def as_trl_reward(scorer: Scorer, name: str) -> RewardFn:
    """A TRL reward function (completions and the dataset's "answer" column) from a Scorer."""
    def reward(completions, prompts, answer, **_):
        return scorer(completions, [arithmetic.Example(p, a) for p, a in zip(prompts, answer)])

    reward.__name__ = name
    return reward


def make_trainer(folder: Path, config: str, rl: RLSettings, seed: int, max_new_tokens: int,
                 prompts: list[arithmetic.Example], rewards: list[RewardFn]):
    from datasets import Dataset
    from trl import GRPOTrainer

    from ...adapters.trl import KLGRPOConfig
    from ..long_horizon_trl import overrides
    from .reference import tokenizer

    warnings.filterwarnings("ignore")
    args = KLGRPOConfig(**{
        "output_dir": tempfile.mkdtemp(prefix="task_grpo_"), "use_cpu": True, "bf16": False, "seed": seed,
        "beta": rl.beta, "num_generations": rl.group, "per_device_train_batch_size": rl.batch,
        "gradient_accumulation_steps": 1, "steps_per_generation": rl.lag, "max_completion_length": max_new_tokens,
        "learning_rate": rl.learning_rate, "max_steps": rl.steps, "logging_steps": 1, "report_to": "none",
        "save_strategy": "no", "disable_tqdm": True, "temperature": 1.0, **overrides(config)})
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in prompts], "answer": [e.answer for e in prompts]})
    return GRPOTrainer(model=str(folder), reward_funcs=rewards, args=args, train_dataset=dataset,
                       processing_class=tokenizer())


def run(folder: Path, config: str, rl: RLSettings, seed: int, max_new_tokens: int, train: list[arithmetic.Example],
        tests: dict[str, list[arithmetic.Example]], scorers: dict[str, Scorer], reward: str,
        progress: Callable[[dict], None] | None = None) -> dict:
    """Train under one configuration; returns {"history": evaluation rows, "step_seconds", "trl": TRL's per-step
    metrics}. `reward` names the scorer RL optimises (the others are only evaluated)."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    from .reference import tokenizer

    trainer = make_trainer(folder, config, rl, seed, max_new_tokens, train, [as_trl_reward(scorers[reward], reward)])
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = tokenizer()
    history, seconds = [], []

    def evaluate_at(step: int) -> None:
        if step % rl.eval_every and step != rl.steps:
            return
        start = time.perf_counter()
        row = {"step": step, **evaluate(trainer.model, reference, tok, tests, max_new_tokens,
                                        seed=1_000_003 * seed + step, scorers=scorers)}
        row["eval_seconds"] = time.perf_counter() - start
        history.append(row)
        if progress:
            progress(row)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.start)
            evaluate_at(state.global_step)

    evaluate_at(0)
    trainer.add_callback(Clock())
    trainer.train()
    # one row per optimizer step (logging_steps = 1: every row with a "loss"); with lag > 1 TRL logs the rollout's
    # metrics (reward, length) only at the steps that generate, the loss's (grad_norm, kl_adapters/*) at every step
    logs = [{k: float(f"{row[k]:.6g}") for k in TRL_METRICS if k in row} for row in trainer.state.log_history
            if "loss" in row]
    return {"history": history, "step_seconds": seconds, "trl": logs,
            "finite": all(math.isfinite(r.get("loss", 0.0)) and math.isfinite(r.get("grad_norm", 0.0))
                          for r in logs)}
