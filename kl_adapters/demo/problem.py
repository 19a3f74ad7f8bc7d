"""A KL-regularized RL problem small enough to solve exactly, with a tiny transformer as the policy.

Completions are strings over a few characters plus end-of-sequence (EOS), at most T tokens, after a one-token prompt
(defaults: "a", "b" and EOS, T = 5: 63 sequences);
every sequence can be enumerated (`kl_adapters.audit.sequence_space`). r(y) is a fixed random reward in [0, 1) per
sequence. The reference pi_ref is the policy's initial state. The objective J(pi) = E_pi[r] - beta * KL(pi || pi_ref)
has the known optimum

    pi*(y) = pi_ref(y) exp(r(y)/beta) / Z,      J* = J(pi*) = beta * log Z,      Z = sum_y pi_ref(y) exp(r(y)/beta),

and for any pi, J* - J(pi) = beta * KL(pi || pi*). `ExactEvaluator` computes E[r], KL(pi || pi_ref), J, J* - J and
KL(pi || pi*) exactly by scoring every sequence with the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..audit import sequence_space

EOS = "<eos>"


@dataclass(frozen=True)
class ToyProblem:
    chars: str = "ab"  # non-EOS tokens; the prompt is chars[0]
    horizon: int = 5  # maximum completion length T
    beta: float = 0.2
    reward_seed: int = 0

    @cached_property
    def space(self):
        return sequence_space(len(self.chars) + 1, self.horizon)  # audit token v < V-1 is chars[v]; V-1 is EOS

    def token_id(self, audit_token: int) -> int:
        """Tokenizer id of an audit-space token: EOS -> 0, chars[v] -> v + 1."""
        return 0 if audit_token == self.space.eos else audit_token + 1

    @cached_property
    def completion_ids(self) -> Tensor:
        """[N, T] tokenizer ids of every completion, EOS-padded."""
        return torch.where(self.space.mask, self.space.token + 1, 0).masked_fill(self.space.token == self.space.eos, 0)

    @cached_property
    def strings(self) -> list[str]:
        """Decoded completions (EOS dropped): unique, since a string shorter than T must have ended with EOS."""
        return ["".join(self.chars[v] for v, m in zip(row, mask) if m and v != self.space.eos)
                for row, mask in zip(self.space.token.tolist(), self.space.mask.tolist())]

    @cached_property
    def rewards(self) -> Tensor:
        gen = torch.Generator().manual_seed(self.reward_seed)
        return torch.rand(self.space.num_sequences, generator=gen, dtype=torch.float64)

    @cached_property
    def reward_of(self) -> dict[str, float]:
        return dict(zip(self.strings, self.rewards.tolist()))

    def reward(self, completions: list[str]) -> list[float]:
        """r(y) for decoded completions (a TRL-style reward function)."""
        return [self.reward_of[c] for c in completions]

    def tokenizer(self):
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {EOS: 0, **{c: i + 1 for i, c in enumerate(self.chars)}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=EOS, eos_token=EOS)
        out.padding_side = "left"
        return out

    def model(self, seed: int, hidden: int = 32):
        """A tiny random GPT-2 over this vocabulary (pad = eos = 0), dropout off.

        GPT-2, not Llama: with rotary positions only, attention over a run of identical tokens averages identical
        values, so a Llama cannot tell the prefix "a a" from "a a a" and cannot represent pi* here (measured: fitting
        pi* directly stalls at KL 0.046 on 15 sequences); learned absolute positions can.
        """
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=len(self.chars) + 1, n_embd=hidden, n_layer=2, n_head=4, n_positions=16,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0, tie_word_embeddings=False)
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg).float().eval()


@torch.no_grad()
def sequence_logprobs(problem: ToyProblem, model) -> Tensor:
    """[N] log pi(y | prompt) of every completion under a causal LM, in float64."""
    n, t = problem.completion_ids.shape
    prompt = torch.full((n, 1), problem.token_id(0), dtype=torch.long)
    ids = torch.cat([prompt, problem.completion_ids], 1).to(model.device)
    attention = torch.cat([torch.ones(n, 1, dtype=torch.long), problem.space.mask.long()], 1).to(model.device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
    return torch.where(problem.space.mask, lp, 0.0).sum(-1)


class ExactEvaluator:
    """Exact metrics of the current policy against pi_ref (fixed at construction) and pi*."""

    def __init__(self, problem: ToyProblem, reference_logprobs: Tensor):
        self.problem, self.ref = problem, reference_logprobs
        r, beta = problem.rewards, problem.beta
        self.log_z = torch.logsumexp(self.ref + r / beta, 0)
        self.optimum = self.ref + r / beta - self.log_z  # log pi*
        self.j_star = float(beta * self.log_z)

    def __call__(self, logprobs: Tensor) -> dict[str, float]:
        p = logprobs.exp()
        reward = float((p * self.problem.rewards).sum())
        kl_ref = float((p * (logprobs - self.ref)).sum())
        j = reward - self.problem.beta * kl_ref
        return {"reward": reward, "kl_ref": kl_ref, "J": j, "gap": self.j_star - j,
                "kl_opt": float((p * (logprobs - self.optimum)).sum()), "mass": float(p.sum())}
