"""OpenRLHF adapter, the flag: ``--algo.kl.preset`` / ``--algo.kl.seq_target`` (the launcher, cli.py) or KL_ADAPTERS,
carried into every Ray actor by OpenRLHF's own args (`PresetFlag`), and the refusals of arguments with which it would
be silently wrong or a no-op (`check_args`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ... import activation
from ...activation import Settings
from ...budget import check_budget_preset
from .._guard import refuse_untested_path

FLAG = "--algo.kl.preset"
TARGET_FLAG = "--algo.kl.seq_target"


class PresetFlag(str):
    """The value of ``args.algo.kl.preset``: a plain string to OpenRLHF (logs, wandb, JSON) that carries activation.

    Set by the launcher's ``--algo.kl.preset`` (``python -m kl_adapters.adapters.openrlhf_cli``: OpenRLHF's
    ``train_ppo_ray`` plus that one flag, see cli.py) or from ``KL_ADAPTERS`` with OpenRLHF's own
    ``python -m openrlhf.cli.train_ppo_ray`` (`_wrap_hierarchize`). OpenRLHF pickles its args (inside the strategy)
    into every Ray training actor (PPOTrainer / TrainingActor, PolicyModelActor, ...), on every node; unpickling a
    PresetFlag calls ``kl_adapters.enable`` in that process, which patches OpenRLHF there. No Ray hook or environment
    variable has to reach the workers. Pinned by tests/openrlhf/test_ray.py::test_flag_activates_real_policy_actor.
    """

    def __reduce__(self):
        return (_receive_flag, (str(self),))


def _receive_flag(value: str) -> PresetFlag:
    settings = activation.parse(value, setting=FLAG)
    if settings is not None:
        activation.enable(settings.preset, is_clip=settings.is_clip, kl_target=settings.kl_target)
    return PresetFlag(value)


def check_args(args: Any, settings: Settings) -> None:
    """Refuse OpenRLHF arguments with which ``--algo.kl.preset`` would be silently wrong or a no-op.

    ValueError for conflicts; UnsupportedFrameworkError for a code path the CPU tests cannot run (DeepSpeed tensor
    parallelism) unless KL_ADAPTERS_ALLOW_UNTESTED=1, which warns instead. Ring attention (--ds.ring_attn_size > 1)
    is accepted: tests/openrlhf/test_ring_attention.py runs it. Other OpenRLHF versions are refused by the version
    guard (versions.TESTED, `patch`).
    """
    kl, flag = args.algo.kl, f"{FLAG} {settings}"
    if settings.spec.needs_full_logits:
        raise ValueError(f"{flag} needs the full next-token distributions of the policy and the reference in the "
                         "actor's loss; OpenRLHF's reference model runs as a separate Ray actor that returns only the "
                         "sampled tokens' log-probs (base_action_log_probs), so kl-adapters cannot compute it in "
                         "OpenRLHF. Use --algo.kl.preset sequence, or TRL's GRPOTrainer with kl_preset='full'.")
    # --algo.kl.unbiased_gradient arrived in 0.11.1 (PR #1309); 0.10.4 / 0.11.0 args have no such attribute
    if getattr(kl, "unbiased_gradient", False):
        raise ValueError(f"{flag} and --algo.kl.unbiased_gradient both choose the KL gradient; drop one (preset "
                         "'token:is_clip=10' is what unbiased_gradient computes)")
    if not kl.init_coef > 0:
        raise ValueError(f"{flag} with --algo.kl.init_coef {kl.init_coef}: OpenRLHF then computes no KL and builds no "
                         "reference model, so the preset would be a silent no-op; set init_coef > 0 or drop the flag")
    if not kl.use_loss:
        _check_reward_path(args, settings, flag)
    if settings.kl_target is not None:
        _check_budget(args, settings, flag)
    if args.ds.tensor_parallel_size > 1:
        refuse_untested_path(f"{flag} is not tested with --ds.tensor_parallel_size > 1 (it needs several GPUs)")


def _apply(args: Any, settings: Settings) -> None:
    """`check_args`, then the process's activation line (`activation.announce`): where the adapter is about to apply
    `settings` (the driver's argument parsing, the single controller's rollout, the actor's training step)."""
    check_args(args, settings)
    activation.announce("openrlhf", "loss" if args.algo.kl.use_loss else "reward", settings)


def _check_reward_path(args: Any, settings: Settings, flag: str) -> None:
    kl, adv = args.algo.kl, args.algo.advantage
    if settings.preset not in ("reward", "reward-plain"):
        raise ValueError(f"{flag}: without --algo.kl.use_loss OpenRLHF puts the KL in the reward, where only presets "
                         "'reward' / 'reward-plain' apply; add --algo.kl.use_loss to use this preset as the KL loss")
    if settings.is_clip is not None:
        raise ValueError(f"{flag}: is_clip caps the importance weights of a KL loss; on the reward path the KL reward "
                         "is weighted by PPO's own ratio, so is_clip would be a silent no-op")
    if kl.estimator != "k1":
        raise ValueError(f"{flag} puts k1 in the reward; --algo.kl.estimator {kl.estimator} would be silently "
                         "ignored: use k1 (OpenRLHF's default)")
    if adv.estimator in ("gae", "reinforce") and adv.gamma != 1:
        raise ValueError(f"{flag} with --algo.advantage.gamma {adv.gamma}: a discounted KL reward-to-go is not the "
                         "gradient of the sequence KL; use gamma 1 (the default)")
    # --actor.loss_agg_mode arrived in 0.11.2; before it PolicyLoss is token-mean unless gspo forces sequence mode
    if getattr(args.actor, "loss_agg_mode", "token-mean") != "token-mean" or args.actor.policy_loss_type == "gspo":
        raise ValueError(f"{flag}: --actor.loss_agg_mode seq-mean-token-mean (forced by gspo) divides each sequence's "
                         "KL reward-to-go by its length, which optimizes a length-normalized KL; use token-mean ppo")


def _check_budget(args: Any, settings: Settings, flag: str) -> None:
    """Refuse a kl_target that cannot do what it says: OpenRLHF's own adaptive controller on the same beta
    (--algo.kl.target), or a preset whose gradient is not the sequence KL's for these batches (the loss path is
    off-policy with several epochs or optimizer steps per rollout; `budget.check_budget_preset`)."""
    kl = args.algo.kl
    if kl.target:
        raise ValueError(f"{flag} and --algo.kl.target {kl.target} would both set beta (OpenRLHF's adaptive "
                         "controller targets a per-token KL): drop --algo.kl.target")
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    off_policy = kl.use_loss and (args.train.max_epochs > 1 or args.train.batch_size < samples)
    check_budget_preset(settings.spec, settings.is_clip, off_policy=off_policy, name=f"{flag}: kl_target")


def _settings(args: Any) -> Settings | None:
    """The flag in OpenRLHF's args wins; absent, the process-wide setting (KL_ADAPTERS / enable) applies."""
    return activation.resolve(getattr(args.algo.kl, "preset", None), setting=FLAG)


def _wrap_hierarchize(original: Callable) -> Callable:
    @functools.wraps(original)
    def hierarchize(args):
        nested = original(args)
        kl = getattr(getattr(nested, "algo", None), "kl", None)
        settings = activation.active()
        if kl is not None and settings is not None:
            kl.preset = PresetFlag(str(settings))
            _apply(nested, settings)
        return nested

    return hierarchize
