"""Enumerable policies as `kl_adapters.measure` sources, for its exactness tests: a tabular policy (one logit vector
per prefix, kl_adapters.audit) and a bigram policy at long horizons (bench/variance.py), each sampled exactly, with
the log-probs carrying a gradient to the logit table and the policy's end-of-sequence probabilities."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from kl_adapters.audit import Policies, token_logps
from kl_adapters.measure.gradients import TokenBatch
from kl_adapters.reductions import EndOfSequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import variance  # noqa: E402


class Tabular:
    """`groups` x G sequences of a tabular policy, sampled from pi (or mu off-policy) by their exact probabilities."""

    def __init__(self, policies: Policies, groups: int, group_size: int, off_policy: bool, seed: int,
                 rewards: Tensor | None = None):
        self.policies, self.group_size, self.off_policy = policies, group_size, off_policy
        self.theta = policies.logits.clone().requires_grad_(True)
        space = policies.space
        sampler = policies.behaviour_logits if off_policy else policies.logits
        probability = token_logps(space, sampler).sum(-1).exp()
        generator = torch.Generator().manual_seed(seed)
        self.index = torch.multinomial(probability, groups * group_size, replacement=True,
                                       generator=generator).view(groups, group_size)
        self.ref = token_logps(space, policies.ref_logits)
        self.old = token_logps(space, policies.behaviour_logits) if off_policy else None
        self.sequence_rewards = rewards  # [N] one per enumerated sequence

    @property
    def lengths(self) -> Tensor:
        return self.policies.space.mask[self.index].sum(-1)

    def batch(self, groups: Tensor) -> TokenBatch:
        rows = self.index[groups].flatten()
        space = self.policies.space
        prob = torch.softmax(self.theta.detach(), -1)[space.node_of_token[rows], space.eos] * space.mask[rows]
        eos = EndOfSequence(prob, (space.token[rows] == space.eos) & space.mask[rows])
        return TokenBatch(token_logps(space, self.theta)[rows], self.ref[rows], space.mask[rows],
                          torch.arange(len(groups)).repeat_interleave(self.group_size),
                          None if self.old is None else self.old[rows], eos,
                          None if self.sequence_rewards is None else self.sequence_rewards[rows])


class Bigram:
    """`groups` x G sequences of bench/variance.py's bigram policy (horizon T), on-policy."""

    def __init__(self, model: variance.Bigram, horizon: int, groups: int, group_size: int, seed: int):
        self.model, self.group_size, self.off_policy = model, group_size, False
        self.theta = model.logits.clone().requires_grad_(True)
        self.samples = variance.sample(model, groups * group_size, horizon, False,
                                       torch.Generator().manual_seed(seed))

    @property
    def lengths(self) -> Tensor:
        return self.samples.mask.sum(-1).view(-1, self.group_size)

    def batch(self, groups: Tensor) -> TokenBatch:
        rows = (groups[:, None] * self.group_size + torch.arange(self.group_size)).flatten()
        s = self.samples.rows(rows)
        logp = torch.log_softmax(self.theta, -1)[s.states, s.tokens] * s.mask
        return TokenBatch(logp, s.ref_logp, s.mask, torch.arange(len(groups)).repeat_interleave(self.group_size),
                          None, s.eos(self.model.vocab))
