"""TRL adapter, preset ``full``: the exact KL over the vocabulary from the policy's and the reference's hidden states
(kl_adapters.full_vocab), the reference run in the trainer process. Pinned by tests/trl/test_full.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...full_vocab import full_kl_surrogate_from_hidden
from .._guard import UnsupportedFrameworkError
from ..metrics import SEQ_KL
from .budget import observe_budget
from .eos import _causal_lm, _head_problem, _last_hidden

if TYPE_CHECKING:  # pragma: no cover
    from trl.trainer.grpo_trainer import GRPOTrainer


def _output_projection(lm: torch.nn.Module, temperature: float) -> torch.Tensor:
    """W / temperature such that TRL's next-token logits are hidden @ (W / temperature).T; refuses any other head."""
    problem = _head_problem(lm)
    if problem is not None:
        raise UnsupportedFrameworkError(f"kl_preset='full' needs logits = hidden @ W.T; {problem}")
    return lm.get_output_embeddings().weight / temperature


def _reference_hidden(trainer: GRPOTrainer, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state [B, L, H], W / temperature) of the reference on the batch, without gradient: TRL's
    ref_model, else (PEFT) the base with adapters disabled or TRL's "ref" adapter, as TRL's own reference pass."""
    from contextlib import nullcontext

    from trl.trainer.utils import use_adapter

    if trainer.ref_model is not None:
        lm, context = _causal_lm(trainer.ref_model, trainer), nullcontext()
    else:
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        lm = peft_model.get_base_model()
        context = use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None)
    with torch.no_grad(), context, trainer.accelerator.autocast():
        hidden = _last_hidden(lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False))
        return hidden, _output_projection(lm, trainer.temperature).detach()


def _full_kl(trainer: GRPOTrainer, model, inputs: dict, policy_hidden: torch.Tensor, logp: torch.Tensor, behaviour,
             beta_seq, mask, options: dict) -> torch.Tensor:
    """beta_seq * full_kl_surrogate_from_hidden on this micro-batch (preset `full`, below); logs metrics.
    logp: TRL's own log-probs of the completion (with their graph): one pass over the vocabulary chunks, the score
    part of the gradient through them; options: `statistics_inputs` (task advantages, groups, eos).

    Preset ``full`` (kl_adapters.full_vocab: exact KL_t over the vocabulary, Rao-Blackwellized): the reference runs in
    the trainer process (``ref_model``, or with PEFT the adapter-disabled base / TRL's "ref" adapter). With it set:
      * generation skips TRL's reference log-prob pass (``beta`` is 0 for that call): ``full`` reads the reference's
        distributions at loss time instead, so the reference runs once per micro-batch either way;
      * the loss wrapper captures the policy backbone's last hidden state of TRL's own forward (a forward hook for that one
        call, gradient attached), runs the reference backbone (no gradient) on the same tokens, and adds
        ``full_kl_surrogate_from_hidden(h, W / temperature, h_ref, W_ref / temperature, completion_ids, mask,
        beta=beta_seq, old_logp=behaviour_logp, logp=per_token_logps)`` (W the output projection): chunked over tokens,
        so [B, T, V] logits of neither model are materialised; TRL's own per-token log-probs (with their graph) carry the
        score part of the gradient, so each chunk's logits are computed once. beta_seq and the behaviour log-probs are
        those of the other presets; the statistics are leave-one-out over the micro-batch's rows within their prompt
        groups, with the task advantages and pi(EOS) from the same hidden state (rollout-time statistics would need the
        exact KL_t of the whole generation batch, i.e. the very reference pass this preset removes from generation).
      * metrics: ``kl`` = token mean of the (importance-weighted) exact KL_t, ``kl_adapters/seq_kl`` its per-sequence sum.
      Refused (clear error): kl_is_clip (the estimator applies exact weights), models whose logits are not
      hidden @ W.T (bias, logit scale, soft-capping), multimodal inputs. Pinned by tests/trl/test_full.py.
    """
    if any(inputs.get(k) is not None for k in ("pixel_values", "image_grid_thw", "token_type_ids")):
        raise UnsupportedFrameworkError("kl_preset='full' supports text-only models (multimodal inputs are not tested)")
    completion = inputs["completion_ids"]
    horizon = completion.shape[1]
    input_ids = torch.cat([inputs["prompt_ids"], completion], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    ref_hidden, ref_weight = _reference_hidden(trainer, input_ids, attention_mask)
    weight = _output_projection(_causal_lm(model, trainer), trainer.temperature)
    seq_kl = full_kl_surrogate_from_hidden(  # hidden state at position i predicts token i + 1
        policy_hidden[:, -horizon - 1:-1], weight, ref_hidden[:, -horizon - 1:-1], ref_weight, completion, mask,
        old_logp=behaviour, logp=logp, **options)
    totals = trainer.accelerator.reduce(torch.stack([
        seq_kl.detach() * mask.shape[0], mask.sum(), torch.tensor(float(mask.shape[0]), device=mask.device)]).float(),
        reduction="sum").tolist()
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    metrics["kl"].append(totals[0] / max(totals[1], 1.0))
    metrics[SEQ_KL].append(totals[0] / max(totals[2], 1.0))
    observe_budget(trainer, "train" if trainer.model.training else "eval", totals[0], totals[2])
    return beta_seq * seq_kl
