"""verl 0.9.1's real actor loss on the exact toy problem: which KL configuration reaches pi* = argmax E[r] - beta KL?

Usage: .venvs/verl/bin/python bench/demo_verl.py [--long] [--steps N] [--seeds 3] [--group G] [--lr LR] [--beta B]
       [--configs ...] [--workers 2] [--out DIR]   -> DIR/demo_verl_quick.{json,png,txt,log} (--long: demo_verl.*)
(`bash scripts/demo.sh verl` builds .venvs/verl and runs it; the options and output are `kl-adapters demo`'s.)

First the exact gradient check (`kl_adapters.demo.gradient_check`) through the same loss code: `check` below.

Every step `kl_adapters.demo.harness.train` samples G completions from the current policy (a tiny GPT-2), and the loss
function below hands them to verl in the layout its engines use:

    model_output["log_probs"]  the policy's log-probs over every real token, flattened (verl's no-padding layout,
                               which ppo_loss turns back with its own no_padding_2_padding); with gradient
    model_output[EOS_PROB / IS_EOS]  pi(EOS | x_<=j) from the same forward's logits and whether x_{j+1} is EOS, in the
                               same layout: what the adapter's FSDP-engine hook adds to model_output in a real
                               worker (`completions.logps_and_eos`); read only under a reduced preset
    data (TensorDict)          prompts, responses, attention_mask, response_mask, old_log_probs (the sampling policy:
                               on-policy, so PPO's ratio is 1 and its clip never acts), ref_log_prob, advantages
                               (r_i - mean_j r_j on every token), dp_size 1, batch_num_tokens, global_batch_size G

and the harness backpropagates the scalar that **verl.workers.utils.losses.ppo_loss** returns (policy loss "vanilla",
loss_agg_mode "token-mean", use_kl_loss=True, kl_loss_coef = beta (G-1)/G = `harness.kl_coefficient`: under token-mean
verl divides task and KL by the same token count, and the group-mean baseline shrinks the task gradient by (G-1)/G),
then takes an Adam step. ppo_loss is looked up on the module at every call, i.e. whatever the installed kl-adapters
`verl.plugins` entry point left there: the adapter is selected only by verl's own config value
(``kl_loss_type=kl_adapters:sequence``, or ``kl_penalty=kl_adapters:reward`` for the reward path), as a verl user would.

Reward path ("kl_adapters:reward (reward path)"): what verl's RayPPOTrainer.fit does with
algorithm.use_kl_in_reward=True, on a DataProto: ``ray_trainer.apply_kl_penalty(data, FixedKLController(coef),
kl_penalty="kl_adapters:reward")`` then ``ray_trainer.compute_advantage(data, "grpo", norm_adv_by_std_in_grpo=False)``
(GRPO without std scaling = r_i - mean_j r_j, as the harness), then ppo_loss with use_kl_loss=False on those
advantages. The adapter adds -coef * sum_{s>=t} k1_s after the group normalisation; through the token-mean PG loss
this is coef * (G / N_tok) * grad KL_seq in expectation, against (G-1)/N_tok * grad E[r]: the same coef = beta (G-1)/G.

Not exercised: verl's engines (FSDP/Megatron workers, Ray); the log-probs come from the harness's own forward
(`completions.logps_and_eos`), not from verl's engine forward. Runs on CPU (no stubs needed for verl).

The loss itself (`VerlPPOLoss`) takes any `kl_adapters.demo.completions.Completions` batch: prompts of any width,
several prompt groups (verl's uid); bench/task_verl.py runs it on the task benchmark.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kl_adapters.demo.completions import Completions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("KL_ADAPTERS", None)  # only verl's own config names select kl-adapters here
sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

from demo_common import main as demo_main  # noqa: E402

NAME, FRAMEWORK, BASELINE = "demo_verl", "verl 0.9.1 ppo_loss", "verl-default"
#: name -> (path, verl estimator name, description); path "loss": actor.use_kl_loss, "reward": use_kl_in_reward
SPECS: dict[str, tuple[str | None, str | None, str]] = {
    "verl-default": ("loss", "low_var_kl", "actor.kl_loss_type=low_var_kl (verl's default, k3) in ppo_loss"),
    "k3+": ("loss", "k3+", "actor.kl_loss_type=k3+ (verl's straight-through k2-gradient fix) in ppo_loss"),
    "kl_adapters:sequence": ("loss", "kl_adapters:sequence", "actor.kl_loss_type=kl_adapters:sequence in ppo_loss"),
    "kl_adapters:sequence-plain": ("loss", "kl_adapters:sequence-plain",
                                   "actor.kl_loss_type=kl_adapters:sequence-plain (without the variance reductions)"),
    "kl_adapters:reward (reward path)": ("reward", "kl_adapters:reward",
                                         "algorithm.kl_penalty=kl_adapters:reward: apply_kl_penalty + compute_advantage"
                                         "(grpo, no std) + ppo_loss without KL loss"),
    "beta=0": (None, None, "actor.use_kl_loss=False (no KL term)"),
}
CONFIGS = {k: v[2] for k, v in SPECS.items()}
_KEEP = ("kl_loss", "kl_coef", "actor/pg_loss", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff")


class VerlPPOLoss:
    """The scalar of verl's ppo_loss for one configuration on a `completions.Completions` batch (any prompt width,
    several prompt groups: verl's ``uid``); per-step verl metrics in `.metrics`.

    group: verl's rollout_n (completions per prompt); rows: the sequences of one optimizer step (one mini-batch, one
    micro-batch); coef: kl_loss_coef (algorithm.kl_ctrl.kl_coef on the reward path); normalized: whether the
    advantages are GRPO's std-normalised ones (norm_adv_by_std_in_grpo, what the driver tells the adapter's workers:
    `_driver_env`). `VerlLoss` is the toy problem's, bench/task_verl.py's `TaskVerlLoss` the task's."""

    def __init__(self, config: str, *, group: int, rows: int, coef: float, eos_id: int, normalized: bool):
        from verl.workers.config import ActorConfig

        (self.path, self.estimator, _) = SPECS[config]
        self.coef, self.eos_id, self.normalized = coef, eos_id, normalized
        self.actor = ActorConfig(
            strategy="fsdp", rollout_n=group, ppo_mini_batch_size=rows // group, ppo_micro_batch_size_per_gpu=rows,
            use_kl_loss=self.path == "loss", kl_loss_type=self.estimator if self.path == "loss" else "low_var_kl",
            kl_loss_coef=self.coef if self.path == "loss" else 0.0, loss_agg_mode="token-mean")
        assert self.actor.policy_loss.loss_mode == "vanilla" and self.actor.clip_ratio == 0.2
        if self.path == "reward":
            from verl.trainer.ppo.core_algos import FixedKLController

            self.kl_ctrl = FixedKLController(kl_coef=self.coef)  # algorithm.kl_ctrl.type=fixed
        self.metrics: list[dict[str, float]] = []
        self.non_tensor: dict = {}  # further non-tensor entries of the batch (bench/kl_budget.py: the budget's beta)

    def __call__(self, model, batch: Completions):
        import torch.nn.functional as F
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils import losses

        from kl_adapters.adapters.verl import EOS_PROB, IS_EOS
        from kl_adapters.demo.completions import logps_and_eos

        mask, attention = batch.mask, batch.attention_mask
        tokens = {"prompts": batch.prompts, "responses": batch.tokens, "attention_mask": attention,
                  "response_mask": mask.long()}
        # [B, T], 0 at padding; as flat: the value at every real position j (x_{j+1} given x_<=j), 0 at the last
        # (the prompt's last token predicts the first response token: column P - 1)
        logp, eos_prob, is_eos = logps_and_eos(model, batch, self.eos_id)
        left = batch.prompts.shape[1] - 1
        flat = {key: F.pad(x, (left, 1))[attention.bool()]
                for key, x in (("log_probs", logp), (EOS_PROB, eos_prob), (IS_EOS, is_eos))}
        step: dict[str, float] = {}
        if self.path == "reward":
            advantages, step = self._reward_path(batch, tokens)
        else:
            advantages = batch.advantages[:, None] * mask
        data = tu.get_tensordict(
            {**tokens, "old_log_probs": batch.old_logp, "ref_log_prob": batch.ref_logp, "advantages": advantages},
            non_tensor_dict={"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0],
                             **self.non_tensor})
        if batch.groups is not None:
            data["uid"] = list(uids(batch))
        with _driver_env(self.normalized):
            loss, metrics = losses.ppo_loss(self.actor, flat, data)
        for key, value in metrics.items():
            if key in _KEEP or key.startswith("kl_adapters/"):
                step[key] = float(value.aggregate() if hasattr(value, "aggregate") else value)
        self.metrics.append(step)
        return loss

    def _reward_path(self, batch, tokens):
        import torch
        from verl.trainer.ppo import ray_trainer

        data = outcome_proto(batch, {"response_mask": tokens["response_mask"], "responses": tokens["responses"],
                                     "attention_mask": tokens["attention_mask"], "old_log_probs": batch.old_logp,
                                     "ref_log_prob": batch.ref_logp, "token_level_scores": outcome_scores(batch)})
        data, metrics = ray_trainer.apply_kl_penalty(data, kl_ctrl=self.kl_ctrl, kl_penalty=self.estimator)
        advantages = grpo_advantages(data, self.normalized).to(torch.float32)
        return advantages, {k: float(v) for k, v in metrics.items()}


class VerlLoss(VerlPPOLoss):
    """harness.LossFn: `VerlPPOLoss` on the toy problem's groups (one prompt of G completions, advantages
    r_i - mean_j r_j: grpo without std), kl_loss_coef = `harness.kl_coefficient` (module docstring)."""

    def __init__(self, problem, config: str, group: int):
        from kl_adapters.demo.harness import kl_coefficient

        super().__init__(config, group=group, rows=group, coef=kl_coefficient(problem, group), eos_id=problem.eos_id,
                         normalized=False)

    def __call__(self, model, batch):
        from kl_adapters.demo.harness import of_toy

        return super().__call__(model, of_toy(batch))


def uids(batch: Completions):
    """verl's ``uid`` column of a batch: one string per prompt group ("prompt0" for all rows without groups)."""
    import numpy as np

    groups = [0] * batch.mask.shape[0] if batch.groups is None else batch.groups.tolist()
    return np.array([f"prompt{g}" for g in groups], dtype=object)


def outcome_scores(batch: Completions):
    """[B, T] each row's reward at its response's last token (verl's token_level_scores of an outcome reward)."""
    mask = batch.mask
    return batch.rewards[:, None] * (mask & (mask.cumsum(-1) == mask.sum(-1, keepdim=True)))


def outcome_proto(batch: Completions, tensors: dict):
    """A verl DataProto of the batch's rows with `tensors` and their ``uid`` (what RayPPOTrainer.fit holds)."""
    from verl import DataProto

    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids(batch)})


def grpo_advantages(data, normalized: bool):
    """[B, T] verl's GRPO advantages of a DataProto (``ray_trainer.compute_advantage(data, "grpo")``, which runs
    core_algos.compute_grpo_outcome_advantage within each uid: (r - mean) / (std + 1e-6) when normalized, else
    r - mean), from its token_level_rewards."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    rows = len(data)
    data = ray_trainer.compute_advantage(data, adv_estimator="grpo", gamma=1.0, lam=1.0, num_repeat=rows,
                                         norm_adv_by_std_in_grpo=normalized,
                                         config=AlgoConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=normalized))
    return data.batch["advantages"]


@contextlib.contextmanager
def _driver_env(normalized: bool):
    """The environment verl's driver gives the actor workers for GRPO advantages (algorithm.adv_estimator=grpo,
    norm_adv_by_std_in_grpo=`normalized`; the toy's: False, r_i - mean_j r_j): the adapter's ADVANTAGES_ENV,
    "shifted" or "normalized" (its runtime_env addition; the workers see no algorithm config). Restored afterwards."""
    from kl_adapters.adapters.verl import ADVANTAGES_ENV, advantage_scaling

    before = os.environ.get(ADVANTAGES_ENV)
    os.environ[ADVANTAGES_ENV] = advantage_scaling("grpo", norm_adv_by_std_in_grpo=normalized)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ADVANTAGES_ENV)
        else:
            os.environ[ADVANTAGES_ENV] = before


def run(problem, config: str, seed: int, settings) -> tuple[list[dict], list[dict]]:
    """One (configuration, seed) run: exact metrics after 0..steps steps, and verl's loss metrics of each step."""
    warnings.filterwarnings("ignore")
    from kl_adapters.demo.harness import train

    loss = VerlLoss(problem, config, settings.group)
    history = train(problem, loss, seed=seed, steps=settings.steps, group=settings.group,
                    learning_rate=settings.learning_rate, hidden=settings.hidden)
    return history, loss.metrics


def check(problem, configs: list[str]):
    """`gradient_check.check`'s inputs: a VerlLoss per configuration (G = 2), the seed-0 policy, and the KL scale of
    a token-mean loss, grad = kl_coefficient / N_tok * sum_rows g (tests/verl/test_demo_runner.py's identities)."""
    import functools

    from kl_adapters.demo.gradient_check import batch_rows
    from kl_adapters.demo.harness import kl_coefficient

    coef = kl_coefficient(problem, 2)
    losses = {c: (functools.partial(VerlLoss, problem, c, 2), batch_rows(_preset(SPECS[c][1]))) for c in configs}
    return problem.model(0), losses, lambda batch: coef / float(batch.completion_mask.sum())


def _preset(estimator: str | None) -> str | None:
    return estimator.removeprefix("kl_adapters:") if estimator and estimator.startswith("kl_adapters:") else None


if __name__ == "__main__":
    raise SystemExit(demo_main(name=NAME, framework=FRAMEWORK, run=run, configs=CONFIGS, baseline=BASELINE,
                               notes=__doc__, check=check))
