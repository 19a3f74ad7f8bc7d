"""OpenRLHF adapter (OpenRLHF 0.10.4-0.11.2): exact-gradient KL in the actor loss and the reward, in its Ray actors.

Flag (OpenRLHF's ``--algo.kl.*`` idiom): ``--algo.kl.preset <preset>[:is_clip=<c>]`` on
``python -m kl_adapters.adapters.openrlhf_cli`` (OpenRLHF's ``train_ppo_ray`` plus that one flag, see openrlhf_cli.py),
or ``KL_ADAPTERS=<preset>`` with OpenRLHF's own ``python -m openrlhf.cli.train_ppo_ray``. Either way the driver's
``args.algo.kl.preset`` becomes a `PresetFlag`; OpenRLHF pickles its args into every training actor (PPOTrainer /
TrainingActor, PolicyModelActor, ...), and unpickling the flag activates kl-adapters in that process. Unset:
OpenRLHF runs its own code, bit for bit (the patched functions call the originals).

Loss path (``--algo.kl.use_loss``), in PolicyModelActor, two patches (three hops: flag -> training_step ->
compute_approx_kl):
    ``ActorPPOTrainer.training_step`` is wrapped (not copied): it makes the optimizer-step normalisers and the batch
    available to the KL computation, then runs OpenRLHF's own training_step. Inside it, OpenRLHF calls
    ``compute_approx_kl`` through ppo_actor.py's own binding (``from openrlhf.models.utils import ...``: patching
    openrlhf.models.utils alone is never called), which is replaced: the value stays OpenRLHF's estimator (its ``kl``
    metric), the gradient becomes the preset's. OpenRLHF then adds ``aggregate_loss(kl) * kl_ctl``; the tensor
    returned is built so that this adds, per micro-batch, a gradient of

        beta * dp_size * B_micro / global_batch_size * grad kl_surrogate(logp, ref_logp, mask, preset, old_logp)

    with beta = kl_ctl (``--algo.kl.init_coef`` or the adaptive value) and global_batch_size OpenRLHF's count of
    non-empty sequences in the optimizer step over all dp ranks, divided by gradient accumulation. After DeepSpeed's
    1/gas and dp averaging, one optimizer step's gradient is beta * (1/N_seq) * sum over its N_seq sequences of the
    per-sequence preset term: the KL is aggregated per sequence, not as OpenRLHF's global token mean.
    old_logp is ``experience.action_log_probs``, the rollout-time policy recomputed by the trainer (what PPO's ratio
    uses), so later micro-batches and epochs are importance-weighted exactly (preset "sequence"). The reduced presets'
    statistics are the rows' rollout-wide ones (openrlhf_statistics.py): ``make_experience`` (PPOTrainer) computes
    them from the whole rollout and stores them in each row's info, OpenRLHF's replay buffer carries them into the
    micro-batches, and training_step hands them to kl_term (``statistics=``). Experiences not made by a patched
    make_experience carry none: kl_term then fits them on the micro-batch itself (still exact, noisier).
    Pinned by tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate.

Reward path (default), in the PPOTrainer / TrainingActor (presets "reward" and "reward-plain"):
    ``RemoteExperienceMaker.make_experience`` is wrapped to hand each sample batch's action mask to
    experience_maker.py's binding of ``compute_approx_kl``, which returns k1_t = log pi_old/pi_ref from ``kl_reward``
    (unclamped; OpenRLHF clamps every estimator to [-10, 10]). OpenRLHF's compute_reward makes it the per-token reward
    -kl_coef * k1_t and its returns (gamma = 1) the KL reward-to-go: preset "reward-plain". Preset "reward" then
    replaces each experience's per-token KL by increments d_t whose reward-to-go is the reduced coefficient c_t with
    the rollout-wide statistics (`_reduce_reward_kl`). Either way the PPO gradient at the rollout policy is
    beta * (B / N_tok) * grad kl_surrogate(preset, statistics=the rows'), N_tok being OpenRLHF's token-mean divisor.
    Pinned by tests/openrlhf/test_reward_path.py::test_reward_path_gradient_is_reward_preset.

Metrics: OpenRLHF's ``kl`` and ``logprobs_diff`` keep their meaning and values. Added beside them:
    kl_adapters/seq_kl          per-sequence KL estimate sum_t w_{1:t} k3_t (`sequence_kl`), averaged over samples
    kl_adapters/grad_weight_gap (loss path) sum |c_native - c_preset| / sum |c_preset| over the micro-batch's tokens,
                                c being the per-token gradient weights (`kl_coefficients`) of OpenRLHF's own KL loss
                                (``--algo.kl.estimator`` kN as preset "kN-loss") and of the preset, before
                                aggregation: the live bias signal (as in the TRL and verl adapters); 0 when OpenRLHF's
                                KL gradient would be the preset's token for token.
    kl_adapters/is_ess          (loss path) effective sample size of the micro-batch's per-decision importance weights
                                (`KLTerm.is_ess`: 1 on-policy, towards 1/B as they degenerate), logged per batch.

Settings that would make the flag silently wrong or a no-op raise ValueError (`check_args`); code paths the CPU tests
cannot run (packing, ring attention, DeepSpeed tensor parallelism) raise UnsupportedFrameworkError unless
KL_ADAPTERS_ALLOW_UNTESTED=1. Other OpenRLHF versions are refused by the version guard (versions.TESTED).

Releases (their KL code diffed, not only tested): what differs and where it is handled.
    0.11.1 -> 0.11.2  compute_approx_kl clamps log_ratio at -10 before k3's exp (the value OpenRLHF logs; our gradient
                      never goes through it); --actor.loss_agg_mode is new (`_check_reward_path` reads it with the
                      0.11.1 meaning, token-mean, as default); PolicyLoss returns 5 values (training_step is wrapped,
                      not copied, so its arity does not matter); the reward path promotes rewards to float32 and gains
                      flash_reinforce (the KL reward is float32 already; compute_reward and the returns are unchanged).
    0.11.0 -> 0.11.1  compute_approx_kl gains log_probs_old and unbiased_gradient, and training_step passes them;
                      --algo.kl.unbiased_gradient is new. `_wrap_loss_kl` forwards the release's own call and takes
                      old_logp from the experience on every release; `check_args` reads the flag only where it exists.
    0.10.4 -> 0.11.0  no change to compute_approx_kl, compute_reward, the returns, training_step's KL, aggregate_loss
                      or the replay buffer (the diffs: z3 leaf modules, masked_normalize's keepdim, a dead GSPO line).
    0.10.3 and older  refused even with KL_ADAPTERS_ALLOW_UNTESTED=1 (`_refuse_incompatible`): training_step takes no
                      loss_batch_info and normalises each micro-batch by its own token count (0.10.4 introduced the
                      optimizer-step normalisers, loss_utils.iter_grad_accum_global_norm), so `_loss_term`'s scale
                      would be wrong.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import activation, native
from ..activation import Settings
from ..presets import get_preset
from ..reductions import KLStatistics
from ..surrogate import KLTerm, kl_coefficients, kl_reward, kl_term, sequence_kl
from . import openrlhf_statistics
from ._guard import ALLOW_UNTESTED_ENV, UnsupportedFrameworkError, require_version
from .versions import supported_range
from .openrlhf_cli import FLAG

SEQ_KL = "kl_adapters/seq_kl"
GRAD_WEIGHT_GAP = "kl_adapters/grad_weight_gap"
IS_ESS = "kl_adapters/is_ess"

_PPO_ACTOR = "openrlhf.trainer.ray.ppo_actor"
_EXPERIENCE_MAKER = "openrlhf.trainer.ppo_utils.experience_maker"
_CONFIG = "openrlhf.utils.config"


class PresetFlag(str):
    """The value of ``args.algo.kl.preset``: a plain string to OpenRLHF (logs, wandb, JSON) that carries activation.

    OpenRLHF pickles its args (inside the strategy) into every Ray training actor, on every node; unpickling a
    PresetFlag calls ``kl_adapters.enable`` in that process, which patches OpenRLHF there. No Ray hook or environment
    variable has to reach the workers. Pinned by tests/openrlhf/test_ray.py::test_flag_activates_real_policy_actor.
    """

    def __reduce__(self):
        return (_receive_flag, (str(self),))


def _receive_flag(value: str) -> PresetFlag:
    settings = activation.parse(value)
    if settings is not None:
        activation.enable(settings.preset, is_clip=settings.is_clip)
    return PresetFlag(value)


def check_args(args: Any, settings: Settings) -> None:
    """Refuse OpenRLHF arguments with which ``--algo.kl.preset`` would be silently wrong or a no-op.

    ValueError for conflicts; UnsupportedFrameworkError for code paths the tests do not run (unless
    KL_ADAPTERS_ALLOW_UNTESTED=1, which warns instead).
    """
    kl, flag = args.algo.kl, f"{FLAG} {settings}"
    if get_preset(settings.preset).needs_full_logits:
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
    untested = [name for name, on in (("--ds.packing_samples", args.ds.packing_samples),
                                      ("--ds.ring_attn_size > 1", args.ds.ring_attn_size > 1),
                                      ("--ds.tensor_parallel_size > 1", args.ds.tensor_parallel_size > 1)) if on]
    if untested:
        message = (f"{flag} is not tested with {', '.join(untested)} (they need flash-attn / several GPUs); set "
                   f"{ALLOW_UNTESTED_ENV}=1 to run it anyway")
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise UnsupportedFrameworkError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


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


def _settings(args: Any) -> Settings | None:
    """The flag in OpenRLHF's args wins; absent, the process-wide setting (KL_ADAPTERS / enable) applies."""
    return activation.resolve(getattr(args.algo.kl, "preset", None))


# ---- loss path (PolicyModelActor) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LossStep:
    """What OpenRLHF's training_step knows and its compute_approx_kl call does not."""

    settings: Settings
    experience: Any
    loss_batch_info: dict
    statistics: KLStatistics | None  # the micro-batch rows' rollout-wide statistics (openrlhf_statistics.take)


_loss_step: contextvars.ContextVar[_LossStep | None] = contextvars.ContextVar("kl_adapters_loss_step", default=None)


def _wrap_training_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        settings = _settings(self.args)
        if settings is None or not self.args.algo.kl.use_loss:
            return original(self, experience, kl_ctl, step, loss_batch_info)
        check_args(self.args, settings)
        statistics = openrlhf_statistics.take(experience)  # before OpenRLHF logs experience.info
        if loss_batch_info is None:  # dynamic batching: the call OpenRLHF's training_step makes (ppo_actor.py:273-280)
            loss_batch_info = sys.modules[_PPO_ACTOR].get_loss_batch_info(
                self.strategy, experience.action_mask, replay_buffer=self.replay_buffer, step=step,
                dynamic_batch=self.args.train.dynamic_batch_enable)
        token = _loss_step.set(_LossStep(settings, experience, loss_batch_info, statistics))
        try:
            return original(self, experience, kl_ctl, step, loss_batch_info)
        finally:
            _loss_step.reset(token)

    return training_step


def _wrap_loss_kl(original: Callable) -> Callable:
    # Signature by release: 0.10.4 / 0.11.0 (log_probs, log_probs_base, kl_estimator); 0.11.1+ adds log_probs_old and
    # unbiased_gradient (PR #1309). Calls are forwarded as made and read through the release's own signature.
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_approx_kl(*args, **kwargs):
        step = _loss_step.get()
        if step is None:
            return original(*args, **kwargs)
        with torch.no_grad():
            value = original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        s, experience = step.settings, step.experience
        # old_logp = experience.action_log_probs, the rollout-time policy: what 0.11.1+ pass as log_probs_old
        # (ppo_actor.py: old_action_log_probs) and 0.10.4 / 0.11.0 do not pass at all (their call has no such argument)
        # statistics None (experiences not made by a patched make_experience): kl_term's own, from this micro-batch
        term = kl_term(call.arguments["log_probs"], call.arguments["log_probs_base"], experience.action_mask,
                       preset=s.preset, old_logp=experience.action_log_probs, is_clip=s.is_clip,
                       statistics=step.statistics)
        _log_loss_metrics(step, term, call.arguments["kl_estimator"])
        return value + _loss_term(step, term).to(value.dtype)

    return compute_approx_kl


def _loss_term(step: _LossStep, kl: KLTerm) -> Tensor:
    """A [B, T] tensor of exact zeros whose gradient, through OpenRLHF's KL loss, is the preset's per-sequence term.

    OpenRLHF computes kl_loss = aggregate_loss(kl) = sum(kl * mask) / batch_num_tokens * dp_size and adds
    kl_loss * kl_ctl (ppo_actor.py:331-338). Spreading s = kl_surrogate(...) * B * batch_num_tokens / global_batch_size
    evenly over the micro-batch's real tokens makes that gradient kl_ctl * dp_size * B / global_batch_size * grad
    kl_surrogate, i.e. beta / N_seq per sequence of the optimizer step (see the module docstring). The value is
    s - s.detach() = 0 exactly, so OpenRLHF's ``kl`` metric is unchanged.
    """
    info = step.loss_batch_info
    term = kl.surrogate()
    m = step.experience.action_mask.to(term.dtype)
    n_seq = torch.as_tensor(info["global_batch_size"], dtype=term.dtype, device=term.device)
    n_tok = torch.as_tensor(info["batch_num_tokens"], dtype=term.dtype, device=term.device)
    # an all-empty window has n_tok = n_seq = 0 and no gradient to give: keep 0/0 out of the graph
    scale = kl.logp.shape[0] * n_tok / n_seq.clamp(min=torch.finfo(term.dtype).tiny) / m.sum().clamp(min=1)
    spread = m * (term * scale)
    return spread - spread.detach()


def _log_loss_metrics(step: _LossStep, kl: KLTerm, estimator: str) -> None:
    info = step.experience.info
    info[SEQ_KL] = kl.sequence_kl
    info[IS_ESS] = kl.is_ess
    native_weight = kl.coefficients_of(native.openrlhf_loss(estimator).preset)
    gap, size = (native_weight - kl.coefficients).abs().sum(), kl.coefficients.abs().sum()  # both zero at padding
    info[GRAD_WEIGHT_GAP] = torch.where(size > 0, gap / size.clamp(min=torch.finfo(size.dtype).tiny), 0.0)  # 0-dim


# ---- reward path (PPOTrainer / TrainingActor) ----------------------------------------------------------------------


@dataclass
class _Rollout:
    """make_experience's sample batches, in the order it computes their KL (experience_maker.py: the KL loop), and the
    (log pi_old, log pi_ref) pair of each one the reward KL was computed from."""

    pending: Iterator[Any]
    log_probs: list[tuple[Tensor, Tensor]]


_rollout: contextvars.ContextVar[_Rollout | None] = contextvars.ContextVar("kl_adapters_rollout", default=None)


def _wrap_make_experience(original: Callable) -> Callable:
    @functools.wraps(original)
    def make_experience(self, samples_list):
        settings = _settings(self.args)
        if settings is None:
            return original(self, samples_list)
        check_args(self.args, settings)
        reduced, n_samples = get_preset(settings.preset).uses_batch_statistics, self.args.rollout.n_samples_per_prompt
        if self.args.algo.kl.use_loss:  # loss path: statistics for the actor's micro-batches, carried in info
            experiences = original(self, samples_list)
            if reduced:
                logp = [(e.action_log_probs, e.base_action_log_probs) for e in experiences]
                for e, stats in zip(experiences, openrlhf_statistics.rollout_statistics(
                        experiences, *zip(*logp), n_samples)):
                    openrlhf_statistics.attach(e, stats)
            return experiences
        rollout = _Rollout(iter(samples_list), [])
        token = _rollout.set(rollout)
        try:
            experiences = original(self, samples_list)
        finally:
            _rollout.reset(token)
        if next(rollout.pending, None) is not None or len(rollout.log_probs) != len(experiences):
            raise UnsupportedFrameworkError("OpenRLHF's make_experience computed fewer KLs than it has sample batches; "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        if reduced:
            _reduce_reward_kl(experiences, rollout.log_probs, settings, n_samples)
        return experiences

    return make_experience


def _reduce_reward_kl(experiences: list, log_probs: list[tuple[Tensor, Tensor]], settings: Settings,
                      n_samples: int) -> None:
    """Replace each experience's per-token KL (k1, from `_wrap_reward_kl`) by rewards whose reward-to-go is the reduced
    preset's coefficient c_t (rollout-wide statistics): compute_reward makes them -kl_coef * d_t and the returns
    (gamma = 1) -kl_coef * c_t, so the PPO gradient at the rollout policy is the reduced preset's. The score's
    baseline (group_norm, rloo, ...) acts on the scalar score only, before the KL is added (experience_maker.py)."""
    all_stats = openrlhf_statistics.rollout_statistics(experiences, *zip(*log_probs), n_samples)
    for e, (logp, ref_logp), stats in zip(experiences, log_probs, all_stats):
        c = kl_coefficients(logp, ref_logp, e.action_mask, preset=settings.preset, statistics=stats)
        e.kl = openrlhf_statistics.reward_increments(c, e.action_mask).to(e.kl.dtype)


def _wrap_reward_kl(original: Callable) -> Callable:
    @functools.wraps(original)
    def compute_approx_kl(log_probs, log_probs_base, *args, **kwargs):  # the rest differs by release (_wrap_loss_kl)
        rollout = _rollout.get()
        if rollout is None:
            return original(log_probs, log_probs_base, *args, **kwargs)
        sample = next(rollout.pending, None)
        if sample is None or sample.action_mask.shape != log_probs.shape:
            raise UnsupportedFrameworkError("OpenRLHF's make_experience computed its KLs in an unexpected order; "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        rollout.log_probs.append((log_probs, log_probs_base))
        sample.info[SEQ_KL] = sequence_kl(log_probs, log_probs_base, sample.action_mask)
        # k1_t (zero at padding, no clamp): compute_reward turns it into the reward -kl_coef * k1_t ("reward-plain");
        # the reduced "reward" replaces it once the whole rollout is known (`_reduce_reward_kl`)
        return (-kl_reward(log_probs, log_probs_base, sample.action_mask, beta=1.0)).float()

    return compute_approx_kl


# ---- hierarchize (the driver's CLI) --------------------------------------------------------------------------------


def _wrap_hierarchize(original: Callable) -> Callable:
    @functools.wraps(original)
    def hierarchize(args):
        nested = original(args)
        kl = getattr(getattr(nested, "algo", None), "kl", None)
        settings = activation.active()
        if kl is not None and settings is not None:
            kl.preset = PresetFlag(str(settings))
            check_args(nested, settings)
        return nested

    return hierarchize


# ---- adapter contract ----------------------------------------------------------------------------------------------

_originals: dict[tuple[object, str], Any] = {}


def _replace(owner: object, name: str, wrap: Callable[[Callable], Callable]) -> None:
    if (owner, name) not in _originals:
        _originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, wrap(_originals[(owner, name)]))


#: the first release whose training_step gets the optimizer-step normalisers (loss_batch_info) this adapter relies on
_FIRST_COMPATIBLE = (0, 10, 4)


def _refuse_incompatible(version: str) -> None:
    """UnsupportedFrameworkError for releases the adapter cannot patch correctly, whatever KL_ADAPTERS_ALLOW_UNTESTED."""
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    if release < _FIRST_COMPATIBLE:
        raise UnsupportedFrameworkError(
            f"openrlhf=={version} cannot be patched: before 0.10.4 ActorPPOTrainer.training_step takes no "
            "loss_batch_info and normalises the loss per micro-batch, so the KL scale kl-adapters sets would be wrong "
            f"(not overridable by {ALLOW_UNTESTED_ENV}); kl-adapters supports {supported_range('openrlhf')}")


def patch(trigger: str) -> None:
    """Patch what OpenRLHF keeps in module `trigger` (idempotent; UnsupportedFrameworkError off versions.TESTED).

    openrlhf.trainer.ray.ppo_actor: ActorPPOTrainer.training_step, its compute_approx_kl binding, and
        openrlhf.utils.config.hierarchize (the CLI's args builder, which then carries the flag into the actors);
    openrlhf.trainer.ppo_utils.experience_maker: RemoteExperienceMaker.make_experience, its compute_approx_kl binding.
    """
    _refuse_incompatible(require_version("openrlhf"))
    module = sys.modules[trigger]
    if trigger == _PPO_ACTOR:
        _replace(module.ActorPPOTrainer, "training_step", _wrap_training_step)
        _replace(module, "compute_approx_kl", _wrap_loss_kl)
        _replace(importlib.import_module(_CONFIG), "hierarchize", _wrap_hierarchize)
    elif trigger == _EXPERIENCE_MAKER:
        _replace(module.RemoteExperienceMaker, "make_experience", _wrap_make_experience)
        _replace(module, "compute_approx_kl", _wrap_reward_kl)
    else:
        raise ValueError(f"{trigger!r} is not an OpenRLHF module kl-adapters patches ({_PPO_ACTOR} or "
                         f"{_EXPERIENCE_MAKER})")


def unpatch() -> None:
    """Restore every original OpenRLHF function."""
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def patched() -> list[str]:
    """The OpenRLHF attributes currently replaced, as 'owner.name' (for checks inside Ray actors)."""
    return sorted(f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in _originals)
