"""Test helpers of the OpenRLHF suite (tests only): OpenRLHF's real command-line parsing, the argument vector of a
small run, and the loss-path setup shared by test_loss_path.py and upstream_patch_probe.py."""

from __future__ import annotations

import importlib.metadata
import runpy
import sys
from typing import Any, NamedTuple

from packaging.version import Version

#: --algo.kl.unbiased_gradient (PR #1309) exists from OpenRLHF 0.11.1 on
HAS_UNBIASED_GRADIENT = Version(importlib.metadata.version("openrlhf")) >= Version("0.11.1")
#: --actor.loss_agg_mode exists from OpenRLHF 0.11.2 on
HAS_LOSS_AGG_MODE = Version(importlib.metadata.version("openrlhf")) >= Version("0.11.2")
#: train_ppo_ray flags the suite passes that older supported releases lack -> (the release that added it, installed)
LATER_FLAGS = {"--algo.kl.unbiased_gradient": ("0.11.1", HAS_UNBIASED_GRADIENT),
               "--actor.loss_agg_mode": ("0.11.2", HAS_LOSS_AGG_MODE)}


def lacking(argv: list[str]) -> list[str]:
    """The flags in argv that the installed OpenRLHF release does not have yet (its parser refuses them)."""
    return [a for a in argv if a in LATER_FLAGS and not LATER_FLAGS[a][1]]


def param_for_release(argv: list[str], *values):
    """pytest.param(argv, *values), skipped where the installed release lacks one of argv's flags (the reason names
    the release that added it)."""
    import pytest

    missing = lacking(argv)
    reason = "; ".join(f"{flag} arrived in OpenRLHF {LATER_FLAGS[flag][0]}" for flag in missing)
    return pytest.param(argv, *values, marks=pytest.mark.skipif(bool(missing), reason=reason or "-"))

#: the loss-path run: kl_ctl (0.5: over the step's token count, about the mean response length 37/8 times the 0.1 the
#: suite weighed the KL per sequence with, so the KL part keeps its share of the gradient), micro-batch size, gradient
#: accumulation, response lengths of the 8 ragged sequences (the shorter ones end with EOS), GRPO group size (>= 3: a
#: row's statistics need two other rows of its group), horizon
BETA, MICRO, GAS = 0.5, 2, 2
RESPONSES = [6, 3, 5, 6, 2, 6, 4, 5]
GROUP, MAX_NEW_TOKENS = 4, 6


def base_argv(model_dir: str) -> list[str]:
    """train_ppo_ray arguments of a 1-GPU group_norm run (2 prompts x 4 samples) with the KL as a k3 loss (init_coef
    BETA)."""
    return ["--actor.model_name_or_path", model_dir, "--reward.remote_url", "http://127.0.0.1:1",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(GROUP),
            "--rollout.batch_size", "2", "--rollout.micro_batch_size", "4", "--actor.num_gpus_per_node", "1",
            "--ref.num_gpus_per_node", "1", "--train.micro_batch_size", "2", "--train.batch_size", "4",
            "--train.max_epochs", "2", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--algo.kl.init_coef", str(BETA), "--ds.attn_implementation", "eager",
            "--rollout.max_new_tokens", str(MAX_NEW_TOKENS)]


class _Parsed(Exception):
    pass


def cli_args(argv: list[str], *, wrapper: bool = False):
    """OpenRLHF's real argument parsing and validation (train_ppo_ray run as __main__), stopped where train() builds
    its strategy; wrapper=True goes through `python -m kl_adapters.adapters.openrlhf_cli` instead."""
    import ray

    import openrlhf.utils

    def capture(args):
        raise _Parsed(args)

    saved = openrlhf.utils.get_strategy, ray.is_initialized, sys.argv
    openrlhf.utils.get_strategy, ray.is_initialized = capture, (lambda: True)
    try:
        if wrapper:
            from kl_adapters.adapters import openrlhf_cli

            openrlhf_cli.main(argv)
        else:
            sys.argv = ["train_ppo_ray", *argv]
            runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        openrlhf.utils.get_strategy, ray.is_initialized, sys.argv = saved
    raise AssertionError("train_ppo_ray did not reach get_strategy")


def build_trainer(args, actor, *, micro_batch: int, gas: int, lr: float = 0.5, device: int | str = "cpu",
                  record: bool = True):
    """OpenRLHF's ActorPPOTrainer around `actor` with the CPU strategy shim (gas micro-batches per optimizer step).

    device "cpu": torch.cuda.current_device() (cpu_cuda shim) is 0 while the replay buffer is built, then "cpu", where
    ppo_train moves its batches; "cuda": left alone (a real GPU)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_cpu_shim import CPUStrategy, set_current_device

    strategy = CPUStrategy(args, accumulated_gradient=gas, lr=lr, record=record)
    _, optimizer, scheduler = strategy.prepare((actor, None))
    if device == "cpu":
        set_current_device(0)
    trainer = ppo_actor.ActorPPOTrainer(strategy, actor, None, optimizer, scheduler, micro_train_batch_size=micro_batch,
                                        dataloader_pin_memory=False)
    if device == "cpu":
        set_current_device("cpu")
    return trainer


def record_steps(trainer) -> list:
    """Record (experience, loss_batch_info) of every training_step call ppo_train makes, in order."""
    calls = []

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        calls.append((experience, loss_batch_info))
        return type(trainer).training_step(trainer, experience, kl_ctl, step, loss_batch_info)

    trainer.training_step = training_step
    return calls


def probe(actor) -> dict:
    """Run inside a Ray actor (``handle.__ray_call__.remote(probe)``): kl-adapters' state in that process."""
    import os

    from kl_adapters import activation

    adapter = sys.modules.get("kl_adapters.adapters.openrlhf")
    settings = activation.active()
    return {"pid": os.getpid(), "active": None if settings is None else str(settings),
            "patched": adapter.patched() if adapter else [], "env": os.environ.get("KL_ADAPTERS")}


def use_cpu_device(actor) -> None:
    """Run inside a PolicyModelActor after init_model_from_pretrained: ppo_train then moves batches to "cpu"."""
    from openrlhf_cpu_shim import set_current_device

    set_current_device("cpu")


def loss_path_batch(actor_dir: str, ref_dir: str, behaviour_scale: float = 0.05) -> dict:
    """8 ragged sequences (those shorter than the longest end with EOS) with behaviour log-probs from a perturbed policy
    (off-policy from the first step on), the reference's log-probs and nonzero advantages: the Experience fields of the
    loss-path run, and under "rollout_eos" the behaviour policy's `softmax_eos` (what its rollout forward carries).
    behaviour_scale: the perturbation's standard deviation (`perturbed`); the log importance weights it gives grow
    with the model's width (measured at hidden 2048: 0.05 gives per-sequence log weights up to 15, 0.001 within 0.5)."""
    import torch
    from openrlhf_cpu_shim import EOS, load_actor, perturbed, random_batch

    actor, ref = load_actor(actor_dir), load_actor(ref_dir)
    behaviour = perturbed(actor, behaviour_scale, seed=3)
    sequences, attention_mask, action_mask = random_batch(len(RESPONSES), 4, RESPONSES, seed=0)
    for b, n in enumerate(RESPONSES):
        if n < max(RESPONSES):
            sequences[b, 4 + n - 1] = EOS
    with torch.no_grad():
        old = behaviour(sequences, action_mask, attention_mask=attention_mask)
        base = ref(sequences, action_mask, attention_mask=attention_mask)
    advantages = 0.3 * torch.randn(action_mask.shape, generator=torch.Generator().manual_seed(4)) * action_mask
    return dict(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, action_log_probs=old,
                base_action_log_probs=base, advantages=advantages,
                rollout_eos=softmax_eos(behaviour, sequences, attention_mask, action_mask))


def experience_fields(batch: dict) -> dict:
    """The batch's Experience fields (without the behaviour policy's EOS payload)."""
    return {k: v for k, v in batch.items() if k != "rollout_eos"}


class Eos(NamedTuple):
    """pi(EOS | y_<t) and y_t == EOS, [B, T] each at the action columns (the fields of the adapter's EosPayload)."""

    prob: Any
    is_eos: Any


def softmax_eos(actor, sequences, attention_mask, action_mask) -> Eos:
    """The end-of-sequence probabilities of an OpenRLHF Actor on a batch, computed apart from the adapter: softmax of a
    separate forward of its Hugging Face model (logits / the actor's temperature) at the EOS id, at the action columns;
    y_t == EOS."""
    import torch
    from openrlhf_cpu_shim import EOS

    width = action_mask.shape[1]
    with torch.no_grad():
        logits = actor.model(sequences, attention_mask=attention_mask).logits.float() / actor.temperature
    real = action_mask.bool()
    prob = torch.softmax(logits, -1)[..., EOS][:, :-1][:, -width:]
    return Eos(torch.where(real, prob, 0.0), (sequences[:, -width:] == EOS) & real)


def batch_statistics(batch: dict, n_samples_per_prompt: int = GROUP):
    """The rollout-wide statistics the loss path attaches (the adapter's own code), for the batch as one sample batch at
    rollout positions 0..7 (GRPO groups of n_samples_per_prompt), fitted with its advantages (group_norm: normalized,
    beta = BETA: token-mean, the KL sharing the policy loss's normaliser) and its behaviour policy's EOS payload."""
    from types import SimpleNamespace

    from kl_adapters.adapters.openrlhf.eos_payload import EosPayload
    from kl_adapters.adapters.openrlhf.statistics import RolloutTask, rollout_statistics

    rollout = SimpleNamespace(action_mask=batch["action_mask"], index=list(range(len(RESPONSES))))
    task = RolloutTask([batch["advantages"]], BETA, True)
    return rollout_statistics([rollout], [batch["action_log_probs"]], [batch["base_action_log_probs"]],
                              n_samples_per_prompt, task=task, eos=[EosPayload(*batch["rollout_eos"])],
                              horizon=MAX_NEW_TOKENS)[0]


def ppo_train_on(args, actor_dir: str, batch: dict, *, mesh=None, device: str = "cpu", statistics=None):
    """OpenRLHF's ppo_train on the batch (micro-batches of MICRO, GAS per optimizer step): (trainer, recorded
    (experience, loss_batch_info) per training step, status); the strategy shim logs every step's gradient.
    statistics: the batch's rollout-wide KLStatistics, attached to its info as make_experience does."""
    import torch
    from openrlhf_cpu_shim import load_actor

    from kl_adapters.adapters.openrlhf.statistics import attach
    from openrlhf.trainer.ppo_utils.experience import Experience

    trainer = build_trainer(args, load_actor(actor_dir).to(device), micro_batch=MICRO, gas=GAS, device=device)
    trainer.strategy.ds_device_mesh = mesh
    steps = record_steps(trainer)
    experience = Experience(**{k: v.clone() for k, v in experience_fields(batch).items()},
                            total_length=batch["attention_mask"].sum(-1), index=list(range(len(RESPONSES))), info={})
    if statistics is not None:
        attach(experience, statistics)
    trainer.replay_buffer.append(experience)
    torch.manual_seed(0)  # ppo_train shuffles the replay buffer
    status = trainer.ppo_train(kl_ctl=BETA)
    return trainer, steps, status


def load_params(actor_dir: str, params: dict):
    """The actor with the parameters a strategy logged (on their device): its trained ones (a LoRA actor's frozen base
    is the saved model's)."""
    import torch
    from openrlhf_cpu_shim import load_actor

    model = load_actor(actor_dir).to(next(iter(params.values())).device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(params[name])
    return model


def rows_of(batch: dict, exp) -> list[int]:
    """The batch row of each row of a micro-batch OpenRLHF built from it (matched by token ids, padding aside)."""
    import torch

    width = exp.sequences.shape[1]
    full = torch.nn.functional.pad(batch["sequences"], (0, max(width - batch["sequences"].shape[1], 0)))[:, :width]
    return [int((full == row.to(full.device)).all(-1).nonzero().squeeze()) for row in exp.sequences]


def rows_statistics(batch: dict, statistics, exp):
    """The KLStatistics rows of a micro-batch's sequences (`rows_of`), on its device, at its width."""
    rows, device, width = rows_of(batch, exp), exp.action_mask.device, exp.action_mask.shape[1]
    return statistics[rows].with_width(width).to(device)


def align_row(x, mask):
    """Row-wise, apart from the adapter: each row's entries from its first action token (mask) on, zero-padded."""
    import torch
    import torch.nn.functional as F

    firsts = [int(m.nonzero()[0]) if m.any() else 0 for m in mask]
    return torch.stack([F.pad(row[first:], (0, first)) for row, first in zip(x, firsts)])


#: the KL divisor D of `reference_grad`, from the optimizer step's token and non-empty sequence counts: the adapter's
#: per PolicyLoss aggregation (the policy loss's own normaliser), and the upstream patch's per-sequence mean
DIVISORS = {"token-mean": lambda tokens, sequences: tokens,
            "seq-mean-token-mean": lambda tokens, sequences: sequences * MAX_NEW_TOKENS,
            "sequence": lambda tokens, sequences: sequences}


def reference_grad(model, window, trainer, settings, beta: float, gas: int = GAS, statistics=None,
                   divisor: str = "token-mean"):
    """grad of  sum_micro PolicyLoss / gas  +  beta / D * sum over the step's sequences of kl_surrogate(seq).

    The KL part is computed one sequence at a time (B = 1), so its divisor D (`DIVISORS[divisor]`: N_tok, N_seq x the
    horizon, or N_seq) is counted here from the step's tokens and non-empty sequences, not taken from OpenRLHF's
    normalisers. `settings`: the preset and is_clip. statistics:
    (batch, its KLStatistics) -- each sequence's kl_surrogate gets its own row's statistics and EndOfSequence (the
    current parameters' `softmax_eos`), on its tokens from its response's start (`align_row`; the statistics are in
    those positions); None: the B = 1 form (presets without batch statistics)."""
    import torch

    from kl_adapters import kl_surrogate

    def kl_of(exp, logp, b):
        rows = slice(b, b + 1)
        m = exp.action_mask[rows]
        a = lambda x: align_row(x[rows], m)  # noqa: E731
        extra = {}
        if statistics is not None:
            from kl_adapters import EndOfSequence

            eos = softmax_eos(model, exp.sequences, exp.attention_mask, exp.action_mask)
            extra = dict(statistics=rows_statistics(*statistics, exp)[rows],
                         eos=EndOfSequence(a(eos.prob), a(eos.is_eos), max(MAX_NEW_TOKENS, m.shape[1])))
        return kl_surrogate(a(logp), a(exp.base_action_log_probs), a(exp.action_mask), preset=settings.preset,
                            old_logp=a(exp.action_log_probs), is_clip=settings.is_clip, **extra)

    task, per_sequence, tokens = 0.0, [], 0
    for exp, info in window:
        tokens += int(exp.action_mask.sum())
        logp = model(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
        task = task + trainer.actor_loss_fn(logp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask,
                                            **info)[0] / gas
        per_sequence += [kl_of(exp, logp, b) for b in range(len(logp)) if exp.action_mask[b].any()]
    loss = task + beta * torch.stack(per_sequence).sum() / DIVISORS[divisor](tokens, len(per_sequence))
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: its adapters
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, trained)])
