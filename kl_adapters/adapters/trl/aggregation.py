"""TRL adapter, how TRL aggregates its policy loss: the normaliser D it divides every token by, which the KL term
shares (`per_token_normaliser`), and the refusal of the code paths the adapter is not tested with
(`_check_code_path`, whose docstring says what differs between the tested releases)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._guard import UnsupportedFrameworkError

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer


#: loss types whose policy loss is divided by a per-batch constant D, which the KL term shares
_CONSTANT_NORMALISER = ("dapo", "cispo", "vespo", "bnpo", "dr_grpo", "luspo")


#: loss types that divide each sequence by its own length; the KL term uses D = B * max_completion_length instead
_LENGTH_NORMALISED = ("grpo", "sapo")


def _check_code_path(trainer: GRPOTrainer) -> None:
    """Refuse configurations the adapter is not tested with (never patch silently wrong).

    Releases (versions.TESTED["trl"]: 1.14.0, 1.14.1, 1.14.2, 1.15.0, 1.16.0). The code paths the adapter relies on are
    the same in all of them: ``_compute_loss`` (KL block, loss types and normalisers) is identical line for line,
    ``compute_loss``'s signature, the ``inputs`` keys, GRPOConfig's KL fields and defaults (beta 0.0,
    use_bias_correction_kl True, loss_type "dapo") and RLOO's k1-in-reward are unchanged (sdists diffed). What differs:
      * how TRL computes log-probs: 1.14.x slices full logits (or, with use_liger_kernel, TRL's own chunked torch path
        ``_chunked_logps``, reached from compute_loss through ``_forward_redirection``); 1.15.0 adds a fused LM head to the
        model. The adapter takes the log-probs from ``_get_per_token_logps_and_entropies``'s output (``out[0]`` in every
        release), so it is indifferent to which. use_liger_kernel is accepted: besides that 1.14.x path it only makes
        transformers' Trainer swap the model's layer kernels (1.15+ with fused_linear_cross_entropy off); no tested
        release has a fused Liger GRPO loss (older releases had one), and a loss that bypassed TRL's log-prob method
        would stop the step (`loss._compute_loss_with_kl`: no recorded forward). Pinned by tests/trl/test_liger.py.
      * gradient-accumulation scaling: 1.14.x disables Trainer's scaling with ``compute_loss_func="non-None..."``, 1.15.0
        with ``loss_is_scaled_for_ga = True``; in both, ``_compute_loss`` divides by the accumulation steps itself, which
        `per_token_normaliser` reads as ``current_gradient_accumulation_steps`` (unchanged).
      * 1.15.0 runs its fused LM head through Triton kernels on every device (trl/kernels/chunked_logprob.py imports
        triton; 1.16.0 falls back to torch without it), so on a CPU-only machine 1.15.0 needs triton installed and
        TRITON_INTERPRET=1 (how its tests run here: tests/trl/conftest.py); the KL path is the same.
      * 1.14.0 and 1.14.1 import ``requests`` unconditionally (trl/generation/vllm_client.py) without declaring it: an
        environment for them needs ``requests`` installed (envs/trl-1.14.0.txt, envs/trl-1.14.1.txt); 1.14.2 fixed it.
    """
    if _normaliser_kind(trainer) is None:
        raise UnsupportedFrameworkError(
            f"{type(trainer).__name__} overrides _compute_loss with an aggregation kl-adapters does not know; "
            "supported: GRPOTrainer (every loss_type) and trl.experimental GMPOTrainer")


def _normaliser_kind(trainer: GRPOTrainer) -> str | None:
    """Which aggregation TRL 1.16 applies to this trainer's policy loss: a loss_type, "gmpo", or None (unknown)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    impl = type(trainer)._compute_loss
    if impl is GRPOTrainer._compute_loss:
        return trainer.loss_type if trainer.loss_type in _CONSTANT_NORMALISER + _LENGTH_NORMALISED else None
    try:
        from trl.experimental.gmpo import GMPOTrainer
    except ImportError:  # pragma: no cover - trl without experimental
        return None
    return "gmpo" if isinstance(trainer, GMPOTrainer) and impl is GMPOTrainer._compute_loss else None


def per_token_normaliser(trainer: GRPOTrainer, inputs: dict, mask: torch.Tensor) -> float | torch.Tensor:
    """D such that TRL 1.16 divides each token of this micro-batch's policy loss by D (grpo_trainer.py:3152-3185).

    For the length-normalised kinds (grpo, sapo, gmpo) returns B * max_completion_length (loss.py's docstring says why).
    """
    train = trainer.model.training
    accumulation = trainer.current_gradient_accumulation_steps if train else 1
    batch = mask.shape[0]
    kind = _normaliser_kind(trainer)
    if kind in ("dapo", "cispo", "vespo"):
        items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        return items * accumulation / trainer.args.steps_per_generation if train else items
    if kind == "bnpo":
        return mask.sum().clamp(min=1.0) * accumulation
    if kind == "luspo":
        return batch * accumulation
    return batch * trainer.max_completion_length * accumulation  # dr_grpo, and grpo / sapo / gmpo by choice
