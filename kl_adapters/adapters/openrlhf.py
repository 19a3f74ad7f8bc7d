"""OpenRLHF adapter (OpenRLHF 0.10.4-0.11.2): exact-gradient KL in the actor loss and the reward, in its Ray actors.

Flag: ``--algo.kl.preset <preset>[:is_clip=<c>]`` on ``python -m kl_adapters.adapters.openrlhf_cli`` (OpenRLHF's
``train_ppo_ray`` plus that one flag), or ``KL_ADAPTERS=<preset>`` with OpenRLHF's own ``train_ppo_ray``; the driver's
``args.algo.kl.preset`` becomes a `PresetFlag`, whose unpickling activates kl-adapters in every training actor. Unset:
OpenRLHF runs its own code, bit for bit (the patched functions call the originals). Refusals: `check_args`; releases
and what differs between them: `patch`.

What is patched, at the narrowest points (`SITES`, installed by `patch` through the shared `patching`; wrappers, no copied
code):
    loss path (PolicyModelActor): ``ActorPPOTrainer.training_step`` (`_wrap_training_step`: hands the KL the batch
        and the optimizer step's normalisers) and ppo_actor.py's binding of ``compute_approx_kl`` (`_wrap_loss_kl`:
        value OpenRLHF's, gradient the preset's)
    rollout statistics (PPOTrainer / TrainingActor): ``RemoteExperienceMaker.compute_advantages_and_returns``
        (`_wrap_compute_advantages`: fits them once OpenRLHF has made the advantages)
    reward path (PPOTrainer / TrainingActor): ``RemoteExperienceMaker.make_experience`` (`_wrap_make_experience`) and
        experience_maker.py's binding of ``compute_approx_kl`` (`_wrap_reward_kl`: unclamped k1)
    pi(EOS | y_<t): ``Actor.forward`` and actor.py's binding of ``log_probs_from_logits`` (`_wrap_actor_forward`,
        `_wrap_log_probs_from_logits`): read from the policy forward OpenRLHF already runs
    KL budget: ``BasePPOTrainer.train_step``, ``save_logs_and_checkpoints``, ``init_checkpoint_states``
        (`_wrap_train_step`); driver: ``openrlhf.utils.config.hierarchize`` (`_wrap_hierarchize`)

Math. Loss path (`_loss_term`): OpenRLHF adds ``aggregate_loss(kl) * kl_ctl``; the returned term makes one optimizer
step's gradient beta * (1/N_seq) * sum over its N_seq sequences of grad kl_surrogate(logp, ref_logp, mask, preset,
old_logp), beta = kl_ctl, old_logp = ``experience.action_log_probs``: the KL aggregated per sequence. Reward path
(`_wrap_make_experience`): k1 in the reward and returns with gamma = 1 give the PPO gradient at the rollout policy
beta * (B / N_tok) * grad kl_surrogate(preset, statistics=the rows', eos=the rollout policy's). The reduced presets'
statistics are leave-one-out over the whole rollout (exact), fitted with OpenRLHF's advantages (`_loss_task`) or
scores (`_reward_task`) and the rollout forward's pi(EOS). Metrics: `_log_loss_metrics`.

Pinned by tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate,
tests/openrlhf/test_reward_path.py (::test_reward_path_gradient_is_reward_preset,
::test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages), tests/openrlhf/test_eos.py,
tests/openrlhf/test_ray.py and tests/openrlhf/test_budget.py.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import activation, native
from ..activation import Settings
from ..budget import KLBudget, check_budget_preset
from ..presets import get_preset
from ..reductions import KLStatistics
from ..surrogate import KLTerm, kl_coefficients, kl_reward, kl_term, sequence_kl
from . import openrlhf_statistics
from .openrlhf_statistics import EosPayload, RolloutTask, aligned, split_eos
from ._guard import ALLOW_UNTESTED_ENV, UnsupportedFrameworkError, refuse_untested_path, require_version
from .budget_wiring import kept_budget, restore, take_step
from .end_of_sequence import eos_probabilities
from .metrics import GRAD_WEIGHT_GAP, IS_ESS, SEQ_KL
from .patching import Site, install, installed, uninstall
from .openrlhf_cli import FLAG
from .versions import supported_range

_PPO_ACTOR = "openrlhf.trainer.ray.ppo_actor"
_PPO_TRAINER = "openrlhf.trainer.ppo_trainer"
_EXPERIENCE_MAKER = "openrlhf.trainer.ppo_utils.experience_maker"
_CONFIG = "openrlhf.utils.config"
_ACTOR = "openrlhf.models.actor"


class PresetFlag(str):
    """The value of ``args.algo.kl.preset``: a plain string to OpenRLHF (logs, wandb, JSON) that carries activation.

    Set by the launcher's ``--algo.kl.preset`` (``python -m kl_adapters.adapters.openrlhf_cli``: OpenRLHF's
    ``train_ppo_ray`` plus that one flag, see openrlhf_cli.py) or from ``KL_ADAPTERS`` with OpenRLHF's own
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

    ValueError for conflicts; UnsupportedFrameworkError for code paths the CPU tests cannot run (ring attention,
    DeepSpeed tensor parallelism) unless KL_ADAPTERS_ALLOW_UNTESTED=1, which warns instead. Other OpenRLHF
    versions are refused by the version guard (versions.TESTED, `patch`).
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
    if settings.kl_target is not None:
        _check_budget(args, settings, flag)
    untested = [name for name, on in (("--ds.ring_attn_size > 1", args.ds.ring_attn_size > 1),
                                      ("--ds.tensor_parallel_size > 1", args.ds.tensor_parallel_size > 1)) if on]
    if untested:
        refuse_untested_path(f"{flag} is not tested with {', '.join(untested)} (they need several GPUs)")


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


def _settings(args: Any) -> Settings | None:
    """The flag in OpenRLHF's args wins; absent, the process-wide setting (KL_ADAPTERS / enable) applies."""
    return activation.resolve(getattr(args.algo.kl, "preset", None), setting=FLAG)


# ---- loss path (PolicyModelActor) ----------------------------------------------------------------------------------


@dataclass
class _LossStep:
    """What OpenRLHF's training_step knows and its compute_approx_kl call does not."""

    settings: Settings
    experience: Any
    loss_batch_info: dict
    statistics: KLStatistics | None  # the micro-batch rows' rollout-wide statistics (openrlhf_statistics.take)
    horizon: int  # the maximum response length (`_horizon`)
    eos: EosPayload | None = None  # pi(EOS | y_<t) of this step's policy forward (`_wrap_actor_forward`), if read


_loss_step: contextvars.ContextVar[_LossStep | None] = contextvars.ContextVar("kl_adapters_loss_step", default=None)


def _wrap_training_step(original: Callable) -> Callable:
    """Wrap (not copy) ActorPPOTrainer.training_step, in PolicyModelActor: loss path (``--algo.kl.use_loss``), two
    patches (three hops: flag -> training_step -> compute_approx_kl).

    The wrapper makes the optimizer-step normalisers and the batch available to the KL computation, then runs
    OpenRLHF's own training_step. Inside it, OpenRLHF calls ``compute_approx_kl`` through ppo_actor.py's own binding,
    which `_wrap_loss_kl` replaces. OpenRLHF then adds ``aggregate_loss(kl) * kl_ctl``; the tensor returned
    (`_loss_term`) is built so that this adds, per micro-batch, a gradient of

        beta * dp_size * B_micro / global_batch_size * grad kl_surrogate(logp, ref_logp, mask, preset, old_logp)

    with beta = kl_ctl (``--algo.kl.init_coef`` or the adaptive value) and global_batch_size OpenRLHF's count of
    non-empty sequences in the optimizer step over all dp ranks, divided by gradient accumulation. After DeepSpeed's
    1/gas and dp averaging, one optimizer step's gradient is beta * (1/N_seq) * sum over its N_seq sequences of the
    per-sequence preset term: the KL is aggregated per sequence, not as OpenRLHF's global token mean.
    old_logp is ``experience.action_log_probs``, the rollout-time policy recomputed by the trainer (what PPO's ratio
    uses), so later micro-batches and epochs are importance-weighted exactly (preset "sequence"). The reduced presets'
    statistics are the rows' rollout-wide ones (openrlhf_statistics.py, `_wrap_compute_advantages`); OpenRLHF's
    replay buffer carries them into the micro-batches, and training_step hands them to kl_term (``statistics=``) with
    the EndOfSequence of its own forward (the current policy). Experiences not made by a patched experience maker carry
    none: kl_term then fits them on the micro-batch itself, to the KL term alone (still exact, noisier). Pinned by
    tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate and
    test_reward_path.py::test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages."""

    @functools.wraps(original)
    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        settings = _settings(self.args)
        if settings is None or not self.args.algo.kl.use_loss:
            return original(self, experience, kl_ctl, step, loss_batch_info)
        _apply(self.args, settings)
        statistics = openrlhf_statistics.take(experience)  # before OpenRLHF logs experience.info
        if loss_batch_info is None:  # dynamic batching: the call OpenRLHF's training_step makes (ppo_actor.py:273-280)
            loss_batch_info = sys.modules[_PPO_ACTOR].get_loss_batch_info(
                self.strategy, experience.action_mask, replay_buffer=self.replay_buffer, step=step,
                dynamic_batch=self.args.train.dynamic_batch_enable)
        token = _loss_step.set(_LossStep(settings, experience, loss_batch_info, statistics, _horizon(self.args)))
        try:
            return original(self, experience, kl_ctl, step, loss_batch_info)
        finally:
            _loss_step.reset(token)

    return training_step


def _wrap_loss_kl(original: Callable) -> Callable:
    """Replace ppo_actor.py's binding of compute_approx_kl (``from openrlhf.models.utils import ...``: patching
    openrlhf.models.utils alone is never called), inside a loss step (`_wrap_training_step`): the value stays
    OpenRLHF's estimator (its ``kl`` metric), the gradient becomes the preset's (`_loss_term`)."""
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
        term = _loss_kl_term(step, call.arguments["log_probs"], call.arguments["log_probs_base"])
        _log_loss_metrics(step, term, call.arguments["kl_estimator"])
        return value + _loss_term(step, term).to(value.dtype)

    return compute_approx_kl


def _loss_kl_term(step: _LossStep, logp: Tensor, ref_logp: Tensor) -> KLTerm:
    """kl_term of the micro-batch, its rows `aligned` (openrlhf_statistics.py: positions from each response's start).

    old_logp = experience.action_log_probs, the rollout-time policy: what 0.11.1+ pass as log_probs_old (ppo_actor.py:
    old_action_log_probs) and 0.10.4 / 0.11.0 do not pass at all. eos: pi(EOS | y_<t) of this step's policy forward
    (the current policy: its rows' own termination control variate). statistics None (experiences not made by a
    patched experience maker): kl_term's own, from this micro-batch, fitted to the KL term alone.
    """
    s, experience = step.settings, step.experience
    view = aligned(experience.action_mask, None if step.eos is None else step.horizon)
    eos = None if step.eos is None else view.end_of_sequence(step.eos, step.horizon)
    statistics = None if step.statistics is None else step.statistics.with_width(view.width)
    return kl_term(view(logp), view(ref_logp), view(experience.action_mask), preset=s.preset,
                   old_logp=view(experience.action_log_probs), is_clip=s.is_clip, statistics=statistics, eos=eos)


def _loss_term(step: _LossStep, kl: KLTerm) -> Tensor:
    """A [B, T] tensor of exact zeros whose gradient, through OpenRLHF's KL loss, is the preset's per-sequence term.

    OpenRLHF computes kl_loss = aggregate_loss(kl) = sum(kl * mask) / batch_num_tokens * dp_size and adds
    kl_loss * kl_ctl (ppo_actor.py:331-338). Spreading s = kl_surrogate(...) * B * batch_num_tokens / global_batch_size
    evenly over the micro-batch's real tokens makes that gradient kl_ctl * dp_size * B / global_batch_size * grad
    kl_surrogate, i.e. beta / N_seq per sequence of the optimizer step (see `_wrap_training_step`). The value is
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
    """The loss path's metrics, in the experience's info (OpenRLHF's status). OpenRLHF's ``kl`` and ``logprobs_diff``
    keep their meaning and values. Added beside them:
        kl_adapters/seq_kl          per-sequence KL estimate sum_t w_{1:t} k3_t (`sequence_kl`), averaged over samples
                                    (the reward path's: `_wrap_reward_kl`)
        kl_adapters/grad_weight_gap (loss path) sum |c_native - c_preset| / sum |c_preset| over the micro-batch's
                                    tokens, c being the per-token gradient weights (`kl_coefficients`) of OpenRLHF's
                                    own KL loss (``--algo.kl.estimator`` kN as preset "kN-loss") and of the preset,
                                    before aggregation: the live bias signal (as in the TRL and verl adapters); 0 when
                                    OpenRLHF's KL gradient would be the preset's token for token.
        kl_adapters/is_ess          (loss path) effective sample size of the micro-batch's per-decision importance
                                    weights (`KLTerm.is_ess`: 1 on-policy, towards 1/B as they degenerate), logged per
                                    batch."""
    info = step.experience.info
    info[SEQ_KL] = kl.sequence_kl
    info[IS_ESS] = kl.is_ess
    native_weight = kl.coefficients_of(native.openrlhf_loss(estimator).preset)
    gap, size = (native_weight - kl.coefficients).abs().sum(), kl.coefficients.abs().sum()  # both zero at padding
    info[GRAD_WEIGHT_GAP] = torch.where(size > 0, gap / size.clamp(min=torch.finfo(size.dtype).tiny), 0.0)  # 0-dim


# ---- pi(EOS | y_<t), from the policy's own forward (Actor.forward and its log_probs_from_logits) -----------------


@dataclass
class _EosCapture:
    """One Actor.forward's request: its model's end-of-sequence ids; log_probs_from_logits leaves the [B, S]
    probabilities of its logits here."""

    ids: Tensor
    prob: Tensor | None = None


_eos_capture: contextvars.ContextVar[_EosCapture | None] = contextvars.ContextVar("kl_adapters_eos", default=None)


def _wants_eos(step: _LossStep | None) -> bool:
    """Whether an Actor.forward's end-of-sequence probabilities are needed (a preset with batch statistics): the
    policy's training forward inside a loss step (the current policy, for its rows' own termination control variate),
    or an inference forward outside one (PolicyModelActor.forward at rollout time, for the rollout statistics)."""
    if step is not None:
        return torch.is_grad_enabled() and get_preset(step.settings.preset).uses_batch_statistics
    settings = activation.active()
    return not torch.is_grad_enabled() and settings is not None and get_preset(settings.preset).uses_batch_statistics


def _wrap_actor_forward(original: Callable) -> Callable:
    """Wrap Actor.forward (in the PolicyModelActor's process: patched with ppo_actor) for pi(EOS | y_<t), the reduced
    presets' termination control variate, from the policy forward OpenRLHF already runs, without a second pass.

    With actor.py's binding of ``log_probs_from_logits`` (`_wrap_log_probs_from_logits`): from the logits it was given
    and the log-probs it returned, log pi(EOS) = logsumexp(z_EOS) - (z_y - log pi(y))
    (`end_of_sequence.eos_probabilities`: two gathers), at the rollout temperature, the EOS ids being the model's
    generation config's and config's. In the training step the probabilities go to the loss (the current policy's, for
    its rows' own control variate). In PolicyModelActor.forward at rollout time (an inference forward) they ride on
    the returned log-probs (openrlhf_statistics.LogProbsWithEos, a tensor subclass that survives its ``.to("cpu")``
    and Ray) to the experience maker, which takes them off before OpenRLHF sees its experiences (`_take_eos`). Pinned
    by tests/openrlhf/test_eos.py and test_ray.py."""

    @functools.wraps(original)
    def forward(self, sequences, action_mask=None, *args, **kwargs):
        step = _loss_step.get()
        packed = getattr(self, "packing_samples", False)
        wanted = action_mask is not None and _wants_eos(step) and kwargs.get("ring_attn_group") is None
        ids = openrlhf_statistics.eos_token_ids(self.model) if wanted else ()
        if not ids:
            return original(self, sequences, action_mask, *args, **kwargs)
        capture = _EosCapture(torch.tensor(ids, device=sequences.device))
        token = _eos_capture.set(capture)
        try:
            out = original(self, sequences, action_mask, *args, **kwargs)
        finally:
            _eos_capture.reset(token)
        if capture.prob is None:
            return out
        prob = capture.prob
        if packed:  # [1, nnz] in --ds.packing_samples' order: padded back as Actor.forward pads its log-probs
            prob = _padded(prob, sequences, kwargs.get("attention_mask", args[0] if args else None))
        eos = openrlhf_statistics.action_eos(prob, sequences, action_mask, capture.ids)
        if step is not None:  # the loss reads it (`_loss_kl_term`); OpenRLHF gets its own result
            step.eos = eos
            return out
        return openrlhf_statistics.with_eos(out, eos) if isinstance(out, Tensor) else out

    return forward


def _padded(packed: Tensor, sequences: Tensor, attention_mask: Tensor) -> Tensor:
    """A packed forward's per-token values [1, nnz] as [batch, seqlen], with OpenRLHF's own unpad indices and
    gather_and_pad_tensor (no ring attention: the adapter refuses it). Pinned by
    tests/openrlhf/test_coverage_packing.py."""
    from openrlhf.models import ring_attn_utils

    indices = ring_attn_utils.unpad_input(sequences.unsqueeze(-1), attention_mask)[1]
    return ring_attn_utils.gather_and_pad_tensor(packed, None, 0, indices, *sequences.shape)


def _wrap_log_probs_from_logits(original: Callable) -> Callable:
    """Wrap actor.py's binding of log_probs_from_logits: inside a `_wrap_actor_forward` call, also read pi(EOS) from
    the logits after its call (so at the rollout temperature on every release); its result is OpenRLHF's."""

    @functools.wraps(original)
    def log_probs_from_logits(logits, labels, *args, **kwargs):
        out = original(logits, labels, *args, **kwargs)  # 0.10.4 / 0.11.0 divide the logits by the temperature here
        capture = _eos_capture.get()
        if capture is not None:
            capture.prob = eos_probabilities(logits, labels, out, capture.ids)
        return out

    return log_probs_from_logits


def _take_eos(experiences: list) -> list[EosPayload] | None:
    """Take the rollout forward's EosPayload off each sample batch's action_log_probs (and any off its reference
    log-probs: a reference Actor in a patched process carries one too), leaving OpenRLHF's plain tensors; None unless
    every sample batch had one."""
    payloads = []
    for e in experiences:
        e.action_log_probs, payload = split_eos(e.action_log_probs)
        e.base_action_log_probs = split_eos(e.base_action_log_probs)[0]
        payloads.append(payload)
    return payloads if payloads and all(p is not None for p in payloads) else None


def _horizon(args: Any) -> int:
    """The maximum response length (`EndOfSequence.horizon`): --rollout.max_new_tokens (vLLM's max_tokens), or
    --data.max_len (what OpenRLHF truncates prompt + response to) when it is unset or an agent makes the responses
    (--train.agent_func_path: several turns, observations included)."""
    new_tokens = args.rollout.max_new_tokens
    return args.data.max_len if not new_tokens or args.train.agent_func_path else new_tokens


# ---- loss path: rollout statistics (PPOTrainer / TrainingActor) -------------------------------------------------

#: attribute of the RemoteExperienceMaker holding the previous rollout's mean response length (`_loss_task`)
_MEAN_LENGTH = "_kl_adapters_mean_length"


def _wrap_compute_advantages(original: Callable) -> Callable:
    """Wrap ``compute_advantages_and_returns`` (PPOTrainer's RemoteExperienceMaker) so that, once OpenRLHF has made the
    advantages, the loss path's statistics are fitted on the whole rollout with them (`_loss_task`) and with the
    rollout forward's pi(EOS | y_<t) (`_wrap_actor_forward`), and stored in each row's info
    (`_attach_loss_statistics`), from which `_wrap_training_step` hands them to the loss. Pinned by
    tests/openrlhf/test_reward_path.py::test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages."""

    @functools.wraps(original)
    def compute_advantages_and_returns(self, experiences):
        experiences = original(self, experiences)
        eos = _take_eos(experiences)  # (also with the flag off: OpenRLHF's experiences hold plain tensors only)
        settings = _settings(self.args)
        if settings is not None and self.args.algo.kl.use_loss and get_preset(settings.preset).uses_batch_statistics:
            _attach_loss_statistics(self, experiences, eos)
        return experiences

    return compute_advantages_and_returns


def _attach_loss_statistics(maker: Any, experiences: list, eos: list[EosPayload] | None) -> None:
    """Store in each row's info its leave-one-out statistics of the whole rollout, fitted with the advantages OpenRLHF
    has just computed (`_loss_task`) and the rollout forward's end-of-sequence probabilities."""
    args = maker.args
    stats = openrlhf_statistics.rollout_statistics(
        experiences, [e.action_log_probs for e in experiences], [e.base_action_log_probs for e in experiences],
        args.rollout.n_samples_per_prompt, task=_loss_task(maker, experiences), eos=eos, horizon=_horizon(args))
    for e, rows in zip(experiences, stats):
        openrlhf_statistics.attach(e, rows)


def _loss_task(maker: Any, experiences: list) -> RolloutTask | None:
    """The task term of the loss path: OpenRLHF's final advantages A, on the scale of the adapter's KL term.

    Per token, the step's descent weight is kl_ctl c / N_seq - A / N_tok under PolicyLoss's token mean, i.e. A against
    beta = kl_ctl N_tok / N_seq (the step's mean response length); that length is taken from the previous rollout
    (this rollout's would make every row's statistics depend on its own length, which the exactness excludes), and
    the first rollout, which has none, is fitted to the KL term alone (None). Under seq-mean-token-mean (0.11.2) or
    gspo the weight is (kl_ctl c - A / L_b) / N_seq: A / L_b against beta = kl_ctl. normalized: `_normalized`.
    """
    args, kl_ctl = maker.args, float(maker.kl_ctl.value)
    normalized = _normalized(args)
    if not _token_level(args):
        advantages = [e.advantages / e.action_mask.sum(-1, keepdim=True).clamp(min=1) for e in experiences]
        return RolloutTask(advantages, kl_ctl, normalized)
    previous = getattr(maker, _MEAN_LENGTH, None)
    lengths = torch.cat([e.action_mask.sum(-1) for e in experiences]).float()
    setattr(maker, _MEAN_LENGTH, float(lengths.sum() / (lengths > 0).sum().clamp(min=1)))
    return None if previous is None else RolloutTask([e.advantages for e in experiences], kl_ctl * previous, normalized)


def _normalized(args: Any) -> bool:
    """Whether OpenRLHF (compute_advantages_and_returns, 0.10.4-0.11.2) divided the advantages by a standard deviation
    over rows that include the row: group_norm's group std, and the whitening of gae / reinforce / reinforce_baseline
    unless --algo.advantage.no_std_norm."""
    adv = args.algo.advantage
    return adv.estimator == "group_norm" or (adv.estimator in ("gae", "reinforce", "reinforce_baseline")
                                              and not adv.no_std_norm)


def _token_level(args: Any) -> bool:
    """PolicyLoss's aggregation is the token mean (--actor.loss_agg_mode token-mean, 0.11.2's default and the only
    mode before it, and not gspo, which forces the sequence mean)."""
    return getattr(args.actor, "loss_agg_mode", "token-mean") == "token-mean" and args.actor.policy_loss_type != "gspo"


# ---- reward path (PPOTrainer / TrainingActor) ----------------------------------------------------------------------


@dataclass
class _Rollout:
    """make_experience's sample batches, in the order it computes their KL (experience_maker.py: the KL loop), and the
    (log pi_old, log pi_ref) pair of each one the reward KL was computed from."""

    pending: Iterator[Any]
    log_probs: list[tuple[Tensor, Tensor]]


_rollout: contextvars.ContextVar[_Rollout | None] = contextvars.ContextVar("kl_adapters_rollout", default=None)


def _wrap_make_experience(original: Callable) -> Callable:
    """Reward path (default), in the PPOTrainer / TrainingActor (presets "reward" and "reward-plain").

    ``RemoteExperienceMaker.make_experience`` is wrapped to hand each sample batch's action mask to
    experience_maker.py's binding of ``compute_approx_kl`` (`_wrap_reward_kl`), which returns k1_t = log pi_old/pi_ref
    from ``kl_reward`` (unclamped; OpenRLHF clamps every estimator to [-10, 10]). OpenRLHF's compute_reward makes it the
    per-token reward -kl_coef * k1_t and its returns (gamma = 1) the KL reward-to-go: preset "reward-plain". Preset
    "reward" then replaces each experience's per-token KL by increments d_t whose reward-to-go is the reduced
    coefficient c_t with the rollout-wide statistics, fitted with the scores (`_reward_task`) and the rollout forward's
    pi(EOS | y_<t) (`_reduce_reward_kl`). Either way the PPO gradient at the rollout policy is beta * (B / N_tok) *
    grad kl_surrogate(preset, statistics=the rows', eos=the rollout policy's), N_tok being OpenRLHF's token-mean
    divisor. Pinned by tests/openrlhf/test_reward_path.py::test_reward_path_gradient_is_reward_preset."""

    @functools.wraps(original)
    def make_experience(self, samples_list):
        settings = _settings(self.args)
        if settings is None:
            return original(self, samples_list)
        _apply(self.args, settings)
        if self.args.algo.kl.use_loss:  # loss path: statistics once the advantages exist (`_wrap_compute_advantages`)
            return original(self, samples_list)
        rollout = _Rollout(iter(samples_list), [])
        token = _rollout.set(rollout)
        try:
            experiences = original(self, samples_list)
        finally:
            _rollout.reset(token)
        if next(rollout.pending, None) is not None or len(rollout.log_probs) != len(experiences):
            raise UnsupportedFrameworkError("OpenRLHF's make_experience computed fewer KLs than it has sample batches; "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        eos = _take_eos(experiences)
        if get_preset(settings.preset).uses_batch_statistics:
            _reduce_reward_kl(self, experiences, rollout.log_probs, settings, eos)
        return experiences

    return make_experience


def _reduce_reward_kl(maker: Any, experiences: list, log_probs: list[tuple[Tensor, Tensor]], settings: Settings,
                      eos: list[EosPayload] | None) -> None:
    """Replace each experience's per-token KL (k1, from `_wrap_reward_kl`) by rewards whose reward-to-go is the reduced
    preset's coefficient c_t (rollout-wide statistics, fitted with `_reward_task` against beta = kl_coef, the
    coefficient compute_reward applies, and the rollout forward's end-of-sequence probabilities): compute_reward
    makes them -kl_coef * d_t and the returns (gamma = 1) -kl_coef * c_t, so the PPO gradient at the rollout policy is
    the reduced preset's. The score's baseline (group_norm, rloo, ...) acts on the scalar score only, before the KL is
    added (experience_maker.py)."""
    args, horizon = maker.args, _horizon(maker.args)
    task = RolloutTask(_reward_task(experiences, args), float(maker.kl_ctl.value),
                       args.algo.advantage.estimator == "group_norm")
    all_stats = openrlhf_statistics.rollout_statistics(experiences, *zip(*log_probs), args.rollout.n_samples_per_prompt,
                                                       task=task, eos=eos, horizon=horizon)
    for i, (e, (logp, ref_logp), stats) in enumerate(zip(experiences, log_probs, all_stats)):
        view = aligned(e.action_mask, None if eos is None else horizon)
        end = None if eos is None else view.end_of_sequence(eos[i], horizon)
        c = kl_coefficients(view(logp), view(ref_logp), view(e.action_mask), preset=settings.preset,
                            statistics=stats.with_width(view.width), eos=end)
        e.kl = openrlhf_statistics.reward_increments(view.back(c), e.action_mask).to(e.kl.dtype)


def _reward_task(experiences: list, args: Any) -> list[Tensor]:
    """The task part of the advantage OpenRLHF's reward path trains on, per sample batch, from what make_experience
    holds when the KL rewards are made (compute_advantages_and_returns has not run yet): the score r (``rewards``;
    the length penalties OpenRLHF applies later are left out). Its per-prompt shift (rloo, reinforce_baseline,
    dr_grpo, group_norm's mean) and group_norm's std are the core's to remove (shift-invariant, normalized); rloo's
    leave-one-out baseline also scales it by n / (n - 1); gae's advantage at gamma = lambd = 1 is r - V_t (the critic's
    rollout values). The whitening of gae / reinforce / reinforce_baseline divides task and KL alike: beta stays
    kl_coef. Any choice keeps the gradient exact (statistics read other rows only); this one fits the trained one."""
    estimator, n = args.algo.advantage.estimator, args.rollout.n_samples_per_prompt
    out = []
    for e in experiences:
        r = e.rewards.float() * (n / (n - 1) if estimator == "rloo" and n > 1 else 1.0)
        if estimator == "gae" and e.values is not None:
            r = (r[:, None] - e.values.float()) * e.action_mask
        out.append(r)
    return out


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
        rollout.log_probs.append((split_eos(log_probs)[0], split_eos(log_probs_base)[0]))
        sample.info[SEQ_KL] = sequence_kl(log_probs, log_probs_base, sample.action_mask)
        # k1_t (zero at padding, no clamp): compute_reward turns it into the reward -kl_coef * k1_t ("reward-plain");
        # the reduced "reward" replaces it once the whole rollout is known (`_reduce_reward_kl`)
        return (-kl_reward(log_probs, log_probs_base, sample.action_mask, beta=1.0)).float()

    return compute_approx_kl


# ---- KL budget (kl_target), in the single controller (PPOTrainer / TrainingActor) ----------------------------------

#: client_states key of the budget's state in OpenRLHF's checkpoint (saved with the actor's DeepSpeed checkpoint)
BUDGET_STATE = "kl_adapters_budget"


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
    check_budget_preset(settings.preset, settings.is_clip, off_policy=off_policy, name=f"{flag}: kl_target")


def _budget(trainer: Any) -> KLBudget | None:
    """The single controller's KL budget (initial beta = --algo.kl.init_coef, OpenRLHF's fixed controller's value),
    made at first use; None without kl_target."""
    settings = _settings(trainer.args)
    if settings is None:
        return None

    def start() -> float:
        check_args(trainer.args, settings)
        return float(trainer.kl_ctl.value)

    return kept_budget(trainer, settings.kl_target, start)


def _wrap_train_step(original: Callable) -> Callable:
    """BasePPOTrainer.train_step (once per rollout) under a budget: OpenRLHF's fixed KL controller, shared with the
    experience maker (reward path) and passed to the actors' fit as kl_ctl (loss path), takes the budget's beta;
    after the step the budget is updated from the step's kl_adapters/seq_kl, which OpenRLHF's ppo_train averaged
    over the step's samples and all-reduced over the data-parallel ranks (loss path: importance-weighted estimates
    at each micro-batch; reward path: the rollout's). Adds kl_adapters/beta and kl_adapters/kl_target to the status.

    KL budget (``--algo.kl.seq_target <nats>`` or ``--algo.kl.preset <preset>:kl_target=<nats>``, kl_adapters.budget;
    refused at parsing by `_check_budget`): one controller in the single controller (BasePPOTrainer), updated once per
    rollout (this wrapper): OpenRLHF's fixed KL controller holds its beta, which train_step passes to every actor's
    fit as kl_ctl (loss path) and the experience maker applies (reward path); afterwards it takes the step's
    kl_adapters/seq_kl, which ppo_train already averaged and all-reduced over the data-parallel ranks (no added
    synchronisation). State: a key of OpenRLHF's checkpoint client_states (`_wrap_save`, restored by
    `_wrap_init_checkpoint_states`). Metrics ``kl_adapters/beta``, ``kl_adapters/kl_target``. Pinned by
    tests/openrlhf/test_budget.py."""

    @functools.wraps(original)
    def train_step(self, rollout_samples, global_step):
        budget = _budget(self)
        if budget is None:
            return original(self, rollout_samples, global_step)
        self.kl_ctl.value = budget.beta
        status, step = original(self, rollout_samples, global_step)
        if SEQ_KL not in status:
            raise UnsupportedFrameworkError(f"OpenRLHF's train_step returned no {SEQ_KL} for the KL budget: "
                                            f"kl-adapters supports {supported_range('openrlhf')}'s code path only")
        self.kl_ctl.value = take_step(budget, float(status[SEQ_KL]), status)
        return status, step

    return train_step


def _wrap_save(original: Callable) -> Callable:
    """BasePPOTrainer.save_logs_and_checkpoints: the budget's state joins OpenRLHF's client_states (saved with the
    actor's checkpoint, returned by get_checkpoint_states on resume)."""

    @functools.wraps(original)
    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        budget = _budget(self)
        if budget is not None:
            client_states = {**(client_states or {}), BUDGET_STATE: budget.state_dict()}
        return original(self, global_step, logs_dict, client_states)

    return save_logs_and_checkpoints


def _wrap_init_checkpoint_states(original: Callable) -> Callable:
    """BasePPOTrainer.init_checkpoint_states (fit's resume): once OpenRLHF resumed (global_step > 0), restore the
    budget from the checkpoint's client_states; one saved without a budget leaves the configured beta (logged)."""

    @functools.wraps(original)
    def init_checkpoint_states(self):
        states = original(self)
        budget = _budget(self)
        if budget is not None and states.get("global_step"):
            restore({BUDGET_STATE: budget}, states, "OpenRLHF's resumed checkpoint (client_states)")
            self.kl_ctl.value = budget.beta
        return states

    return init_checkpoint_states


# ---- hierarchize (the driver's CLI) --------------------------------------------------------------------------------


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


# ---- adapter contract ----------------------------------------------------------------------------------------------

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


#: trigger module -> what is patched when it is imported (leading parameters common to versions.TESTED["openrlhf"];
#: compute_approx_kl gained log_probs_old and unbiased_gradient in 0.11.1, `_wrap_loss_kl` reads its own signature)
SITES: dict[str, tuple[Site, ...]] = {
    _PPO_ACTOR: (
        Site("training_step", ("self", "experience", "kl_ctl", "step", "loss_batch_info"), _wrap_training_step,
             owner="ActorPPOTrainer"),
        Site("compute_approx_kl", ("log_probs", "log_probs_base"), _wrap_loss_kl),
        Site("forward", ("self", "sequences", "action_mask"), _wrap_actor_forward, module=_ACTOR, owner="Actor"),
        Site("log_probs_from_logits", ("logits", "labels"), _wrap_log_probs_from_logits, module=_ACTOR),
        Site("hierarchize", ("args",), _wrap_hierarchize, module=_CONFIG),
    ),
    _PPO_TRAINER: (
        Site("train_step", ("self", "rollout_samples", "global_step"), _wrap_train_step, owner="BasePPOTrainer"),
        Site("save_logs_and_checkpoints", ("self", "global_step", "logs_dict", "client_states"), _wrap_save,
             owner="BasePPOTrainer"),
        Site("init_checkpoint_states", ("self",), _wrap_init_checkpoint_states, owner="BasePPOTrainer"),
    ),
    _EXPERIENCE_MAKER: (
        Site("make_experience", ("self", "samples_list"), _wrap_make_experience, owner="RemoteExperienceMaker"),
        Site("compute_advantages_and_returns", ("self", "experiences"), _wrap_compute_advantages,
             owner="RemoteExperienceMaker"),
        Site("compute_approx_kl", ("log_probs", "log_probs_base"), _wrap_reward_kl),
    ),
}


def patch(trigger: str) -> None:
    """Patch what OpenRLHF keeps in module `trigger` (idempotent; UnsupportedFrameworkError off versions.TESTED).

    openrlhf.trainer.ray.ppo_actor: ActorPPOTrainer.training_step, its compute_approx_kl binding, and
        openrlhf.utils.config.hierarchize (the CLI's args builder, which then carries the flag into the actors);
    openrlhf.trainer.ppo_trainer: BasePPOTrainer.train_step, save_logs_and_checkpoints, init_checkpoint_states (the KL
        budget, in the single controller);
    openrlhf.trainer.ppo_utils.experience_maker: RemoteExperienceMaker.make_experience, its compute_approx_kl binding.
    A refused KL_ADAPTERS raises its SettingError (`activation.check_environment`).

    Releases (their KL code diffed, not only tested): what differs and where it is handled.
        0.11.1 -> 0.11.2  compute_approx_kl clamps log_ratio at -10 before k3's exp (the value OpenRLHF logs; our
                          gradient never goes through it); --actor.loss_agg_mode is new (`_check_reward_path` reads it
                          with the 0.11.1 meaning, token-mean, as default); PolicyLoss returns 5 values (training_step
                          is wrapped, not copied, so its arity does not matter); the reward path promotes rewards to
                          float32 and gains flash_reinforce (the KL reward is float32 already; compute_reward and the
                          returns are unchanged).
        0.11.0 -> 0.11.1  compute_approx_kl gains log_probs_old and unbiased_gradient, and training_step passes them;
                          --algo.kl.unbiased_gradient is new. `_wrap_loss_kl` forwards the release's own call and takes
                          old_logp from the experience on every release; `check_args` reads the flag only where it
                          exists.
        0.11.0 -> 0.11.1  also: Actor.forward divides the logits by the temperature before log_probs_from_logits,
                          which 0.10.4 / 0.11.0 do inside it; `_wrap_log_probs_from_logits` reads the logits after its
                          call, so pi(EOS) is at the rollout temperature on every release.
        0.10.4 -> 0.11.0  no change to compute_approx_kl, compute_reward, the returns, training_step's KL,
                          aggregate_loss or the replay buffer (the diffs: z3 leaf modules, masked_normalize's keepdim,
                          a dead GSPO line).
        0.10.3 and older  refused even with KL_ADAPTERS_ALLOW_UNTESTED=1 (`_refuse_incompatible`): training_step takes
                          no loss_batch_info and normalises each micro-batch by its own token count (0.10.4 introduced
                          the optimizer-step normalisers, loss_utils.iter_grad_accum_global_norm), so `_loss_term`'s
                          scale would be wrong.
    """
    activation.check_environment()
    version = require_version("openrlhf")
    _refuse_incompatible(version)
    if trigger not in SITES:
        raise ValueError(f"{trigger!r} is not an OpenRLHF module kl-adapters patches ({', '.join(SITES)})")
    install("openrlhf", version, trigger, SITES[trigger])


def unpatch() -> None:
    """Restore every original OpenRLHF function."""
    uninstall("openrlhf")


def patched() -> list[str]:
    """The OpenRLHF attributes currently replaced, as 'owner.name' (for checks inside Ray actors)."""
    return installed("openrlhf")
