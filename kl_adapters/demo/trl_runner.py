"""Train the toy problem's tiny transformer with TRL's real GRPOTrainer, evaluating the objective exactly every step.

GRPO settings that make its *task* gradient an unbiased policy gradient of E[r] (otherwise no KL configuration could
reach pi*): one prompt, G completions per step, advantages r_i - mean_j r_j without std scaling
(scale_rewards="none"), constant normaliser (loss_type="dr_grpo"), on-policy (num_iterations=1, so PPO clipping never
acts), no truncation masking. The group mean includes the sample itself, which scales the task gradient by (1 - 1/G)
(the KL term keeps its full weight); TRL's beta is therefore set to beta * (G - 1) / G, making the optimized objective
exactly (1 - 1/G) * (E[r] - beta * KL(pi || pi_ref)).

`check_losses` hands the same trainer's compute_loss to the exact gradient check (`gradient_check`).
"""

from __future__ import annotations

import functools
import tempfile
import warnings

import torch

from .harness import Batch, TrainSettings
from .problem import ExactEvaluator, ToyProblem, sequence_logprobs

#: name -> (KLGRPOConfig overrides, description)
SPECS: dict[str, tuple[dict, str]] = {
    "trl-default": (dict(kl_preset="off", use_bias_correction_kl=True), "TRL 1.16 default: k3 * pi/pi_old in the loss"),
    "k3-loss": (dict(kl_preset="off", use_bias_correction_kl=False), "legacy GRPO: k3 in the loss"),
    "sequence": (dict(kl_preset="sequence"), "kl-adapters sequence (variance-reduced: leave-one-out over the group)"),
    "sequence-plain": (dict(kl_preset="sequence-plain"), "kl-adapters sequence-plain (without the reductions)"),
    "reward": (dict(kl_preset="reward"), "kl-adapters reward (variance-reduced)"),
    "full": (dict(kl_preset="full"), "kl-adapters full (exact per-position KL over the vocabulary, leave-one-out "
             "baseline)"),
    "beta=0": (dict(kl_preset="off", beta=0.0), "no KL term"),
}


def make_trainer(problem: ToyProblem, config: str, seed: int, settings: TrainSettings, overrides: dict | None = None):
    """GRPOTrainer (KLGRPOConfig with the settings above) on the toy policy of `seed`, under one configuration;
    `overrides`: further KLGRPOConfig fields, applied last (e.g. kl_target and a starting beta: bench/kl_budget.py)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from ..adapters.trl import KLGRPOConfig

    warnings.filterwarnings("ignore")
    model_dir = tempfile.mkdtemp(prefix="toy_policy_")
    problem.model(seed, settings.hidden).save_pretrained(model_dir)  # TRL reloads the reference from this path
    problem.tokenizer().save_pretrained(model_dir)
    spec, _ = SPECS[config]
    g = settings.group
    args = KLGRPOConfig(**{
        "output_dir": tempfile.mkdtemp(prefix="toy_grpo_"), "use_cpu": True, "bf16": False, "seed": seed,
        "beta": problem.beta * (g - 1) / g, "loss_type": "dr_grpo", "scale_rewards": "none", "num_iterations": 1,
        "mask_truncated_completions": False, "per_device_train_batch_size": g, "num_generations": g,
        "max_completion_length": problem.horizon, "temperature": 1.0, "learning_rate": settings.learning_rate,
        "max_steps": settings.steps, "logging_steps": settings.steps, "report_to": "none", "save_strategy": "no",
        "gradient_checkpointing": False, "disable_tqdm": True, **spec, **(overrides or {})})
    dataset = Dataset.from_dict({"prompt": [problem.chars[0]] * (settings.steps + 1)})
    return GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: problem.reward(completions),
                       args=args, train_dataset=dataset, processing_class=problem.tokenizer())


def run_trl(problem: ToyProblem, config: str, seed: int, settings: TrainSettings) -> tuple[list[dict[str, float]], None]:
    """Exact metrics after 0, 1, ..., steps optimizer steps of GRPOTrainer under one KL configuration (no extras)."""
    return train_exactly(problem, make_trainer(problem, config, seed, settings)), None


def train_exactly(problem: ToyProblem, trainer) -> list[dict[str, float]]:
    """trainer.train(), with the exact metrics of the policy after 0, 1, ..., steps optimizer steps."""
    from transformers import TrainerCallback

    evaluate = ExactEvaluator(problem, sequence_logprobs(problem, trainer.model))
    history = [evaluate(sequence_logprobs(problem, trainer.model))]

    class Exact(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            history.append(evaluate(sequence_logprobs(problem, trainer.model)))

    trainer.add_callback(Exact())
    trainer.train()
    return history


class CheckLoss:
    """harness.LossFn for the gradient check: `trainer.compute_loss` (TRL's real loss, through the adapter when the
    configuration sets kl_preset) on a Batch, with the configuration's KLGRPOConfig fields (`overrides`, default
    SPECS[config]'s) set on the trainer."""

    def __init__(self, trainer, config: str, overrides: dict | None = None):
        self.trainer, self.overrides = trainer, SPECS[config][0] if overrides is None else overrides

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        for key, value in self.overrides.items():
            setattr(self.trainer.args, key, value)
        mask = batch.completion_mask.long()
        inputs = {"prompt_ids": batch.input_ids[:, :1], "prompt_mask": torch.ones_like(mask[:, :1]),
                  "completion_ids": batch.input_ids[:, 1:], "completion_mask": mask, "advantages": batch.advantages,
                  "ref_per_token_logps": batch.ref_logp, "num_items_in_batch": mask.sum()}
        return self.trainer.compute_loss(model, inputs)


def check_losses(problem: ToyProblem, configs: list[str], seed: int = 0):
    """(model, {config: (loss factory, batch rows)}, scale) for `gradient_check.check`: one trainer, every configuration.

    dr_grpo divides every token by B * max_completion_length: grad loss = beta_TRL / (B T) * sum_rows g (TRL's own
    KL term and the adapter's alike: tests/trl/test_grpo_gradients.py), hence scale(batch) = beta_TRL / (B T)."""
    from .gradient_check import batch_rows

    trainer = make_trainer(problem, "sequence", seed, TrainSettings(steps=1))  # patches compute_loss
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    losses = {}
    for config in configs:
        preset = SPECS[config][0].get("kl_preset", "off")
        losses[config] = (functools.partial(CheckLoss, trainer, config), batch_rows(None if preset == "off" else preset))
    beta = trainer.beta
    return trainer.model, losses, lambda batch: beta / (batch.completion_mask.shape[0] * problem.horizon)


CONFIGS = {name: description for name, (_, description) in SPECS.items()}
