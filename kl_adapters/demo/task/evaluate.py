"""Held-out evaluation of a policy on the task: accuracy, the exact KL(pi || pi_ref) per sequence, length.

`sample` draws one completion per prompt from the policy at temperature 1 (the distribution RL optimises),
autoregressively with a KV cache, and keeps the policy's full next-token distributions. `evaluate` then scores, per
split of held-out prompts (`arithmetic.draw(..., test=True)`):

  accuracy     mean verifier reward, standard error sqrt(p (1 - p) / n)
  kl           KL(pi || pi_ref) per sequence, Rao-Blackwellized: for each sampled completion y,
               sum_t KL(pi(. | x, y_<t) || pi_ref(. | x, y_<t)) over its positions (EOS included), whose mean over
               completions drawn from pi is unbiased for the sequence KL; standard error over the completions
  length       mean completion length in tokens (EOS included)
  extra        any further reward functions' means and standard errors (the proxy setting's gold and proxy)

Sampling is seeded by `seed` inside `torch.random.fork_rng`, so an evaluation neither depends on nor disturbs the
training's random numbers, and every configuration of a seed is evaluated with the same random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .arithmetic import Example
from .reference import EOS_ID, PAD_ID

#: completion -> reward, for each prompt's example
Scorer = Callable[[list[str], list[Example]], list[float]]


@dataclass(frozen=True)
class Samples:
    prompts: Tensor  # [n, P] left-padded prompt ids
    prompt_mask: Tensor  # [n, P]
    tokens: Tensor  # [n, T] completion ids, PAD after the end
    mask: Tensor  # [n, T] bool: the completion's tokens, EOS included
    logp: Tensor  # [n, T, V] float32 log pi(. | x, y_<t) at every position (junk past the end)


def encode_prompts(tok, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and mask (as TRL pads them)."""
    ids = [tok.convert_tokens_to_ids(list(p)) for p in prompts]
    width = max(map(len, ids))
    out = torch.full((len(ids), width), PAD_ID)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return out, mask


@torch.no_grad()
def sample(model, prompts: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Samples:
    """One completion per prompt from the model at temperature 1 (uses torch's global RNG)."""
    n = prompts.shape[0]
    out = model(input_ids=prompts, attention_mask=prompt_mask, use_cache=True)
    past, attention = out.past_key_values, prompt_mask
    logits = out.logits[:, -1]
    tokens, logps = [], []
    alive = torch.ones(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), -1)
        token = torch.multinomial(logp.exp(), 1).squeeze(-1)
        token = torch.where(alive, token, PAD_ID)
        tokens.append(token), logps.append(logp)
        alive = alive & (token != EOS_ID)
        if not alive.any():
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
        out = model(input_ids=token[:, None], attention_mask=attention, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    tokens = torch.stack(tokens, 1)
    ended = (tokens == EOS_ID).cumsum(1)
    mask = (ended == 0) | ((ended == 1) & (tokens == EOS_ID))
    return Samples(prompts, prompt_mask, tokens, mask, torch.stack(logps, 1))


@torch.no_grad()
def completion_logps(model, samples: Samples) -> Tensor:
    """[n, T, V] float32 log-probs of the model at the completion positions of the samples (teacher forcing)."""
    ids = torch.cat([samples.prompts, samples.tokens], 1)
    attention = torch.cat([samples.prompt_mask, samples.mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits
    p, t = samples.prompts.shape[1], samples.tokens.shape[1]
    return torch.log_softmax(logits[:, p - 1:p - 1 + t].float(), -1)


def sequence_kl(samples: Samples, ref_logp: Tensor) -> Tensor:
    """[n] sum over live positions of KL(pi(. | y_<t) || pi_ref(. | y_<t)), in float64."""
    p = samples.logp.double()
    per_position = (p.exp() * (p - ref_logp.double())).sum(-1)
    return torch.where(samples.mask, per_position, 0.0).sum(-1)


def mean_se(values: list[float] | Tensor) -> tuple[float, float]:
    x = torch.as_tensor(values, dtype=torch.float64)
    if x.numel() < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), float(x.std() / math.sqrt(x.numel()))


def evaluate(policy, reference, tok, splits: dict[str, list[Example]], max_new_tokens: int, seed: int,
             scorers: dict[str, Scorer], batch: int = 512) -> dict[str, dict[str, float]]:
    """Per split: each scorer's mean and standard error ("<name>", "<name>_se"), KL(pi || pi_ref) per sequence
    ("kl", "kl_se") and the mean length, from one completion per prompt sampled from `policy`."""
    was_training = policy.training
    policy.eval()
    out = {}
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, examples in splits.items():
                scores: dict[str, list[float]] = {k: [] for k in scorers}
                kls, lengths = [], []
                for i in range(0, len(examples), batch):
                    chunk = examples[i:i + batch]
                    samples = sample(policy, *encode_prompts(tok, [e.prompt for e in chunk]), max_new_tokens)
                    texts = decode(tok, samples)
                    for key, scorer in scorers.items():
                        scores[key] += scorer(texts, chunk)
                    kls.append(sequence_kl(samples, completion_logps(reference, samples)))
                    lengths.append(samples.mask.sum(-1).double())
                row = {}
                for key, values in scores.items():
                    row[key], row[key + "_se"] = mean_se(values)
                row["kl"], row["kl_se"] = mean_se(torch.cat(kls))
                row["length"] = float(torch.cat(lengths).mean())
                out[name] = row
    finally:
        policy.train(was_training)
    return out


def decode(tok, samples: Samples) -> list[str]:
    """The completions' text without EOS (as TRL hands completions to reward functions)."""
    return ["".join(tok.convert_ids_to_tokens([int(t) for t, m in zip(row, live) if m and int(t) != EOS_ID]))
            for row, live in zip(samples.tokens, samples.mask)]
