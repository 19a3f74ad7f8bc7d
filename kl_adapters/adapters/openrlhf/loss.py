"""OpenRLHF adapter, the loss path (``--algo.kl.use_loss``, in PolicyModelActor): the preset's KL term through
OpenRLHF's own KL loss (`_wrap_training_step`, `_wrap_loss_kl`) and its metrics (`_log_loss_metrics`). Pinned by
tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ... import native
from ...surrogate import KLTerm, kl_term
from ..metrics import GRAD_WEIGHT_GAP, IS_ESS, SEQ_KL
from .flags import _apply, _settings
from .positions import _horizon, aligned
from .state import LOSS_STEP, LossStep
from .statistics import _token_level, take

#: ActorPPOTrainer's module, whose get_loss_batch_info a dynamic-batching training_step calls
_PPO_ACTOR = "openrlhf.trainer.ray.ppo_actor"


def _wrap_training_step(original: Callable) -> Callable:
    """Wrap (not copy) ActorPPOTrainer.training_step, in PolicyModelActor: loss path (``--algo.kl.use_loss``), two
    patches (three hops: flag -> training_step -> compute_approx_kl).

    The wrapper makes the optimizer-step normalisers and the batch available to the KL computation, then runs
    OpenRLHF's own training_step. Inside it, OpenRLHF calls ``compute_approx_kl`` through ppo_actor.py's own binding,
    which `_wrap_loss_kl` replaces. OpenRLHF then adds ``aggregate_loss(kl) * kl_ctl``; the tensor returned
    (`_loss_term`) is built so that, after DeepSpeed's 1/gas and dp averaging, one optimizer step's gradient is

        beta / D * sum over the step's sequences b of grad kl_surrogate_b(logp, ref_logp, mask, preset, old_logp)

    with beta = kl_ctl (``--algo.kl.init_coef`` or the adaptive value) and D the normaliser of OpenRLHF's policy loss
    (PolicyLoss), so that init_coef keeps its strength relative to the task loss, as TRL's beta and verl's
    kl_loss_coef do:
        token-mean (default)          D = N_tok, OpenRLHF's token count of the optimizer step (batch_num_tokens:
                                      all-reduced over dp ranks, gradient accumulation and dynamic batching included).
                                      With preset "token:is_clip=10" this is OpenRLHF's own unbiased_gradient loss,
                                      token for token;
        seq-mean-token-mean / gspo    D = N_seq * H, N_seq OpenRLHF's count of non-empty sequences of the step
                                      (global_batch_size) and H the horizon (`positions._horizon`): PolicyLoss divides
                                      each sequence by its own length, which would make the KL a length-normalized one;
                                      the constant H instead is TRL's choice for its length-normalised loss types.
    old_logp is ``experience.action_log_probs``, the rollout-time policy recomputed by the trainer (what PPO's ratio
    uses), so later micro-batches and epochs are importance-weighted exactly (preset "sequence"). The reduced presets'
    statistics are the rows' rollout-wide ones (statistics.py, `_wrap_compute_advantages`); OpenRLHF's
    replay buffer carries them into the micro-batches, and training_step hands them to kl_term (``statistics=``) with
    the EndOfSequence of its own forward (the current policy). Experiences not made by a patched experience maker carry
    none: kl_term then fits them on the micro-batch itself, to the KL term alone (still exact, noisier). Pinned by
    tests/openrlhf/test_loss_path.py (::test_gradient_is_task_plus_kl_surrogate, both aggregations, and
    ::test_token_preset_is_openrlhfs_unbiased_gradient) and
    test_reward_path.py::test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages."""

    @functools.wraps(original)
    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        settings = _settings(self.args)
        if settings is None or not self.args.algo.kl.use_loss:
            return original(self, experience, kl_ctl, step, loss_batch_info)
        _apply(self.args, settings)
        statistics = take(experience)  # before OpenRLHF logs experience.info
        if loss_batch_info is None:  # dynamic batching: the call OpenRLHF's training_step makes (ppo_actor.py:273-280)
            loss_batch_info = sys.modules[_PPO_ACTOR].get_loss_batch_info(
                self.strategy, experience.action_mask, replay_buffer=self.replay_buffer, step=step,
                dynamic_batch=self.args.train.dynamic_batch_enable)
        loss_step = LossStep(settings, experience, loss_batch_info, statistics, _horizon(self.args),
                             token_mean=_token_level(self.args))
        with LOSS_STEP.bound(loss_step):
            return original(self, experience, kl_ctl, step, loss_batch_info)

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
        step = LOSS_STEP.get()
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


def _loss_kl_term(step: LossStep, logp: Tensor, ref_logp: Tensor) -> KLTerm:
    """kl_term of the micro-batch, its rows `aligned` (positions.py: positions from each response's start).

    old_logp = experience.action_log_probs, the rollout-time policy: what 0.11.1+ pass as log_probs_old (ppo_actor.py:
    old_action_log_probs) and 0.10.4 / 0.11.0 do not pass at all. eos: pi(EOS | y_<t) of this step's policy forward
    (the current policy: its rows' own termination control variate). statistics None (experiences not made by a
    patched experience maker): kl_term's own, from this micro-batch, fitted to the KL term alone.
    """
    s, experience = step.settings, step.experience
    view = aligned(experience.action_mask, None if step.eos is None else step.horizon)
    eos = None if step.eos is None else view.end_of_sequence(step.eos, step.horizon)
    statistics = None if step.statistics is None else step.statistics.with_width(view.width)
    return kl_term(view(logp), view(ref_logp), view(experience.action_mask), preset=s.spec,
                   old_logp=view(experience.action_log_probs), is_clip=s.is_clip, statistics=statistics, eos=eos)


def _loss_term(step: LossStep, kl: KLTerm) -> Tensor:
    """A [B, T] tensor of exact zeros whose gradient, through OpenRLHF's KL loss, is the preset's per-sequence term
    over the policy loss's normaliser D (`_wrap_training_step`).

    OpenRLHF computes kl_loss = aggregate_loss(kl) = sum(kl * mask) / batch_num_tokens * dp_size (its token mode,
    whatever --actor.loss_agg_mode) and adds kl_loss * kl_ctl (ppo_actor.py:331-338). Spreading
    s = B * kl_surrogate * batch_num_tokens / D (`_tokens_per_normaliser`) evenly over the micro-batch's real tokens makes
    that gradient kl_ctl * dp_size / D * sum_b grad kl_surrogate_b. The value is s - s.detach() = 0 exactly, so
    OpenRLHF's ``kl`` metric is unchanged.
    """
    term = kl.surrogate()
    m = step.experience.action_mask.to(term.dtype)
    total = term * (kl.logp.shape[0] * _tokens_per_normaliser(step, term))
    spread = m * (total / m.sum().clamp(min=1))
    return spread - spread.detach()


def _tokens_per_normaliser(step: LossStep, like: Tensor) -> Tensor | float:
    """batch_num_tokens / D, D the policy loss's normaliser (`_wrap_training_step`): 1 under the token mean;
    batch_num_tokens / (global_batch_size * horizon) under seq-mean-token-mean or gspo."""
    if step.token_mean:
        return 1.0
    info = step.loss_batch_info
    n_tok, n_seq = (torch.as_tensor(info[key], dtype=like.dtype, device=like.device)
                    for key in ("batch_num_tokens", "global_batch_size"))
    # an all-empty window has n_tok = n_seq = 0 and no gradient to give: keep 0/0 out of the graph
    return n_tok / (n_seq * step.horizon).clamp(min=torch.finfo(like.dtype).tiny)


def _log_loss_metrics(step: LossStep, kl: KLTerm, estimator: str) -> None:
    """The loss path's metrics, in the experience's info (OpenRLHF's status). OpenRLHF's ``kl`` and ``logprobs_diff``
    keep their meaning and values. Added beside them:
        kl_adapters/seq_kl          per-sequence KL estimate sum_t w_{1:t} k3_t (`sequence_kl`), averaged over samples
                                    (the reward path's: `_wrap_reward_kl`)
        kl_adapters/grad_weight_gap (loss path) `KLTerm.grad_weight_gap`: sum |c_native - c_preset| / sum |c_preset|
                                    over the micro-batch's tokens, c being the per-token gradient weights
                                    (`kl_coefficients`) of OpenRLHF's own KL loss (``--algo.kl.estimator`` kN as
                                    preset "kN-loss") and of the preset, before aggregation: the live bias signal (as
                                    in the TRL and verl adapters); 0 when OpenRLHF's KL gradient would be the preset's
                                    token for token.
        kl_adapters/is_ess          (loss path) effective sample size of the micro-batch's per-decision importance
                                    weights (`KLTerm.is_ess`: 1 on-policy, towards 1/B as they degenerate), logged per
                                    batch."""
    info = step.experience.info
    info[SEQ_KL] = kl.sequence_kl
    info[IS_ESS] = kl.is_ess
    info[GRAD_WEIGHT_GAP] = kl.grad_weight_gap(native.openrlhf_loss(estimator).preset)  # 0-dim
