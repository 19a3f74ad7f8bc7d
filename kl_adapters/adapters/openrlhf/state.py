"""What the OpenRLHF adapter's wrappers hand each other, each a `patching.Scoped` value with the extent of the
OpenRLHF call whose wrapper binds it:

    LOSS_STEP    one ActorPPOTrainer.training_step (`LossStep`): B `loss._wrap_training_step`; R the loss path's
                 compute_approx_kl (`loss._wrap_loss_kl`) and Actor.forward (`eos._wrap_actor_forward`, which leaves the
                 step's pi(EOS) in it)
    EOS_CAPTURE  one Actor.forward (`EosCapture`): B `eos._wrap_actor_forward`; R log_probs_from_logits
                 (`eos._wrap_log_probs_from_logits`, which leaves pi(EOS) of its logits in it)
    ROLLOUT      one RemoteExperienceMaker.make_experience on the reward path (`Rollout`): B
                 `reward._wrap_make_experience`; R the reward path's compute_approx_kl (`reward._wrap_reward_kl`)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ...activation import Settings
from ...reductions import KLStatistics
from ..patching import Scoped
from .eos_payload import EosPayload


@dataclass
class LossStep:
    """What OpenRLHF's training_step knows and its compute_approx_kl call does not."""

    settings: Settings
    experience: Any
    loss_batch_info: dict
    statistics: KLStatistics | None  # the micro-batch rows' rollout-wide statistics (statistics.take)
    horizon: int  # the maximum response length (`positions._horizon`)
    eos: EosPayload | None = None  # pi(EOS | y_<t) of this step's policy forward (`eos._wrap_actor_forward`), if read
    token_mean: bool = True  # PolicyLoss's aggregation is the token mean (`statistics._token_level`; `loss._loss_term`)


LOSS_STEP: Scoped[LossStep] = Scoped("openrlhf.loss_step")


@dataclass
class EosCapture:
    """One Actor.forward's request: its model's end-of-sequence ids; log_probs_from_logits leaves the [B, S]
    probabilities of its logits here."""

    ids: Tensor
    prob: Tensor | None = None


EOS_CAPTURE: Scoped[EosCapture] = Scoped("openrlhf.eos_capture")


@dataclass
class Rollout:
    """make_experience's sample batches, in the order it computes their KL (experience_maker.py: the KL loop), and the
    (log pi_old, log pi_ref) pair of each one the reward KL was computed from."""

    pending: Iterator[Any]
    log_probs: list[tuple[Tensor, Tensor]]


ROLLOUT: Scoped[Rollout] = Scoped("openrlhf.rollout")
