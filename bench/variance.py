"""Variance and bias of every KL preset's batch gradient on a long-horizon bigram policy, against an exact gradient.

Model. V tokens, the last is EOS; the state is the previous token (BOS before the first), so a policy is a [V, V]
table of logits (row V - 1 = BOS). pi_ref logits ~ N(0, 1) with the EOS logit set so that pi_ref(EOS | s) = eos/T
(sequences mostly run to the horizon T); pi = pi_ref + drift * N(0, 1) per logit; off-policy, the batch is sampled
from mu = pi + offp * N(0, 1) per logit (the staleness of PPO epochs / async rollouts; per-token KL(mu || pi) is about
offp^2 / 2). Everything is float64.

Exact target. KL_seq = sum_t sum_s q_t(s) KL(pi(.|s) || pi_ref(.|s)) with q_t the probability of being alive in
state s at position t (dynamic programming over (position, state)); grad KL_seq by autograd through that recursion.

Estimators. A batch is G sequences. For presets of the registry the batch gradient is
    g = (1/G) sum_j sum_t c_{j,t} grad log pi(y_{j,t} | s_{j,t}),   grad log pi(y | s) = e_{s,y} - e_s (x) pi(.|s)
with c = kl_coefficients(...) (leave-one-out statistics within each batch, with the policy's end-of-sequence
probabilities as the adapters pass them, EndOfSequence, unless --no-eos), scattered into the table without autograd.
`full` (kl_adapters/full_vocab.py) adds the pathwise term sum_t w_{1:t-1} grad KL(pi(.|s_t) || pi_ref(.|s_t)) with the
exact per-state KL. Per cell (T, G, drift, regime): over n_batches independent batches,
    ratio = tr Cov[g_preset] / tr Cov[g_token]  (same samples), with a delta-method standard error,
    bias  = |mean g - grad KL_seq| / |grad KL_seq|, with se = sqrt(tr Cov[g] / n_batches) / |grad KL_seq|:
the norm of the Monte Carlo error of the mean in V^2 dimensions, so an unbiased preset shows bias ~ se and a biased
one bias >> se; and for a reduced preset, paired with its plain form on the same batches (`plain_of`; "KL vs plain"),
    plain_ratio = mean |g_preset - grad KL_seq|^2 / mean |g_plain - grad KL_seq|^2, with a delta-method standard error
(the two errors are correlated batch by batch, so this is far tighter than the two traces' separate errors).
Task + KL (--task SCALE > 0): the gradient a trainer takes. A task reward R(y) = SCALE * (number of tokens 0 in y),
GRPO's advantages A_j = R_j - the batch mean, the reduced presets' statistics fitted with them (TaskAdvantages with
beta = --beta), and per batch the ascent direction
    g_total = (1/G) sum_j sum_t (A_j - beta c_{j,t}) grad log pi(y_{j,t} | s_{j,t})   (- beta x `full`'s pathwise term)
whose expectation is (1 - 1/G) grad E[R] - beta grad KL_seq (exact by dynamic programming; total_bias against it).
total_ratio = tr Cov[g_total] / tr Cov[g_total of sequence-plain] on the same batches: <= 1 is the target every
reduced preset must meet. --states N...: measure at the policies after N exact Adam ascent steps on J = E[R] -
beta KL_seq (--ascent-lr) from the drifted policy, i.e. along the way from pi_ref to the regularized optimum.
Micro-batch mode (--micro): rollout batches of N sequences; statistics from all N rows (`kl_statistics` /
`full_statistics` on the rollout batch, sliced per micro-batch) against statistics within each micro-batch of m rows.

Usage: .venvs/core/bin/python bench/variance.py [--quick] [--horizons 16 64] [--groups 16] [--drifts 0.05]
       [--regimes on] [--presets sequence token] [--task 0.05 --beta 0.1 --states 0 20 300] [--no-eos] [--micro]
       [--name NAME]
Writes bench/results/variance_<name>.{json,txt,png} (name: full, quick, micro, or --name).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
from timing import RESULTS, write_result  # noqa: E402
from zeroed_statistics import zeroed  # noqa: E402

import kl_adapters  # noqa: E402
from kl_adapters import PRESETS, EndOfSequence, TaskAdvantages, kl_coefficients, kl_statistics  # noqa: E402
from kl_adapters.full_vocab import full_coefficients, full_statistics  # noqa: E402
from kl_adapters.reductions import termination_increments  # noqa: E402

DTYPE = torch.float64
BENCH_PRESETS = ("sequence", "reward", "sequence-plain", "reward-plain", "token", "k3-loss", "k3-reward", "full")
REFERENCE = "token"
#: the floor of task + KL: every reduced preset's total_ratio is its trained gradient's variance relative to this one
TOTAL_REFERENCE = "sequence-plain"


def plain_of(preset: str) -> str | None:
    """The unreduced form a reduced preset must not be noisier than (`full`, with no plain form of its own, against
    sequence-plain, the floor of task + KL); None for a preset that is not reduced."""
    return {"sequence": TOTAL_REFERENCE, "full": TOTAL_REFERENCE, "reward": "reward-plain"}.get(preset)


@dataclass(frozen=True)
class Bigram:
    """Logit tables [V, V] (row = state: previous token, V - 1 = BOS) of pi, pi_ref and the behaviour policy mu."""

    logits: Tensor
    ref_logits: Tensor
    behaviour_logits: Tensor

    @property
    def vocab(self) -> int:
        return self.logits.shape[-1]


def bigram(vocab: int, horizon: int, drift: float, offp: float, eos: float, seed: int) -> Bigram:
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(vocab, vocab, generator=gen, dtype=DTYPE)
    rate = eos / horizon
    ref[:, -1] = torch.logsumexp(ref[:, :-1], -1) + math.log(rate / (1 - rate))
    pi = ref + drift * torch.randn(vocab, vocab, generator=gen, dtype=DTYPE)
    return Bigram(pi, ref, pi + offp * torch.randn(vocab, vocab, generator=gen, dtype=DTYPE))


def state_kl(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """[V] KL(pi(.|s) || pi_ref(.|s)) per state."""
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def exact_kl_seq(logits: Tensor, ref_logits: Tensor, horizon: int, per_state: Tensor | None = None) -> Tensor:
    """KL_seq by dynamic programming: q_1 = e_BOS, q_{t+1}(v) = sum_s q_t(s) pi(v|s) for v != EOS (differentiable):
    sum_t q_t @ KL(.|s). per_state [V] in place of the per-state KL gives another per-position expectation."""
    probs = torch.softmax(logits, -1)
    kl = state_kl(logits, ref_logits) if per_state is None else per_state
    vocab = logits.shape[-1]
    q = torch.zeros(vocab, dtype=logits.dtype)
    q[-1] = 1.0
    total = torch.zeros((), dtype=logits.dtype)
    for _ in range(horizon):
        total = total + q @ kl
        nxt = q @ probs
        q = torch.cat([nxt[:-1], torch.zeros(1, dtype=logits.dtype)])
    return total


def exact_reward(logits: Tensor, horizon: int, scale: float) -> Tensor:
    """E[R] of R = scale * (number of tokens 0) by the same recursion (token 0 is never EOS; differentiable)."""
    return exact_kl_seq(logits, logits, horizon, per_state=scale * torch.softmax(logits, -1)[:, 0])


def exact_gradient(model: Bigram, horizon: int) -> tuple[Tensor, float]:
    """(grad KL_seq flattened [V * V], KL_seq)."""
    theta = model.logits.clone().requires_grad_(True)
    kl = exact_kl_seq(theta, model.ref_logits, horizon)
    return torch.autograd.grad(kl, theta)[0].flatten(), float(kl.detach())


def exact_task_gradient(model: Bigram, horizon: int, scale: float) -> tuple[Tensor, float]:
    """(grad E[R] flattened [V * V], E[R])."""
    theta = model.logits.clone().requires_grad_(True)
    reward = exact_reward(theta, horizon, scale)
    return torch.autograd.grad(reward, theta)[0].flatten(), float(reward.detach())


def ascended(model: Bigram, horizon: int, steps: int, scale: float, beta: float, lr: float) -> Bigram:
    """The model after `steps` Adam steps on the exact J = E[R] - beta KL_seq (the behaviour policy keeps its offset)."""
    theta = model.logits.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    for _ in range(steps):
        objective = exact_reward(theta, horizon, scale) - beta * exact_kl_seq(theta, model.ref_logits, horizon)
        optimizer.zero_grad()
        (-objective).backward()
        optimizer.step()
    return Bigram(theta.detach(), model.ref_logits, model.behaviour_logits + theta.detach() - model.logits)


@dataclass(frozen=True)
class Samples:
    """n sequences [n, T]: state and token per position, mask, log pi / pi_ref / mu of the sampled tokens, and
    pi(EOS | state) at every position (the current policy's end-of-sequence probability, 0 at padding)."""

    states: Tensor
    tokens: Tensor
    mask: Tensor
    logp: Tensor
    ref_logp: Tensor
    old_logp: Tensor | None
    eos_prob: Tensor

    def rows(self, part: slice) -> Samples:
        return Samples(*(None if x is None else x[part] for x in (self.states, self.tokens, self.mask, self.logp,
                                                                   self.ref_logp, self.old_logp, self.eos_prob)))

    def eos(self, vocab: int) -> EndOfSequence:
        """EndOfSequence of these rows (the last token, vocab - 1, is EOS; horizon = the width)."""
        return EndOfSequence(self.eos_prob, self.mask & (self.tokens == vocab - 1), self.mask.shape[1])


def sample(model: Bigram, n: int, horizon: int, off_policy: bool, gen: torch.Generator) -> Samples:
    """n sequences from pi (or mu when off_policy); a sequence stops after EOS (mask 0 afterwards)."""
    sampler = model.behaviour_logits if off_policy else model.logits
    cdf = torch.softmax(sampler, -1).cumsum(-1)
    vocab = model.vocab
    states = torch.empty(n, horizon, dtype=torch.long)
    tokens = torch.empty(n, horizon, dtype=torch.long)
    mask = torch.empty(n, horizon, dtype=torch.bool)
    state = torch.full((n,), vocab - 1, dtype=torch.long)
    alive = torch.ones(n, dtype=torch.bool)
    for t in range(horizon):
        u = torch.rand(n, 1, generator=gen, dtype=DTYPE)
        tok = torch.searchsorted(cdf[state], u)[:, 0].clamp(max=vocab - 1)
        states[:, t], tokens[:, t], mask[:, t] = state, tok, alive
        alive = alive & (tok != vocab - 1)
        state = tok
    lp, lq = torch.log_softmax(model.logits, -1), torch.log_softmax(model.ref_logits, -1)
    old = torch.log_softmax(model.behaviour_logits, -1)[states, tokens] * mask if off_policy else None
    eos_prob = torch.softmax(model.logits, -1)[states, -1] * mask
    return Samples(states, tokens, mask, lp[states, tokens] * mask, lq[states, tokens] * mask, old, eos_prob)


def batch_gradients(s: Samples, probs: Tensor, group_size: int, score_w: Tensor,
                    path: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """[n / G, V * V] batch gradients (1/G) sum_j sum_t c_t (e_{s_t, y_t} - e_{s_t} (x) pi(.|s_t)) (+ the pathwise
    term sum_t path_w_t grad KL(.|s_t) given path = (path_w [n, T], grad KL table [V, V]))."""
    n, vocab = s.states.shape[0], probs.shape[0]
    nb = n // group_size
    batch = torch.arange(n)[:, None] // group_size
    counts = torch.zeros(nb * vocab * vocab, dtype=DTYPE)
    counts.index_add_(0, ((batch * vocab + s.states) * vocab + s.tokens).flatten(), (score_w * s.mask).flatten())
    counts = counts.view(nb, vocab, vocab)
    g = counts - counts.sum(-1, keepdim=True) * probs
    if path is not None:
        at_state = torch.zeros(nb * vocab, dtype=DTYPE).index_add_(0, (batch * vocab + s.states).flatten(),
                                                                   (path[0] * s.mask).flatten())
        g = g + at_state.view(nb, vocab, 1) * path[1]
    return g.flatten(1) / group_size


def uses_group(name: str) -> bool:
    """Presets whose weights depend on how rows are grouped into batches (leave-one-out statistics)."""
    return name == "full" or PRESETS[name].uses_batch_statistics


#: rows per call of a grouped preset (leave-one-out statistics cost O(rows^2) per call); a multiple of every group size
ROWS_PER_CALL = 1024


def preset_weights(name: str, s: Samples, model: Bigram, group: Tensor | None, statistics: str = "batch",
                   task: TaskAdvantages | None = None, eos: bool = True) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """(score weights c [n, T], pathwise part or None) of one preset, leave-one-out within `group` where it applies.

    statistics="batch": computed within `group` by the loss; "rollout": precomputed over the same groups with
    kl_statistics and passed as statistics= (the code path adapters use with micro-batches); fitted with `task` (the
    rows' advantages) and the end-of-sequence probabilities (eos). Grouped rows go in blocks of ROWS_PER_CALL
    consecutive rows (groups are consecutive and never straddle a block)."""
    rows = s.states.shape[0]
    if group is not None and rows > ROWS_PER_CALL:
        parts = [preset_weights(name, s.rows(slice(i, i + ROWS_PER_CALL)), model, group[i:i + ROWS_PER_CALL],
                                statistics, None if task is None else TaskAdvantages(
                                    task.advantages[i:i + ROWS_PER_CALL], task.beta, task.normalized), eos)
                 for i in range(0, rows, ROWS_PER_CALL)]
        path = None if parts[0][1] is None else (torch.cat([p[1][0] for p in parts]), parts[0][1][1])
        return torch.cat([p[0] for p in parts]), path
    end = s.eos(model.vocab) if eos else None
    if name == "full":
        kl = state_kl(model.logits, model.ref_logits)
        mf = s.mask.to(DTYPE)
        kl_t = kl[s.states] * mf
        log_rho = torch.zeros_like(kl_t) if s.old_logp is None else (s.logp - s.old_logp) * mf
        stats = full_statistics(kl_t, s.logp, s.ref_logp, s.mask, old_logp=s.old_logp, group=group, task=task,
                                eos=end)
        eta = None if end is None else termination_increments(end, mf, DTYPE)
        path_w, score = full_coefficients(kl_t, (s.logp - s.ref_logp) * mf, log_rho, mf, stats, eta)
        lp, lq = torch.log_softmax(model.logits, -1), torch.log_softmax(model.ref_logits, -1)
        return score, (path_w, lp.exp() * (lp - lq - kl[:, None]))
    extra = {}
    if PRESETS[name].uses_batch_statistics:
        extra = ({"statistics": kl_statistics(s.logp, s.ref_logp, s.mask, old_logp=s.old_logp, group=group,
                                              preset=name, task=task, eos=end), "eos": end}
                 if statistics == "rollout" else {"group": group, "task": task, "eos": end})
    return kl_coefficients(s.logp, s.ref_logp, s.mask, preset=name, old_logp=s.old_logp, **extra), None


def preset_gradients(name: str, s: Samples, model: Bigram, group: Tensor, group_size: int,
                     statistics: str = "batch") -> Tensor:
    """[n / G, V * V] batch gradients of one preset on rows grouped into consecutive batches of group_size."""
    c, path = preset_weights(name, s, model, group, statistics)
    return batch_gradients(s, torch.softmax(model.logits, -1), group_size, c, path)


def task_advantages(s: Samples, group_size: int, scale: float, beta: float) -> TaskAdvantages:
    """GRPO advantages of R = scale * (number of tokens 0): R minus the mean of its batch of group_size rows."""
    reward = scale * ((s.tokens == 0) & s.mask).sum(-1).to(DTYPE)
    batch = reward.view(-1, group_size)
    return TaskAdvantages((batch - batch.mean(-1, keepdim=True)).flatten(), beta)


class Moments:
    """Running sums over batches of g and of |g - target|^2 (kept per batch for the ratio's standard error)."""

    def __init__(self, target: Tensor):
        self.target, self.total, self.dist = target, torch.zeros_like(target), []

    def add(self, g: Tensor) -> None:
        self.total += g.sum(0)
        self.dist.append((g - self.target).square().sum(-1))

    def summary(self) -> dict:
        d = torch.cat(self.dist)
        nb, norm = d.numel(), float(self.target.norm())
        offset = self.total / nb - self.target
        trace = nb / (nb - 1) * (float(d.mean()) - float(offset.square().sum()))
        return {"n_batches": nb, "trace": trace, "bias": float(offset.norm()) / norm,
                "bias_se": math.sqrt(max(trace, 0.0) / nb) / norm}


def ratio_with_se(num: Tensor, den: Tensor) -> tuple[float, float]:
    """mean(num) / mean(den) and its delta-method standard error from per-batch squared distances."""
    r = float(num.mean() / den.mean())
    se = float((num - r * den).std() / den.mean()) / math.sqrt(num.numel())
    return r, se


class Progress:
    """A one-line progress bar on stderr: done / total units, elapsed and remaining time."""

    def __init__(self, total: float, label: str):
        self.total, self.done, self.label, self.start = total, 0.0, label, time.perf_counter()

    def step(self, units: float, what: str) -> None:
        self.done += units
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        bar = "#" * int(30 * self.done / self.total)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * self.done / self.total:5.1f}% {elapsed:6.0f}s "
                         f"eta {eta:5.0f}s {what:<40}")
        sys.stderr.flush()
        if self.done >= self.total:
            sys.stderr.write("\n")


def n_sequences(horizon: int, args: argparse.Namespace) -> int:
    """Sequences sampled per (T, drift, regime): the token budget / T, at least min_batches batches of the largest G,
    rounded up to a multiple of the largest G (so every G sees whole batches of the same samples)."""
    big = max(args.groups)
    n = max(args.tokens // horizon, args.min_batches * big)
    return -(-n // big) * big


def run_grid(args: argparse.Namespace) -> list[dict]:
    cells = [(h, d, r, st) for h in args.horizons for d in args.drifts for r in args.regimes for st in args.states]
    progress = Progress(sum(n_sequences(h, args) * h for h, _, _, _ in cells), "variance")
    rows = []
    for horizon, drift, regime, state in cells:
        model = bigram(args.vocab, horizon, drift, args.offp, args.eos, args.seed)
        if state:
            model = ascended(model, horizon, state, args.task, args.beta, args.ascent_lr)
        target, kl = exact_gradient(model, horizon)
        task_grad, reward = exact_task_gradient(model, horizon, args.task) if args.task else (None, 0.0)
        gen = torch.Generator().manual_seed(args.seed + 1)
        n, chunk = n_sequences(horizon, args), max(max(args.groups), args.chunk_tokens // horizon // max(args.groups)
                                                   * max(args.groups))
        moments = {(g, p): Moments(target) for g in args.groups for p in args.presets}
        totals = ({(g, p): Moments((1 - 1 / g) * task_grad - args.beta * target) for g in args.groups
                   for p in args.presets} if args.task else {})
        quota = {g: min(n, args.max_batches * g) for g in args.groups}  # rows each G uses
        probs = torch.softmax(model.logits, -1)
        t0 = time.perf_counter()
        for start in range(0, n, chunk):
            s = sample(model, min(chunk, n - start), horizon, regime == "off", gen)
            fixed = {p: preset_weights(p, s, model, None, eos=not args.no_eos) for p in args.presets
                     if not uses_group(p)}
            for g in args.groups:
                used = min(s.states.shape[0], quota[g] - start)
                if used <= 0:
                    continue
                part = s.rows(slice(0, used))
                group = torch.arange(used) // g
                task = task_advantages(part, g, args.task, args.beta) if args.task else None
                g_task = None if task is None else batch_gradients(part, probs, g, task.advantages[:, None])
                for p in args.presets:
                    c, path = ((fixed[p][0][:used], None) if p in fixed
                               else preset_weights(p, part, model, group, task=task, eos=not args.no_eos))
                    g_kl = batch_gradients(part, probs, g, c, path)
                    moments[(g, p)].add(g_kl)
                    if g_task is not None:
                        totals[(g, p)].add(g_task - args.beta * g_kl)
            progress.step(s.states.shape[0] * horizon, f"T={horizon} drift={drift} {regime}-policy state {state}")
        seconds = time.perf_counter() - t0
        mean_len = float(s.mask.sum(-1).to(DTYPE).mean())
        for g in args.groups:
            ref = moments[(g, REFERENCE)]
            for p in args.presets:
                m = moments[(g, p)]
                ratio, ratio_se = ratio_with_se(torch.cat(m.dist), torch.cat(ref.dist))
                row = {"T": horizon, "G": g, "drift": drift, "regime": regime, "state": state, "preset": p,
                       **m.summary(), "ratio": m.summary()["trace"] / ref.summary()["trace"], "ratio_se": ratio_se,
                       "ratio_of_mean_sq_dist": ratio, "kl_seq": kl, "reward": reward, "mean_length": mean_len,
                       "n_sequences": n, "seconds_all_groups_presets": seconds}
                if plain_of(p) in args.presets:  # paired on the same batches: far tighter than two traces' se
                    row["plain_ratio"], row["plain_ratio_se"] = ratio_with_se(torch.cat(m.dist), torch.cat(
                        moments[(g, plain_of(p))].dist))
                if args.task:
                    mine, plain = totals[(g, p)].summary(), totals[(g, TOTAL_REFERENCE)].summary()
                    row.update(total_trace=mine["trace"], total_bias=mine["bias"], total_bias_se=mine["bias_se"],
                               total_ratio=mine["trace"] / plain["trace"], total_ratio_se=ratio_with_se(
                                   torch.cat(totals[(g, p)].dist), torch.cat(totals[(g, TOTAL_REFERENCE)].dist))[1])
                rows.append(row)
    return rows


def run_micro(args: argparse.Namespace) -> list[dict]:
    """Rollout batches of N rows, gradient = mean over the N rows (micro-batches of m rows, accumulated); statistics
    over the rollout batch ("rollout") or within each micro-batch ("micro"); ratio to `token` on the same batches."""
    presets = [p for p in args.presets if p == "full" or PRESETS[p].uses_batch_statistics]
    cells = [(h, big) for h in args.horizons for big in args.rollouts]
    progress = Progress(sum(n_sequences(h, args) * h for h, _ in cells), "micro")
    rows = []
    for horizon, rollout in cells:
        model = bigram(args.vocab, horizon, args.drifts[0], args.offp, args.eos, args.seed)
        target, _ = exact_gradient(model, horizon)
        gen = torch.Generator().manual_seed(args.seed + 1)
        n = -(-n_sequences(horizon, args) // rollout) * rollout
        chunk = max(rollout, args.chunk_tokens // horizon // rollout * rollout)
        keys = [(m, p, src) for m in args.micro_sizes for p in presets for src in ("rollout", "micro")]
        moments = {k: Moments(target) for k in keys}
        ref = Moments(target)
        for start in range(0, n, chunk):
            s = sample(model, min(chunk, n - start), horizon, args.regimes[0] == "off", gen)
            rows_idx = torch.arange(s.states.shape[0])
            ref.add(preset_gradients(REFERENCE, s, model, rows_idx // rollout, rollout))
            for m, p, src in keys:
                group = rows_idx // rollout if src == "rollout" else rows_idx // m
                moments[(m, p, src)].add(preset_gradients(p, s, model, group, rollout, statistics="rollout"))
            progress.step(s.states.shape[0] * horizon, f"T={horizon} N={rollout}")
        for m, p, src in keys:
            mo = moments[(m, p, src)]
            ratio, se = ratio_with_se(torch.cat(mo.dist), torch.cat(ref.dist))
            rows.append({"T": horizon, "N": rollout, "m": m, "preset": p, "statistics": src, **mo.summary(),
                         "ratio": mo.summary()["trace"] / ref.summary()["trace"], "ratio_se": se,
                         "drift": args.drifts[0], "regime": args.regimes[0]})
    return rows


def grid_table(rows: list[dict], presets: list[str], short: bool = False) -> str:
    """One line per (drift, regime, state, G, T): each preset's ratio to token, then (with a task) each preset's task
    + KL ratio to sequence-plain, then each reduced preset's paired KL ratio to its plain form (`plain_of`), then each
    preset's bias / se (short: ratios of the two largest G only)."""
    head = (f"{'drift':>6} {'reg':>4} {'st':>4} {'G':>3} {'T':>5} {'batches':>7} | "
            + " ".join(f"{p[:13]:>13}" for p in presets))
    out = ["ratio = tr Cov[g] / tr Cov[g_token] (+- se) of the KL term; task+KL = tr Cov[g_total] / tr Cov[g_total of "
           f"{TOTAL_REFERENCE}] (with --task); then relative bias |E g - grad KL_seq| / |grad KL_seq| (bias/se: an "
           "unbiased preset shows ~1); st = ascent steps", head, "-" * len(head)]
    by = {(r["drift"], r["regime"], r.get("state", 0), r["G"], r["T"], r["preset"]): r for r in rows}
    largest = sorted({r["G"] for r in rows})[-2:]
    for key in sorted({k[:5] for k in by}):
        if short and key[3] not in largest:
            continue
        cells = [by[(*key, p)] for p in presets]
        out.append(f"{key[0]:>6g} {key[1]:>4} {key[2]:>4} {key[3]:>3} {key[4]:>5} {cells[0]['n_batches']:>7} | "
                   + " ".join(f"{c['ratio']:>7.3g}±{c['ratio_se']:<5.2g}" for c in cells))
        if "total_ratio" in cells[0]:
            out.append(f"{'':>6} {'':>4} {'':>4} {'':>3} {'task+KL':>13} | "
                       + " ".join(f"{c['total_ratio']:>7.3g}±{c['total_ratio_se']:<5.2g}" for c in cells))
        if not short and any("plain_ratio" in c for c in cells):
            out.append(f"{'':>6} {'':>4} {'':>4} {'':>3} {'KL vs plain':>13} | " + " ".join(
                f"{c['plain_ratio']:>7.3g}±{c['plain_ratio_se']:<5.2g}" if "plain_ratio" in c else f"{'':>13}"
                for c in cells))
        if not short:
            out.append(f"{'':>6} {'':>4} {'':>4} {'':>3} {'bias':>13} | "
                       + " ".join(f"{c['bias']:>7.2g}/{c['bias'] / c['bias_se']:<5.2g}" for c in cells))
    return "\n".join(out)


def micro_table(rows: list[dict]) -> str:
    head = f"{'T':>5} {'N':>3} {'m':>2} {'preset':>10} | {'rollout stats':>18} {'micro stats':>18} {'batches':>8}"
    out = ["ratio to token of the rollout batch's gradient (N rows, micro-batches of m accumulated): statistics over "
           "the N rows vs within each micro-batch", head, "-" * len(head)]
    by = {(r["T"], r["N"], r["m"], r["preset"], r["statistics"]): r for r in rows}
    for key in sorted({k[:4] for k in by}):
        a, b = by[(*key, "rollout")], by[(*key, "micro")]
        out.append(f"{key[0]:>5} {key[1]:>3} {key[2]:>2} {key[3]:>10} | {a['ratio']:>10.3g}±{a['ratio_se']:<7.2g}"
                   f"{b['ratio']:>10.3g}±{b['ratio_se']:<7.2g} {a['n_batches']:>8}")
    return "\n".join(out)


#: issue 11 item 6 and issue 16 item 4: (preset, largest T it applies to, ratio bound), on-policy, drift 0.05, G >= 16
RATIO_TARGETS = (("sequence", 256, 1.5), ("sequence", 4096, 3.0), ("reward", 256, 1.5), ("reward", 4096, 3.0),
                 ("full", 256, 1.0), ("full", 4096, 2.0))


def targets_report(rows: list[dict]) -> str:
    """Every cell against the targets: ratio bounds (small drift, on-policy, G >= 16), reduced <= plain in every cell
    (KL term; and task + KL where measured), off-policy ratio within 2x of on-policy."""
    by = {(r["T"], r["G"], r["drift"], r["regime"], r.get("state", 0), r["preset"]): r for r in rows}
    small = min(r["drift"] for r in rows)
    out, met, total = [], 0, 0

    def verdict(ok: bool) -> str:
        nonlocal met, total
        met, total = met + ok, total + 1
        return "met " if ok else "MISS"

    out.append(f"1. ratio to token, on-policy, drift {small:g}, G >= 16 (bound applies to T <= 256, or T = 4096)")
    for preset, horizon, bound in RATIO_TARGETS:
        for (t, g, d, reg, st, p), r in sorted(by.items()):
            in_range = t <= 256 if horizon == 256 else t == horizon
            if p == preset and d == small and reg == "on" and g >= 16 and in_range and st == 0:
                out.append(f"   {verdict(r['ratio'] <= bound)} {p:<9} T={t:<5} G={g:<3} ratio {r['ratio']:.3g} "
                           f"+- {r['ratio_se']:.2g} (bound {bound:g}; {r['n_batches']} batches)")
    out.append("2. reduced <= plain in every cell (sequence and full vs sequence-plain, reward vs reward-plain; KL term"
               " alone, and task + KL where measured)")
    for (t, g, d, reg, st, p), r in sorted(by.items()):
        plain = by.get((t, g, d, reg, st, plain_of(p))) if plain_of(p) else None
        if plain is not None:
            where = f"{p:<9} T={t:<5} G={g:<3} drift={d:<5g} {reg:>3} state={st:<4}"
            paired = (f" (paired mean squared error ratio {r['plain_ratio']:.3g} +- {r['plain_ratio_se']:.2g})"
                      if "plain_ratio" in r else "")
            out.append(f"   {verdict(r['ratio'] <= plain['ratio'])} {where} KL: {r['ratio']:.3g} vs plain "
                       f"{plain['ratio']:.3g}{paired}")
            if "total_ratio" in r:
                out.append(f"   {verdict(r['total_ratio'] <= plain['total_ratio'])} {where} task+KL: "
                           f"{r['total_ratio']:.3g} vs plain {plain['total_ratio']:.3g}")
    out.append("3. off-policy ratio within 2x of on-policy (same T, G, drift)")
    for (t, g, d, reg, st, p), r in sorted(by.items()):
        on = by.get((t, g, d, "on", st, p))
        if reg == "off" and p in ("sequence", "reward", "full") and on is not None:
            factor = r["ratio"] / on["ratio"]
            out.append(f"   {verdict(factor <= 2.0)} {p:<9} T={t:<5} G={g:<3} drift={d:<5g}: off {r['ratio']:.3g} / "
                       f"on {on['ratio']:.3g} = {factor:.3g}")
    return f"targets met: {met} of {total} cells\n" + "\n".join(out)


def plot(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.regimes), len(args.drifts), figsize=(4.5 * len(args.drifts),
                             3.6 * len(args.regimes)), squeeze=False, sharex=True)
    styles = {g: ls for g, ls in zip(sorted(args.groups, reverse=True), ("-", "--", ":", "-."))}
    shown = [g for g in sorted(args.groups, reverse=True)[:2]]
    for i, regime in enumerate(args.regimes):
        for j, drift in enumerate(args.drifts):
            ax = axes[i][j]
            for k, p in enumerate(args.presets):
                for g in shown:
                    pts = sorted((r["T"], r["ratio"]) for r in rows if r["preset"] == p and r["G"] == g
                                 and r["drift"] == drift and r["regime"] == regime and r["ratio"] > 0
                                 and r.get("state", 0) == args.states[0])
                    if pts:
                        ax.plot(*zip(*pts), styles[g], color=f"C{k}", marker="o", ms=3,
                                label=f"{p} G={g}" if (i, j) == (0, 0) else None)
            ax.set(xscale="log", yscale="log", title=f"{regime}-policy, drift {drift:g}", xlabel="T",
                   ylabel="tr Cov / tr Cov(token)")
            ax.grid(alpha=0.3, which="both")
    fig.legend(loc="lower center", ncol=min(8, len(args.presets) * len(shown)), fontsize=7)
    fig.tight_layout(rect=(0, 0.08 if len(args.regimes) > 1 else 0.14, 1, 1))
    fig.savefig(path, dpi=110)


def core_fingerprint() -> dict[str, str]:
    """sha256 (first 12 hex digits) of the installed estimator sources the numbers depend on."""
    root = Path(kl_adapters.__file__).parent
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12]
            for f in ("presets.py", "reductions.py", "surrogate.py", "full_vocab.py")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small grid: T 16 64 256, G 4 16, drift 0.05, on/off")
    ap.add_argument("--micro", action="store_true", help="micro-batch mode: rollout statistics vs micro-batch ones "
                    "(at the first of --drifts and --regimes)")
    ap.add_argument("--horizons", type=int, nargs="+", default=None,
                    help="default 16 64 256 1024 4096 (micro mode: 256 1024)")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--drifts", type=float, nargs="+", default=[0.05, 0.2, 1.0])
    ap.add_argument("--regimes", nargs="+", choices=("on", "off"), default=["on", "off"])
    ap.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS))
    ap.add_argument("--rollouts", type=int, nargs="+", default=[16, 64], help="micro mode: rollout batch sizes N")
    ap.add_argument("--micro-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="micro mode: micro-batch sizes")
    ap.add_argument("--vocab", type=int, default=16, help="V including EOS")
    ap.add_argument("--offp", type=float, default=0.05, help="behaviour = pi + offp * N(0,1) per logit")
    ap.add_argument("--eos", type=float, default=0.25, help="pi_ref(EOS | s) = eos / T")
    ap.add_argument("--tokens", type=int, default=2 ** 20, help="sampled tokens per (T, drift, regime)")
    ap.add_argument("--min-batches", type=int, default=16, help="at least this many batches of the largest G")
    ap.add_argument("--max-batches", type=int, default=4096, help="use at most this many batches per G")
    ap.add_argument("--chunk-tokens", type=int, default=2 ** 19, help="tokens processed at once (memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", type=float, default=0.0,
                    help="task reward scale: R = TASK * (number of tokens 0); 0 = the KL term alone")
    ap.add_argument("--beta", type=float, default=0.1, help="KL coefficient of the task + KL gradient (with --task)")
    ap.add_argument("--states", type=int, nargs="+", default=[0],
                    help="exact Adam ascent steps on J = E[R] - beta KL from the drifted policy (with --task)")
    ap.add_argument("--ascent-lr", type=float, default=0.01)
    ap.add_argument("--no-eos", action="store_true", help="without the end-of-sequence probabilities (no termination "
                    "control variate)")
    ap.add_argument("--zero", nargs="+", default=[], metavar="STAT",
                    help="diagnostic: set these fitted statistics of the reduced presets to zero (cv_coef, eos_coef, "
                    "past_coef, baseline; bench/zeroed_statistics.py): still exact, shows each term's share")
    ap.add_argument("--note", default="", help="machine conditions to record in the results (e.g. other work running)")
    ap.add_argument("--name", default=None, help="results go to bench/results/variance_<name>.*")
    ap.add_argument("--targets", type=Path, default=None,
                    help="only check the issue's targets on a results JSON; writes <its stem>_targets.txt")
    args = ap.parse_args(argv)
    if args.horizons is None:
        args.horizons = [256, 1024] if args.micro else [16, 64, 256, 1024, 4096]
    if args.quick:
        args.horizons, args.groups, args.drifts = [16, 64, 256], [4, 16], [0.05]
        args.tokens, args.min_batches = 2 ** 20, 32
        if args.micro:
            args.horizons, args.rollouts, args.micro_sizes = [256], [16], [1, 4]
    sizes = [*args.groups, *args.rollouts, *args.micro_sizes]
    if any(ROWS_PER_CALL % g for g in sizes):
        ap.error(f"group, rollout and micro-batch sizes must divide {ROWS_PER_CALL}, got {sizes}")
    unknown = [p for p in args.presets if p != "full" and p not in PRESETS]
    if unknown:
        ap.error(f"unknown presets {unknown}; valid: {', '.join(BENCH_PRESETS)}")
    if REFERENCE not in args.presets:
        args.presets.append(REFERENCE)
    if args.task and TOTAL_REFERENCE not in args.presets:
        args.presets.append(TOTAL_REFERENCE)
    if any(args.states) and not args.task:
        ap.error("--states moves the policy towards the regularized optimum of the task: it needs --task")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.targets is not None:
        report = targets_report(json.loads(args.targets.read_text())["rows"])
        command = " ".join(shlex.quote(a) for a in [".venvs/core/bin/python", "bench/variance.py", *sys.argv[1:]])
        out = args.targets.with_name(f"{args.targets.stem}_targets.txt")
        out.write_text(f"command: {command}\n{report}\n")
        print(report.split("\n")[0], f"({out})")
        return 0
    name = args.name or ("micro" if args.micro else "quick" if args.quick else "full")
    if args.micro:
        name = name if name.startswith("micro") else f"micro_{name}"
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with zeroed(args.zero):
        rows = run_micro(args) if args.micro else run_grid(args)
    seconds = time.perf_counter() - t0
    table = micro_table(rows) if args.micro else grid_table(rows, args.presets)
    command = " ".join(shlex.quote(a) for a in [".venvs/core/bin/python", "bench/variance.py", *sys.argv[1:]])
    settings = {k: v for k, v in vars(args).items() if k not in ("quick", "micro", "name")}
    settings["sources_sha256"] = core_fingerprint()
    header = (f"command: {command}\nsettings: {json.dumps(settings)}\nruntime: {seconds:.0f} s on 1 thread "
              f"({os.cpu_count()} CPU cores{'; ' + args.note if args.note else ''})\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"variance_{name}.txt").write_text(header + table + "\n")
    write_result(f"variance_{name}", {"settings": settings, "runtime_s": seconds, "rows": rows})
    if not args.micro:
        plot(rows, RESULTS / f"variance_{name}.png", args)
    print(header + (table if args.micro else grid_table(rows, args.presets, short=True)))
    print(f"full table: {RESULTS / f'variance_{name}.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
