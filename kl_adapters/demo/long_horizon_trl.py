"""The long-horizon problem trained through TRL's real GRPOTrainer.train(), and the variance of the gradient it takes.

Settings as in the horizon-4 demo (`trl_runner`): one prompt, G completions per step, advantages r_i - mean_j r_j
(scale_rewards="none"), constant normaliser (loss_type="dr_grpo"), on-policy (num_iterations=1), no truncation masking
(a completion cut at T tokens keeps its reward, as the problem's distribution does), TRL's beta = beta (G - 1) / G, so
that the optimized objective is exactly (1 - 1/G) (E[R] - beta KL(pi || pi_ref)), and max_completion_length = T.

A configuration is a name (`CONFIGS`, or any kl-adapters preset name: its kl_preset) optionally followed by
KLGRPOConfig fields, "+field=value" each: "sequence+kl_is_clip=2.0" -- any option the adapter grows plugs in by name
(`overrides`).

`gradient_variance` feeds the same sampled groups of G completions (at the training G) through the same trainer's
compute_loss under each configuration, with the groups' GRPO advantages: the gradient a training step takes,
task + KL, and its covariance trace.
"""

from __future__ import annotations

import ast
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from ..presets import PRESETS
from .harness import Batch
from .long_horizon_harness import LongSettings, Progress, batch_of, evaluate_policy
from .long_horizon_problem import PROMPT, LongHorizonProblem, sample
from .trl_runner import SPECS as DEMO_SPECS
from .trl_runner import CheckLoss

#: name -> (KLGRPOConfig overrides, description)
SPECS: dict[str, tuple[dict, str]] = {
    "trl-default": DEMO_SPECS["trl-default"],
    "token": (dict(kl_preset="token"), "kl-adapters token: the per-token reverse-KL (k2) gradient, no future-KL term"),
    "k3-loss": DEMO_SPECS["k3-loss"],
    "sequence-plain": DEMO_SPECS["sequence-plain"],
    "sequence": DEMO_SPECS["sequence"],
    "full": DEMO_SPECS["full"],
    "beta=0": DEMO_SPECS["beta=0"],
}
CONFIGS = {name: description for name, (_, description) in SPECS.items()}


def overrides(config: str) -> dict:
    """KLGRPOConfig overrides of a configuration name: SPECS, or a preset name, then "+field=value" options."""
    base, *options = config.split("+")
    if base in SPECS:
        out = dict(SPECS[base][0])
    elif base in PRESETS:
        out = {"kl_preset": base}
    else:
        raise ValueError(f"unknown configuration {base!r}; valid: {', '.join(SPECS)}, or a preset: "
                         f"{', '.join(PRESETS)}")
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"option {option!r} of {config!r} is not field=value")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def make_trainer(problem: LongHorizonProblem, config: str, settings: LongSettings):
    """GRPOTrainer (KLGRPOConfig with the module's settings) on the problem's initial policy, under `config`."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from ..adapters.trl import KLGRPOConfig

    warnings.filterwarnings("ignore")
    model_dir = tempfile.mkdtemp(prefix="long_horizon_policy_")
    problem.model().save_pretrained(model_dir)  # TRL loads the policy and the reference from this path
    problem.tokenizer().save_pretrained(model_dir)
    g = settings.group
    args = KLGRPOConfig(**{
        "output_dir": tempfile.mkdtemp(prefix="long_horizon_grpo_"), "use_cpu": True, "bf16": False,
        "seed": problem.seed, "beta": problem.beta * (g - 1) / g, "loss_type": "dr_grpo", "scale_rewards": "none",
        "num_iterations": 1, "mask_truncated_completions": False, "per_device_train_batch_size": g,
        "num_generations": g, "max_completion_length": problem.horizon, "temperature": 1.0,
        "learning_rate": settings.learning_rate, "max_steps": settings.steps, "logging_steps": 1,
        "report_to": "none", "save_strategy": "no", "gradient_checkpointing": False, "disable_tqdm": True,
        **overrides(config)})
    dataset = Dataset.from_dict({"prompt": [PROMPT] * (settings.steps + 1)})
    return GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: problem.reward(completions),
                       args=args, train_dataset=dataset, processing_class=problem.tokenizer())


#: TRL's per-step metrics kept in the results
TRL_METRICS = ("reward", "kl", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap", "completions/mean_length",
               "grad_norm", "entropy")


def run_trl(problem: LongHorizonProblem, config: str, settings: LongSettings, progress: Progress | None = None,
            at_evaluation: Callable[[int, torch.nn.Module], None] | None = None) -> dict:
    """Train under one configuration; returns {"history": evaluation rows, "step_seconds": wall time of each
    optimizer step (generation, rewards, reference pass, loss, backward, Adam; evaluation excluded), "trl": TRL's
    own per-step metrics (`TRL_METRICS`)}. `at_evaluation(step, policy)` runs after each evaluation."""
    from transformers import TrainerCallback

    trainer = make_trainer(problem, config, settings)
    history, seconds = [], []

    def evaluate(step: int) -> None:
        if settings.evaluates_at(step):
            history.append(evaluate_policy(problem, trainer.model, step, settings.evaluates_at(step)))
            if progress:
                progress(history[-1])
            if at_evaluation:
                at_evaluation(step, trainer.model)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.start)
            evaluate(state.global_step)

    evaluate(0)
    trainer.add_callback(Clock())
    trainer.train()
    logs = [{k: row[k] for k in TRL_METRICS if k in row} for row in trainer.state.log_history if "reward" in row]
    return {"history": history, "step_seconds": seconds, "trl": logs}


def gradient_variance(problem: LongHorizonProblem, model: torch.nn.Module, configs: list[str], group: int,
                      batches: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per configuration, `trace_stats` of its `training_gradients`: the mean training gradient's norm, the trace of
    its covariance ("trace") and the trace's standard error (jackknife over the groups)."""
    return {config: trace_stats(grads) for config, grads in
            training_gradients(problem, model, configs, group, batches, seed).items()}


def training_gradients(problem: LongHorizonProblem, model: torch.nn.Module, configs: list[str], group: int,
                       batches: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per configuration, [batches, P] float64: the training gradient of each of `batches` groups of `group`
    completions sampled from `model`'s policy (the same groups for every configuration). The gradient is that of the
    trainer's compute_loss with the groups' GRPO advantages (task + KL), divided by TRL's KL scale beta_TRL / (G T)
    (`trl_runner.check_losses`); each configuration gets its own trainer (TRL keeps some settings, beta among them,
    on the trainer itself)."""
    generator = torch.Generator().manual_seed(seed)
    groups: list[Batch] = [batch_of(problem, sample(model, problem, group, generator)) for _ in range(batches)]
    scale = problem.beta * (group - 1) / group / (group * problem.horizon)  # TRL's beta / (G T), as for training
    out = {}
    for config in configs:
        trainer = make_trainer(problem, config, LongSettings(steps=1, group=group))
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.load_state_dict(model.state_dict())  # the policy, in the trainer's own (patched) model
        loss = CheckLoss(trainer, config, overrides={})  # the trainer already holds the configuration
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        grads = []
        for batch in groups:
            g = torch.autograd.grad(loss(trainer.model, batch), params, allow_unused=True)
            grads.append(torch.cat([(torch.zeros_like(p) if x is None else x).flatten().double()
                                    for x, p in zip(g, params)]) / scale)
        out[config] = torch.stack(grads)
    return out


def trace_stats(grads: torch.Tensor) -> dict[str, float]:
    """Mean norm, covariance trace and the trace's jackknife standard error of [n, P] gradient samples."""
    n = grads.shape[0]
    total, squares = grads.sum(0), (grads * grads).sum(1)
    trace = float((squares.sum() - total @ total / n) / (n - 1))
    loo_total = total[None] - grads
    loo = ((squares.sum() - squares) - (loo_total * loo_total).sum(1) / (n - 1)) / (n - 2)
    se = float(((n - 1) / n * ((loo - loo.mean()) ** 2).sum()).sqrt())
    return {"mean_norm": float((total / n).norm()), "trace": trace, "trace_se": se, "batches": n}
