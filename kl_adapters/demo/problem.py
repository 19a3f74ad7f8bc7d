"""A KL-regularized RL problem small enough to solve exactly, with a tiny transformer as the policy.

Completions are strings over a few characters plus end-of-sequence (EOS), at most T tokens, after a one-token prompt
(defaults: "a", "b" and EOS, T = 4: 31 sequences); every sequence can be enumerated (`kl_adapters.audit.sequence_space`).
The reference pi_ref is the policy's initial state. The objective J(pi) = E_pi[r] - beta * KL(pi || pi_ref) has the
known optimum

    pi*(y) = pi_ref(y) exp(r(y)/beta) / Z,      J* = J(pi*) = beta * log Z,      Z = sum_y pi_ref(y) exp(r(y)/beta),

and for any pi, J* - J(pi) = beta * KL(pi || pi*). `ExactEvaluator` computes E[r], KL(pi || pi_ref), J, J* - J and
KL(pi || pi*) exactly by scoring every sequence with the model.

Rewards (`ToyProblem.reward_kind`):
  * "answer" (default): r = 1 for one full-length answer (default "abab"), `partial_credit` (0.3) for every other
    completion: an exact-match reward. Reaching the answer costs the KL of all T of its tokens. pi* weighs that cost;
    the per-token KL gradient (TRL's default, verl's k3+, OpenRLHF's unbiased_gradient) does not see, when it sets
    a token, the KL its continuation will cost: its fixed point pi(v | h) ~ pi_ref(v | h) exp(Q(h, v) / beta), with
    Q the expected reward-to-go *without* the future KL, commits to the answer far beyond pi*. The bias is large and
    shows within a few dozen steps.
  * "random": r ~ U(0, 1) per sequence (0 for the empty completion), the earlier problem: the configurations separate
    only after several hundred steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..audit import sequence_space

EOS = "<eos>"
REWARD_KINDS = ("answer", "random")


@dataclass(frozen=True)
class ToyProblem:
    chars: str = "ab"  # non-EOS tokens; the prompt is chars[0]
    horizon: int = 4  # maximum completion length T
    beta: float = 0.2
    reward_kind: str = "answer"  # "answer" or "random" (module docstring)
    answer: str | None = None  # "answer" only: a full-length string over chars; None = "abab..." cut to T
    partial_credit: float = 0.3  # "answer" only: r of every other completion
    reward_seed: int = 0  # "random" only

    def __post_init__(self):
        if self.reward_kind not in REWARD_KINDS:
            raise ValueError(f"unknown reward kind {self.reward_kind!r}; valid: {', '.join(REWARD_KINDS)}")
        if self.reward_kind == "answer" and (len(self.target) != self.horizon or set(self.target) - set(self.chars)):
            raise ValueError(f"answer {self.target!r} must be {self.horizon} characters from {self.chars!r}")

    @property
    def target(self) -> str:
        """The "answer" reward's full-length answer."""
        return self.answer if self.answer is not None else (self.chars[:2] * self.horizon)[:self.horizon]

    @cached_property
    def space(self):
        return sequence_space(len(self.chars) + 1, self.horizon)  # audit token v < V-1 is chars[v]; V-1 is EOS

    def token_id(self, audit_token: int) -> int:
        """Tokenizer id of an audit-space token: EOS -> 0, chars[v] -> v + 1."""
        return 0 if audit_token == self.space.eos else audit_token + 1

    #: tokenizer id of EOS (`char_tokenizer`), what harness.batch_logps_and_eos reads of any problem
    eos_id = 0

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
        """[N] r(y) of every enumerated completion, in float64 (module docstring)."""
        if self.reward_kind == "answer":
            return torch.tensor([1.0 if s == self.target else self.partial_credit for s in self.strings],
                                dtype=torch.float64)
        return self._random_rewards()

    def _random_rewards(self) -> Tensor:
        """r(y) ~ U(0, 1) per sequence (fixed by reward_seed), except r(empty completion) = 0.

        The empty completion is the likeliest sequence under the initial policy; with a high random reward it would
        hold most of pi*'s mass and attract every run early, dropping whole branches of the tree (the exact gradient
        of J then stalls: docs/history.md) -- a property of that draw, not of any KL
        estimator. "Say something" removes that attractor.
        """
        gen = torch.Generator().manual_seed(self.reward_seed)
        r = torch.rand(self.space.num_sequences, generator=gen, dtype=torch.float64)
        return torch.where(self.space.mask.sum(-1) == 1, 0.0, r)  # length 1 = EOS only = the empty completion

    @cached_property
    def reward_of(self) -> dict[str, float]:
        return dict(zip(self.strings, self.rewards.tolist()))

    def reward(self, completions: list[str]) -> list[float]:
        """r(y) for decoded completions (a TRL-style reward function)."""
        return [self.reward_of[c] for c in completions]

    def tokenizer(self):
        return char_tokenizer(self.chars)

    def model(self, seed: int, hidden: int = 32):
        """A tiny random GPT-2 over this vocabulary (pad = eos = 0), dropout off.

        GPT-2, not Llama: with rotary positions only, attention over a run of identical tokens averages identical
        values, so a Llama cannot tell the prefix "a a" from "a a a" and cannot represent pi* here (fitting pi*
        directly stalls: docs/history.md); learned absolute positions can.
        """
        return tiny_gpt2(len(self.chars) + 1, 16, seed, hidden)


def char_tokenizer(chars: str):
    """A character-level fast tokenizer: EOS (= pad) is id 0, chars[i] is id i + 1; left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=EOS, eos_token=EOS)
    out.padding_side = "left"
    return out


def tiny_gpt2(vocab_size: int, positions: int, seed: int, hidden: int = 32):
    """A tiny GPT-2 (2 layers, 4 heads; pad = eos = id 0; dropout off) with weights drawn from a seeded generator.

    GPT-2's scheme (N(0, 0.02) matrices, unit gains, zero biases), drawn by us rather than by transformers, so that the
    initial policy -- the reference, hence pi* -- is the same whatever transformers version a framework pins."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=2, n_head=4, n_positions=positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     pad_token_id=0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.fill_(1.0 if _is_gain(p, model) else 0.0)
    return model


def completion_logprobs(model, input_ids: Tensor, completion_mask: Tensor, dtype=torch.float32) -> Tensor:
    """[B, T] log pi(y_t | prompt, y_<t) (with gradient, 0 at padding) of a one-token prompt + completions."""
    attention = torch.cat([torch.ones_like(input_ids[:, :1]), completion_mask.long()], 1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].to(dtype)
    lp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.where(completion_mask, lp, torch.zeros((), dtype=dtype))


def enumerated_input_ids(problem: ToyProblem) -> Tensor:
    """[N, 1 + T] prompt token + every completion (EOS-padded)."""
    prompt = torch.full((problem.space.num_sequences, 1), problem.token_id(0), dtype=torch.long)
    return torch.cat([prompt, problem.completion_ids], 1)


def _is_gain(param, model) -> bool:
    """LayerNorm weights (gains) start at 1; every other 1-D parameter is a bias and starts at 0."""
    return any(param is m.weight for m in model.modules() if isinstance(m, torch.nn.LayerNorm))


@torch.no_grad()
def sequence_logprobs(problem: ToyProblem, model) -> Tensor:
    """[N] log pi(y | prompt) of every completion under a causal LM, in float64."""
    device = next(model.parameters()).device
    lp = completion_logprobs(model, enumerated_input_ids(problem).to(device), problem.space.mask.to(device),
                             torch.float64)
    return lp.sum(-1).cpu()


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
