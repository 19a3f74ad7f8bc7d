"""Train the toy problem's tiny transformer with TRL's real GRPOTrainer, evaluating the objective exactly every step.

GRPO settings that make its *task* gradient an unbiased policy gradient of E[r] (otherwise no KL configuration could
reach pi*): one prompt, G completions per step, advantages r_i - mean_j r_j without std scaling
(scale_rewards="none"), constant normaliser (loss_type="dr_grpo"), on-policy (num_iterations=1, so PPO clipping never
acts), no truncation masking. The group mean includes the sample itself, which scales the task gradient by (1 - 1/G)
(the KL term keeps its full weight); TRL's beta is therefore set to beta * (G - 1) / G, making the optimized objective
exactly (1 - 1/G) * (E[r] - beta * KL(pi || pi_ref)).
"""

from __future__ import annotations

import tempfile
import warnings

from .harness import TrainSettings
from .problem import ExactEvaluator, ToyProblem, sequence_logprobs

#: name -> (KLGRPOConfig overrides, description)
SPECS: dict[str, tuple[dict, str]] = {
    "trl-default": (dict(kl_preset="off", use_bias_correction_kl=True), "TRL 1.16 default: k3 * pi/pi_old in the loss"),
    "k3-loss": (dict(kl_preset="off", use_bias_correction_kl=False), "legacy GRPO: k3 in the loss"),
    "sequence": (dict(kl_preset="sequence"), "kl-adapters sequence"),
    "reward": (dict(kl_preset="reward"), "kl-adapters reward"),
    "beta=0": (dict(kl_preset="off", beta=0.0), "no KL term"),
}


def run_trl(problem: ToyProblem, config: str, seed: int, settings: TrainSettings) -> tuple[list[dict[str, float]], None]:
    """Exact metrics after 0, 1, ..., steps optimizer steps of GRPOTrainer under one KL configuration (no extras)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from ..adapters.trl import KLGRPOConfig

    warnings.filterwarnings("ignore")
    model_dir = tempfile.mkdtemp(prefix="toy_policy_")
    problem.model(seed, settings.hidden).save_pretrained(model_dir)  # TRL reloads the reference from this path
    problem.tokenizer().save_pretrained(model_dir)
    overrides, _ = SPECS[config]
    g = settings.group
    args = KLGRPOConfig(**{
        "output_dir": tempfile.mkdtemp(prefix="toy_grpo_"), "use_cpu": True, "bf16": False, "seed": seed,
        "beta": problem.beta * (g - 1) / g, "loss_type": "dr_grpo", "scale_rewards": "none", "num_iterations": 1,
        "mask_truncated_completions": False, "per_device_train_batch_size": g, "num_generations": g,
        "max_completion_length": problem.horizon, "temperature": 1.0, "learning_rate": settings.learning_rate,
        "max_steps": settings.steps, "logging_steps": settings.steps, "report_to": "none", "save_strategy": "no",
        "gradient_checkpointing": False, "disable_tqdm": True, **overrides})
    prompt = problem.chars[0]
    dataset = Dataset.from_dict({"prompt": [prompt] * (settings.steps + 1)})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: problem.reward(completions),
                          args=args, train_dataset=dataset, processing_class=problem.tokenizer())
    evaluate = ExactEvaluator(problem, sequence_logprobs(problem, trainer.model))
    history = [evaluate(sequence_logprobs(problem, trainer.model))]

    class Exact(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            history.append(evaluate(sequence_logprobs(problem, trainer.model)))

    trainer.add_callback(Exact())
    trainer.train()
    return history, None


CONFIGS = {name: description for name, (_, description) in SPECS.items()}
