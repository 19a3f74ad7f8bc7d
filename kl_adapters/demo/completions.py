"""The batch layout the framework loss functions of bench/demo_verl.py and bench/demo_openrlhf.py take: prompts and
their sampled completions, as verl and OpenRLHF lay them out (left-padded prompts, then right-padded completions).

The toy harness (`harness.Batch`: one prompt token, one group) converts with `harness.of_toy`; the task harness
(`task.harness.Batch`, a subclass) has prompts of any width and several prompt groups. `logps_and_eos` is the one
forward both take the current policy's log-probs and pi(EOS | y_<t) from (tests/verl/test_demo_runner.py::
test_harness_eos_probabilities pins it on the toy, tests/verl/test_task_harness.py on the task layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Completions:
    """B prompts with one sampled completion each, and what the losses need of them."""

    prompts: Tensor  # [B, P] left-padded prompt ids
    prompt_mask: Tensor  # [B, P] long, 1 at the prompt's tokens
    tokens: Tensor  # [B, T] completion ids, padded after the end
    mask: Tensor  # [B, T] bool: the completion's tokens, EOS included
    old_logp: Tensor  # [B, T] log-probs under the policy that sampled (detached), 0 at padding
    ref_logp: Tensor  # [B, T] reference log-probs, 0 at padding
    rewards: Tensor  # [B]
    advantages: Tensor  # [B]
    groups: Tensor | None  # [B] prompt-group ids (the rows whose rewards share a baseline); None: one group

    @property
    def input_ids(self) -> Tensor:
        """[B, P + T] prompt then completion."""
        return torch.cat([self.prompts, self.tokens], 1)

    @property
    def attention_mask(self) -> Tensor:
        """[B, P + T] long."""
        return torch.cat([self.prompt_mask, self.mask.long()], 1)


def logps_and_eos(model: torch.nn.Module, c: Completions, eos_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """From one forward of the model: [B, T] log pi(y_t | x, y_<t) with gradient, pi(EOS | x, y_<t) (detached) and
    whether y_t is EOS (bool), all 0 / False at padding. What a framework's engine takes from the logits it already
    computes for kl-adapters' termination control variate (`EndOfSequence`)."""
    p, t = c.prompts.shape[1], c.tokens.shape[1]
    logits = model(input_ids=c.input_ids, attention_mask=c.attention_mask).logits
    log_pi = torch.log_softmax(logits[:, p - 1:p - 1 + t].float(), -1)
    mask = c.mask
    logp = torch.where(mask, log_pi.gather(-1, c.tokens[..., None]).squeeze(-1), 0.0)
    return logp, torch.where(mask, log_pi[..., eos_id].detach().exp(), 0.0), mask & (c.tokens == eos_id)
