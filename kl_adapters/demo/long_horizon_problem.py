"""A long-horizon KL-regularized problem whose optimum is known exactly (issue 22), for horizons T = 32 ... 2048.

**Reference: a transformer that is a Markov chain.** The policy is a tiny GPT-2 over {EOS, a, b} (`problem.tiny_gpt2`:
seeded weights, the same under every transformers pin) whose attention output projections are zero at
initialisation. Attention then adds nothing to the residual stream, so the logits at input position j are a function
of (x_j, j) alone and the reference -- the initial policy -- is a position-dependent Markov chain:

    pi_ref(y_t | prompt, y_<t) = P_t(y_t | y_{t-1})          (y_{-1} = the prompt token "a")

read off the model as a table [T, V, V] (`reference`; tests/trl/test_long_horizon.py checks it against the model on
random prefixes). Training moves the projections away from zero and the policy away from Markov freely. Two logit
offsets, through a unit feature (residual dimension 0 leaves ln_f as the constant 1, which only lm_head's EOS and "b"
rows read: `_set_offsets`), set pi_ref(EOS) to eos_rate / T at every position (completions are long: mean ~0.89 T at
eos_rate 0.25) and make "b" rare, ~sqrt(2 / T), with the offset chosen so that P_ref(R = 1) = success_rate exactly
(bisection on the exact probability, `_offsets`): the problem is equally hard at every horizon.

**Reward: a constraint on the whole completion, not a sum over tokens.** R(y) = 1 if the completion never holds "bb"
(two letters b in a row), else 0 -- a format constraint: one violation anywhere, among up to T tokens, loses it all.
The per-token KL gradient misses what pi* must weigh here: after a "b" the next token must avoid "b", which costs KL
at the *next* position; the per-token gradient's fixed point pi(v | h) ~ pi_ref(v | h) exp(Q(h, v) / beta), Q the
reward-to-go without the future KL, does not see that cost and says "b" too often. Computed exactly over Markov
policies (the class pi_ref and, up to 0.014, pi* are in; beta 0.2, success_rate ~0.25): KL(fixed point || pi*) is
0.21, 0.20 and 0.19 at T = 32, 128, 512, against 0.013-0.016 for the best Markov policy and 2.4 for pi_ref
(the k3 loss's fixed point: 0.41-0.47).

**Exact optimum by dynamic programming.** R depends on y through the automaton state f = [a "bb" occurred so far],
so pi* = pi_ref exp(R / beta) / Z is a Markov policy in (t, y_{t-1}, f). Backward over t, in float64,

    log Z_T(u, f) = R(f) / beta,        log Z_t(u, f) = logsumexp_v [log P_t(v | u) + c_t(u, f, v)],
    c_t(u, f, EOS) = R(f) / beta,       c_t(u, f, v) = log Z_{t+1}(v, f or [u = v = b])   (v != EOS),
    log pi*(v | t, u, f) = log P_t(v | u) + c_t(u, f, v) - log Z_t(u, f),     J* = beta log Z_0(prompt, 0)

with R(f) = 1 - f (`log_z`, `log_optimum`; tests/trl/test_long_horizon.py checks them against brute-force
enumeration at small T). A completion ends at its first EOS (which counts as one of the T tokens) or after T tokens,
as TRL's max_completion_length = T truncates it.

**KL(pi || pi*) of any policy the trainer produces** (`evaluate`), estimated from N completions sampled from the
policy (`sample`, with the policy's full next-token distributions pi(. | y_<t)): the Rao-Blackwellized per-sample value

    KL(pi || pi*) = E_pi[ sum_t KL(pi(. | y_<t) || pi*(. | t, y_{t-1}, f_t)) ]       (sum over the live positions)

unbiased, with its standard error over the N samples; J* - J = beta KL(pi || pi*), KL(pi || pi_ref) the same way,
E[R] the sample mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .problem import char_tokenizer, tiny_gpt2

CHARS = "ab"
EOS_ID, A_ID, B_ID = 0, 1, 2  # char_tokenizer(CHARS)
VOCAB = len(CHARS) + 1
PROMPT = "a"
FORBIDDEN = "bb"


@dataclass(frozen=True)
class LongHorizonProblem:
    """The problem for one horizon and one seed (the seed draws the reference model, hence pi*)."""

    horizon: int = 128  # T: maximum completion length, EOS included
    beta: float = 0.2
    seed: int = 0
    success_rate: float = 0.25  # P_ref(R = 1)
    eos_rate: float = 0.25  # pi_ref(EOS) = eos_rate / T at every position
    hidden: int = 32
    eos_id = EOS_ID  # (not a field) what harness.batch_logps_and_eos reads

    def __post_init__(self):
        if self.horizon < 2 or not 0 < self.success_rate < 1 or not 0 < self.eos_rate < self.horizon:
            raise ValueError(f"need horizon >= 2, 0 < success_rate < 1, 0 < eos_rate < horizon; got {self}")

    def model(self):
        """The initial policy (= the reference): `tiny_gpt2` with zero attention output projections and the EOS and
        "b" offsets. A fresh copy on every call."""
        model = self._markov_model()
        _set_offsets(model, *self._offsets)
        return model

    def tokenizer(self):
        return char_tokenizer(CHARS)

    def _markov_model(self):
        model = tiny_gpt2(VOCAB, self.horizon + 1, self.seed, self.hidden)
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_proj.weight.zero_()  # (biases are already 0): attention adds nothing
        _set_offsets(model, 0.0, 0.0)
        return model

    @cached_property
    def reference(self) -> Tensor:
        """[T, V, V] float64: log P_t(v | u), the reference's next-token log-probs at completion position t given
        the previous token u."""
        return _markov_table(self.model(), self.horizon)

    @cached_property
    def _offsets(self) -> tuple[float, float]:
        """(EOS offset, "b" offset) added to those two logits: pi_ref(EOS) = eos_rate / T, P_ref(R = 1) =
        success_rate. The offsets add to the logits exactly (a unit feature times a weight), so they are fitted on
        the table of the model without them, by bisection on the "b" offset (the exact success probability falls as
        "b" grows more likely)."""
        base = _markov_table(self._markov_model(), self.horizon)
        rate = self.eos_rate / self.horizon
        low, high = -30.0, 30.0
        for _ in range(60):
            b = (low + high) / 2
            eos = math.log(rate * (1 + math.exp(b)) / (1 - rate))
            if _success_probability(_shifted(base, eos, b)) > self.success_rate:
                low = b
            else:
                high = b
        b = (low + high) / 2
        return math.log(rate * (1 + math.exp(b)) / (1 - rate)), b

    @property
    def reference_success(self) -> float:
        """P_ref(R = 1), exactly (success_rate up to the offsets' float32 rounding)."""
        return _success_probability(self.reference)

    def reward(self, completions: list[str]) -> list[float]:
        """R(y) = 1 if the completion never holds "bb", else 0 (a TRL-style reward function)."""
        return [float(FORBIDDEN not in c) for c in completions]

    @cached_property
    def _tables(self) -> tuple[Tensor, Tensor]:
        """(log Z [T + 1, V, 2], log pi* [T, V, 2, V]) by the backward recursion of the module docstring."""
        T, ref = self.horizon, self.reference
        terminal = torch.tensor([1.0 / self.beta, 0.0], dtype=torch.float64)  # R(f) / beta, f = violated
        nxt = _next_flag()  # [u, f, v]
        log_z = torch.empty(T + 1, VOCAB, 2, dtype=torch.float64)
        log_opt = torch.empty(T, VOCAB, 2, VOCAB, dtype=torch.float64)
        log_z[T] = terminal
        v = torch.arange(VOCAB).expand(VOCAB, 2, VOCAB)
        for t in range(T - 1, -1, -1):
            cont = torch.where(v == EOS_ID, terminal[None, :, None], log_z[t + 1][v, nxt])  # c_t(u, f, v)
            scores = ref[t][:, None, :] + cont
            log_z[t] = torch.logsumexp(scores, -1)
            log_opt[t] = scores - log_z[t][..., None]
        return log_z, log_opt

    @property
    def log_z(self) -> Tensor:
        return self._tables[0]

    @property
    def log_optimum(self) -> Tensor:
        """[T, V, 2, V] float64: log pi*(v | t, previous token u, flag f = [a "bb" so far])."""
        return self._tables[1]

    @property
    def j_star(self) -> float:
        """J* = max_pi E[R] - beta KL(pi || pi_ref) = beta log Z."""
        return self.beta * float(self.log_z[0, A_ID, 0])

    @property
    def reference_gap(self) -> float:
        """J* - J(pi_ref) = beta KL(pi_ref || pi*) = J* - P_ref(R = 1), exactly."""
        return self.j_star - self.reference_success


def _markov_table(model, horizon: int) -> Tensor:
    """[T, V, V] float64 log-softmax of the logits at completion position t given the previous token u, read off a
    model whose position-t logits depend on (x_t, t) alone by feeding the constant sequences u u u ...."""
    with torch.no_grad():
        ids = torch.arange(VOCAB)[:, None].expand(VOCAB, horizon)
        logits = model(input_ids=ids).logits.double()  # [u, t, v]
    return torch.log_softmax(logits, -1).transpose(0, 1).contiguous()


def _shifted(table: Tensor, eos: float, b: float) -> Tensor:
    """The table with the EOS and "b" logits raised by the offsets."""
    shift = torch.zeros(VOCAB, dtype=torch.float64)
    shift[EOS_ID], shift[B_ID] = eos, b
    return torch.log_softmax(table + shift, -1)


def _next_flag() -> Tensor:
    """[u, f, v] the automaton's next state: f or [u = v = b] (the EOS column is unused)."""
    u, f, v = torch.meshgrid(torch.arange(VOCAB), torch.arange(2), torch.arange(VOCAB), indexing="ij")
    return f | ((u == B_ID) & (v == B_ID)).long()


def _success_probability(table: Tensor) -> float:
    """P(R = 1) of the Markov chain with log-probs `table` [T, V, V], by the forward recursion over (u, f)."""
    p = table.exp()
    alive = torch.zeros(VOCAB, dtype=torch.float64)  # P(not ended, no "bb" yet, previous token u)
    alive[A_ID] = 1.0
    success = 0.0
    for t in range(len(table)):
        step = alive[:, None] * p[t]  # [u, v]
        success += float(step[:, EOS_ID].sum())
        step[B_ID, B_ID] = 0.0  # "bb": R = 0 from here on
        alive = step.sum(0)
        alive[EOS_ID] = 0.0
    return success + float(alive.sum())


def _set_offsets(model, eos: float, b: float) -> None:
    """Residual dimension 0 leaves ln_f as the constant 1 (gain 0, bias 1); lm_head reads it with weight `eos` in
    the EOS row, `b` in the "b" row and 0 in the "a" row: those logits rise by exactly the offsets."""
    with torch.no_grad():
        model.transformer.ln_f.weight[0] = 0.0
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[EOS_ID, 0] = eos
        model.lm_head.weight[B_ID, 0] = b


@dataclass(frozen=True)
class Samples:
    """N completions sampled from a policy, with the policy's next-token distributions at every position."""

    tokens: Tensor  # [N, T] token ids, EOS after the end
    mask: Tensor  # [N, T] bool: the completion's tokens (its EOS included)
    logp: Tensor  # [N, T, V] float64 log pi(. | prompt, y_<t) (0 after the end)


@torch.no_grad()
def sample(model, problem: LongHorizonProblem, n: int, generator: torch.Generator, chunk: int = 2048) -> Samples:
    """Draw n completions from the model's policy (temperature 1, KV cache), keeping pi(. | y_<t) at every position."""
    device = next(model.parameters()).device
    parts = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        ids = torch.full((m, 1), A_ID, dtype=torch.long, device=device)
        alive = torch.ones(m, dtype=torch.bool)
        past, tokens, masks, logps = None, [], [], []
        for _ in range(problem.horizon):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = torch.log_softmax(out.logits[:, -1].double().cpu(), -1)
            v = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1)
            masks.append(alive.clone())
            tokens.append(torch.where(alive, v, EOS_ID))
            logps.append(torch.where(alive[:, None], lp, 0.0))
            alive &= v != EOS_ID
            if not alive.any():
                break
            ids = v[:, None].to(device)
        pad = problem.horizon - len(tokens)
        parts.append((torch.nn.functional.pad(torch.stack(tokens, 1), (0, pad), value=EOS_ID),
                      torch.nn.functional.pad(torch.stack(masks, 1), (0, pad), value=False),
                      torch.nn.functional.pad(torch.stack(logps, 1), (0, 0, 0, pad))))
    tokens, mask, logp = (torch.cat(x) for x in zip(*parts))
    return Samples(tokens, mask, logp)


def states(tokens: Tensor) -> tuple[Tensor, Tensor]:
    """([N, T] previous token u_t, [N, T] flag f_t = [a "bb" in prompt + y_<t]) of each position."""
    prev = torch.cat([torch.full_like(tokens[:, :1], A_ID), tokens[:, :-1]], 1)
    pair = (prev == B_ID) & (tokens == B_ID)  # y_{t-1} y_t = "bb"
    flag = torch.cat([torch.zeros_like(pair[:, :1]), pair[:, :-1].cummax(1).values], 1)
    return prev, flag.long()


def rewards(tokens: Tensor) -> Tensor:
    """[N] float64 R of token rows (EOS after the end)."""
    prev, _ = states(tokens)
    return 1.0 - ((prev == B_ID) & (tokens == B_ID)).any(1).double()


def evaluate(problem: LongHorizonProblem, samples: Samples) -> dict[str, float]:
    """Estimates, each with its standard error over the samples ("<name>_se"): E[R] ("reward"), KL(pi || pi_ref)
    ("kl_ref"), KL(pi || pi*) ("kl_opt", Rao-Blackwellized as in the module docstring), J* - J ("gap" =
    beta kl_opt), J (= J* - gap), and the mean completion length ("length")."""
    prev, flag = states(samples.tokens)
    t = torch.arange(problem.horizon).expand_as(prev)
    p = samples.logp.exp() * samples.mask[..., None]  # positions after the end add nothing
    per_sample = {
        "reward": rewards(samples.tokens),
        "kl_ref": (p * (samples.logp - problem.reference[t, prev])).sum((1, 2)),
        "kl_opt": (p * (samples.logp - problem.log_optimum[t, prev, flag])).sum((1, 2)),
        "length": samples.mask.sum(1).double(),
    }
    per_sample["gap"] = problem.beta * per_sample["kl_opt"]
    out = {}
    for name, x in per_sample.items():
        out[name] = float(x.mean())
        out[name + "_se"] = float(x.std() / math.sqrt(len(x))) if len(x) > 1 else float("nan")
    out["J"] = problem.j_star - out["gap"]
    return out
