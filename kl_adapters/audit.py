"""Exact audit: enumerate every sequence of a tiny tabular autoregressive policy and compute gradients exactly.

Space: a vocabulary of V tokens whose last token is end-of-sequence (EOS), horizon T. A sequence stops at EOS or after
T tokens, so lengths are ragged (1..T). The policy has one free logit vector per non-terminal prefix ("node"), so
pi_theta(y_t | y_<t) = softmax(theta[node(y_<t)])[y_t]; all computation is float64.

Exact quantities (autograd through closed-form sums over all sequences / nodes):
    grad KL_seq                      grad_theta sum_y pi(y) log(pi(y)/pi_ref(y))
    partial_reverse(q)               sum_n q(n) grad KL(pi(.|n) || pi_ref(.|n)),  q(n) = prob. of reaching node n (detached)
    partial_forward(q)               sum_n q(n) grad KL(pi_ref(.|n) || pi(.|n))
    kl_seq_minus_partial_forward     grad KL_seq - partial_forward(pi)
For a preset, the per-sample gradient g(y) is the gradient of the public `kl_surrogate` on the single sequence y; its
exact expectation is sum_y q(y) g(y) with q = pi (on-policy) or q = mu (off-policy, old_logp = log mu), and its
variance is the trace of the covariance, sum_y q(y) |g(y)|^2 - |E g|^2.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .presets import PRESETS, SAMPLED_TOKEN_PRESETS, Preset, get_preset
from .reductions import EndOfSequence, TaskAdvantages
from .surrogate import kl_coefficients, kl_statistics, kl_surrogate

DTYPE = torch.float64


@dataclass(frozen=True)
class SequenceSpace:
    """All sequences of a tabular autoregressive policy, as [N, T] index tensors."""

    vocab: int
    horizon: int
    nodes: tuple[tuple[int, ...], ...]  # non-terminal prefixes, parents before children
    node_of_token: Tensor  # [N, T] node index of the prefix that emits token t (0 at padding)
    token: Tensor  # [N, T] emitted token (0 at padding)
    mask: Tensor  # [N, T] bool

    @property
    def eos(self) -> int:
        return self.vocab - 1

    @property
    def num_sequences(self) -> int:
        return self.token.shape[0]


def sequence_space(vocab: int, horizon: int) -> SequenceSpace:
    """Enumerate every sequence over `vocab` tokens (the last is EOS) of length <= `horizon`."""
    if vocab < 2 or horizon < 1:
        raise ValueError(f"need vocab >= 2 (one token is EOS) and horizon >= 1, got vocab={vocab}, horizon={horizon}")
    eos = vocab - 1
    nodes = [p for depth in range(horizon) for p in itertools.product(range(eos), repeat=depth)]
    index = {p: i for i, p in enumerate(nodes)}
    seqs = [p + (eos,) for p in nodes] + [p + (v,) for p in nodes if len(p) == horizon - 1 for v in range(eos)]
    node_of_token = torch.zeros(len(seqs), horizon, dtype=torch.long)
    token = torch.zeros(len(seqs), horizon, dtype=torch.long)
    mask = torch.zeros(len(seqs), horizon, dtype=torch.bool)
    for i, s in enumerate(seqs):
        for t, v in enumerate(s):
            node_of_token[i, t], token[i, t], mask[i, t] = index[s[:t]], v, True
    return SequenceSpace(vocab, horizon, tuple(nodes), node_of_token, token, mask)


def token_logps(space: SequenceSpace, logits: Tensor) -> Tensor:
    """[N, T] log pi(y_t | y_<t) for every enumerated sequence (0 at padding); differentiable in logits."""
    lp = torch.log_softmax(logits, -1)[space.node_of_token, space.token]
    return torch.where(space.mask, lp, torch.zeros((), dtype=lp.dtype))


def node_reach(space: SequenceSpace, logits: Tensor) -> Tensor:
    """[num_nodes] probability (detached) that a sequence sampled from softmax(logits) passes through each node."""
    logp = torch.log_softmax(logits.detach(), -1)
    reach = torch.zeros(len(space.nodes), dtype=logits.dtype)
    index = {p: i for i, p in enumerate(space.nodes)}
    for i, p in enumerate(space.nodes):
        reach[i] = 1.0 if not p else reach[index[p[:-1]]] * logp[index[p[:-1]], p[-1]].exp()
    return reach


def kl_seq(space: SequenceSpace, logits: Tensor, ref_logits: Tensor) -> Tensor:
    """KL(pi || pi_ref) over whole sequences, exactly."""
    lp = token_logps(space, logits).sum(-1)
    return (lp.exp() * (lp - token_logps(space, ref_logits).sum(-1))).sum()


def _grad(f: Tensor, logits: Tensor) -> Tensor:
    return torch.autograd.grad(f, logits)[0]


def _partial(space: SequenceSpace, logits: Tensor, ref_logits: Tensor, sampler: Tensor, forward: bool) -> Tensor:
    lp, lr = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    per_node = (lr.exp() * (lr - lp)).sum(-1) if forward else (lp.exp() * (lp - lr)).sum(-1)
    return _grad((node_reach(space, sampler) * per_node).sum(), logits)


def targets(space: SequenceSpace, logits: Tensor, ref_logits: Tensor, sampler: Tensor) -> dict[str, Tensor]:
    """Every exact target of presets.TARGET_NAMES, flattened, for prefixes drawn from softmax(sampler)."""
    theta = logits.detach().clone().requires_grad_(True)
    g_kl = _grad(kl_seq(space, theta, ref_logits), theta)
    fwd_on = _partial(space, theta, ref_logits, theta, forward=True)
    return {
        "kl_seq": g_kl.flatten(),
        "partial_reverse": _partial(space, theta, ref_logits, sampler, forward=False).flatten(),
        "partial_forward": _partial(space, theta, ref_logits, sampler, forward=True).flatten(),
        "zero": torch.zeros_like(g_kl).flatten(),
        "kl_seq_minus_partial_forward": (g_kl - fwd_on).flatten(),
    }


@dataclass(frozen=True)
class Moments:
    """Exact moments of a preset's one-sample gradient (and value) under the sampling distribution."""

    mean: Tensor  # E[g], flattened
    variance: float  # trace Cov[g]
    value_mean: float  # E[kl_surrogate value]


def preset_moments(
    space: SequenceSpace,
    logits: Tensor,
    ref_logits: Tensor,
    preset: str | Preset,
    *,
    behaviour_logits: Tensor | None = None,
    beta: float = 1.0,
    is_clip: float | None = None,
    discount: float = 1.0,
) -> Moments:
    """Exact E[g], tr Cov[g] and E[value] of `kl_surrogate` on one sampled sequence, sampling from pi or mu."""
    theta = logits.detach().clone().requires_grad_(True)
    lp = token_logps(space, theta)
    ref = token_logps(space, ref_logits).detach()
    old = None if behaviour_logits is None else token_logps(space, behaviour_logits).detach()
    q = (lp if old is None else old).detach().sum(-1).exp()
    grads, values = [], []
    for i in range(space.num_sequences):
        row = slice(i, i + 1)
        out = kl_surrogate(lp[row], ref[row], space.mask[row], preset=preset, beta=beta,
                           old_logp=None if old is None else old[row], is_clip=is_clip, discount=discount)
        grads.append(torch.autograd.grad(out, theta, retain_graph=True)[0].flatten())
        values.append(out.detach())
    g = torch.stack(grads)
    mean = (q[:, None] * g).sum(0)
    variance = float((q * g.square().sum(-1)).sum() - mean.square().sum())
    return Moments(mean=mean, variance=variance, value_mean=float((q * torch.stack(values)).sum()))


def batch_moments(
    space: SequenceSpace,
    logits: Tensor,
    ref_logits: Tensor,
    preset: str | Preset,
    group_size: int,
    *,
    behaviour_logits: Tensor | None = None,
    groups: tuple[int, ...] | None = None,
    precomputed: bool = False,
    rollout: bool = False,
    rewards: Tensor | None = None,
    normalized: bool = False,
    eos: bool = False,
    discount: float = 1.0,
    row_beta: bool = False,
    fit_task: bool = True,
    total: bool = False,
    chunk: int = 16384,
) -> tuple[Tensor, float]:
    """Exact E[g] and tr Cov[g] of the batch gradient g of `kl_surrogate` on G = group_size i.i.d. sequences.

    Enumerates every ordered batch (N^G of them), weighted by prod_j q(y_j) with q = pi, or mu (old_logp = log mu).
    g = (1/G) sum_j sum_t c_{j,t} grad log pi(y_{j,t}) with the preset's weights c on that batch (kl_coefficients;
    the gradient is exactly that sum, tests/core/test_properties.py) and the closed-form softmax score
    grad_theta log pi(y_t | node) = e_{node, y_t} - e_node (x) softmax(theta[node]), scattered into the node's logits.
    Batches are stacked into one [chunk * G, T] call with one group id per batch, so the leave-one-out statistics
    stay inside each batch; groups = a G-tuple of local ids splits each batch further (e.g. (0, 0, 1)), and
    precomputed=True passes kl_statistics of the same rows as statistics= (the rollout-time path); with rollout=True
    they are computed as an adapter does at rollout time, from the behaviour policy's log-probs and end-of-sequence
    probabilities (so the loss's termination counts are mu's, its p_t pi's).
    rewards [N] (one per sequence): the statistics are fitted with GRPO's task advantages of each batch, r minus the
    mean of its (local) group, divided by the group's standard deviation when normalized (TaskAdvantages, beta 0.5);
    eos: with the policy's end-of-sequence probabilities (EndOfSequence, the termination control variate); row_beta:
    the task's beta per row from the other rows' lengths (a trainer whose normaliser counts tokens). Either way the
    mean must stay the KL gradient's: only the statistics change. fit_task=False: the statistics are fitted without
    the task (the KL term alone, as before issue 20). total=True (with rewards): g is the trainer's task + KL
    gradient instead, weight c_t - rho_t A / beta per token (A the advantages, rho_t = pi/mu the token-level ratio whose
    gradient PPO's task loss takes, 1 on-policy): its E[g] is grad KL_seq - grad E_pi[R] / beta for every preset
    (the GRPO advantage's group mean adds (G-1)/G: its mean is that of R - mean_others R).
    """
    spec = get_preset(preset)
    if total and rewards is None:
        raise ValueError("batch_moments(total=True) needs rewards: the task + KL gradient has a task term")
    n = space.num_sequences
    lp = token_logps(space, logits).detach()
    ref = token_logps(space, ref_logits).detach()
    old = None if behaviour_logits is None else token_logps(space, behaviour_logits).detach()
    q = (lp if old is None else old).sum(-1).exp()
    vocab, num_params = space.vocab, len(space.nodes) * space.vocab
    score = torch.eye(vocab, dtype=DTYPE)[space.token] - torch.softmax(logits.detach(), -1)[space.node_of_token]
    param = space.node_of_token[..., None] * vocab + torch.arange(vocab)  # [N, T, V] flat index of each score entry
    local = torch.tensor(groups if groups is not None else (0,) * group_size)
    if local.shape != (group_size,) or int(local.min()) < 0:
        raise ValueError(f"groups must give one local id >= 0 per sequence of the batch, got {groups} for G={group_size}")
    mean = torch.zeros(num_params, dtype=DTYPE)
    second = torch.zeros((), dtype=DTYPE)
    digits = n ** torch.arange(group_size - 1, -1, -1)
    for start in range(0, n ** group_size, chunk):
        batch_ids = torch.arange(start, min(start + chunk, n ** group_size))
        seq = (batch_ids[:, None] // digits) % n  # [C, G] sequence index of each row of each batch
        rows = seq.flatten()
        group = (batch_ids[:, None] * (int(local.max()) + 1) + local).flatten()
        old_rows = None if old is None else old[rows]
        stats = {}
        extra = (task_and_eos(space, logits, rows, group, rewards, normalized, eos, row_beta)
                 if spec.uses_batch_statistics or total else {})
        task = extra.get("task") if fit_task else extra.pop("task", None)
        if spec.uses_batch_statistics and not precomputed:
            stats = {"group": group, **extra}
        elif spec.uses_batch_statistics:
            source = {"logp": lp[rows], "old_logp": old_rows, **extra}
            if rollout and old is not None:
                source = {**source, "logp": old_rows, "old_logp": None}
                if eos:
                    source["eos"] = task_and_eos(space, behaviour_logits, rows, group, None, False, True)["eos"]
            stats = {"statistics": kl_statistics(ref_logp=ref[rows], mask=space.mask[rows], group=group, preset=spec,
                                                 discount=discount, **source), "eos": extra.get("eos")}
        c = kl_coefficients(lp[rows], ref[rows], space.mask[rows], preset=spec, old_logp=old_rows, discount=discount,
                            **stats)
        if total:
            ratio = 1.0 if old is None else (lp[rows] - old_rows).exp()
            c = c - ratio * (task.advantages / task.beta)[:, None] * space.mask[rows]
        values = c[..., None] * score[rows] / group_size  # [C * G, T, V]; c = 0 at padding
        batch_of_row = torch.arange(len(batch_ids)).repeat_interleave(group_size)
        g = torch.zeros(len(batch_ids) * num_params, dtype=DTYPE)
        g.index_add_(0, (batch_of_row[:, None, None] * num_params + param[rows]).flatten(), values.flatten())
        g = g.view(len(batch_ids), num_params)
        weight = q[seq].prod(-1)
        mean += weight @ g
        second += weight @ g.square().sum(-1)
    return mean, float(second - mean.square().sum())


def task_and_eos(space: SequenceSpace, logits: Tensor, rows: Tensor, group: Tensor, rewards: Tensor | None,
                  normalized: bool, eos: bool, row_beta: bool = False) -> dict:
    """`task` / `eos` arguments for the rows of a stack of batches (batch_moments, tests/core/test_full_vocab.py):
    GRPO advantages of `rewards` per group id (None: no task), the policy's end-of-sequence probabilities."""
    extra = {}
    if rewards is not None:
        r = rewards[rows].to(DTYPE)
        same = torch.unique(group, return_inverse=True)[1]
        size = torch.zeros(int(same.max()) + 1, dtype=DTYPE).index_add_(0, same, torch.ones_like(r))
        mean = torch.zeros_like(size).index_add_(0, same, r) / size
        adv = r - mean[same]
        if normalized:
            var = torch.zeros_like(size).index_add_(0, same, adv.square()) / (size - 1).clamp(min=1)
            adv = adv / (var.sqrt()[same] + 1e-4)
        beta = 0.5
        if row_beta:  # 0.1 x (1 + the mean length of the other rows of the group): a function of the others only
            length = space.mask[rows].sum(-1).to(DTYPE)
            others = (torch.zeros_like(size).index_add_(0, same, length)[same] - length) / (size[same] - 1).clamp(min=1)
            beta = 0.1 * (1 + others)
        extra["task"] = TaskAdvantages(adv, beta, normalized)
    if eos:
        prob = torch.softmax(logits.detach(), -1)[space.node_of_token[rows], space.eos] * space.mask[rows]
        extra["eos"] = EndOfSequence(prob, (space.token[rows] == space.eos) & space.mask[rows])
    return extra


@dataclass(frozen=True)
class Policies:
    """A random tabular policy pi, reference pi_ref and behaviour policy mu on one sequence space."""

    space: SequenceSpace
    logits: Tensor
    ref_logits: Tensor
    behaviour_logits: Tensor


def random_policies(vocab: int, horizon: int, seed: int, *, drift: float = 1.0, off_policy: float = 0.5) -> Policies:
    """pi_ref logits ~ N(0,1); pi = pi_ref + N(0, drift^2); mu = pi + N(0, off_policy^2) (all per logit)."""
    space = sequence_space(vocab, horizon)
    gen = torch.Generator().manual_seed(seed)
    shape = (len(space.nodes), vocab)
    ref = torch.randn(shape, generator=gen, dtype=DTYPE)
    pi = ref + drift * torch.randn(shape, generator=gen, dtype=DTYPE)
    mu = pi + off_policy * torch.randn(shape, generator=gen, dtype=DTYPE)
    return Policies(space, pi, ref, mu)


def relative_error(estimate: Tensor, target: Tensor) -> float:
    """|estimate - target| / |target| (absolute error when the target is zero)."""
    norm = float(target.norm())
    return float((estimate - target).norm()) / (norm if norm > 0 else 1.0)


def cosine(a: Tensor, b: Tensor) -> float:
    """cos(a, b); nan when a is numerically zero relative to b (e.g. k1-loss, whose expectation is 0)."""
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 1e-9 * nb and nb > 0 else float("nan")


@dataclass(frozen=True)
class AuditRow:
    """One preset under one sampling regime, measured against grad KL_seq and against its documented target."""

    preset: str
    regime: str  # "on-policy" | "off-policy"
    is_clip: float | None
    relative_bias: float  # |E g - grad KL_seq| / |grad KL_seq|
    cosine: float  # cos(E g, grad KL_seq)
    variance: float  # tr Cov[g]
    target: str | None  # documented exact expectation
    target_error: float | None  # |E g - target| / |target|
    value_bias: float  # |E[value] - KL_seq| / KL_seq
    #: presets with batch statistics only: G -> G * tr Cov of the batch gradient over every batch of G sequences
    batch_variance: dict[int, float] | None = None
    #: G -> |E g - grad KL_seq| / |grad KL_seq| over every batch of G sequences
    batch_bias: dict[int, float] | None = None
    #: gamma of the future-KL return (< 1: the bias-variance dial, whose bias this row measures)
    discount: float = 1.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def audit(
    vocab: int = 4,
    horizon: int = 4,
    seed: int = 0,
    *,
    presets: tuple[str, ...] | None = None,
    drift: float = 1.0,
    off_policy: float = 0.5,
    is_clip: float | None = 2.0,
    batch_sizes: tuple[int, ...] = (),
    discount: float | None = None,
) -> list[AuditRow]:
    """Audit every preset on- and off-policy on one random tabular problem (beta = 1).

    Adds one row for "sequence" with its importance weights capped at `is_clip` (off-policy) to measure that option's
    bias; pass is_clip=None to skip it; likewise rows for "sequence" with its future-KL return discounted by
    `discount` (< 1, the bias-variance dial), on- and off-policy. A preset with batch statistics is a batch estimator (its one-sample row is its
    single-sample form): for each G in batch_sizes its bias and G * tr Cov over every ordered batch of G sequences
    (`batch_moments`) go in batch_bias / batch_variance (for an i.i.d. preset G * tr Cov = var at every G).
    """
    pol = random_policies(vocab, horizon, seed, drift=drift, off_policy=off_policy)
    kl = float(kl_seq(pol.space, pol.logits, pol.ref_logits))
    runs = [(name, regime, None, 1.0) for name in (presets or tuple(SAMPLED_TOKEN_PRESETS))
            for regime in ("on-policy", "off-policy")]
    if is_clip is not None:
        runs.append(("sequence", "off-policy", is_clip, 1.0))
    if discount is not None:
        runs += [("sequence", regime, None, discount) for regime in ("on-policy", "off-policy")]
    rows, cache = [], {}
    for name, regime, clip, gamma in runs:
        spec = get_preset(name)
        sampler = pol.logits if regime == "on-policy" else pol.behaviour_logits
        if regime not in cache:
            cache[regime] = targets(pol.space, pol.logits, pol.ref_logits, sampler)
        tg = cache[regime]
        mom = preset_moments(pol.space, pol.logits, pol.ref_logits, spec, is_clip=clip, discount=gamma,
                             behaviour_logits=None if regime == "on-policy" else pol.behaviour_logits)
        target = spec.target_on_policy if regime == "on-policy" else spec.target_off_policy
        if clip is not None or gamma < 1.0:
            target = None  # a capped / discounted estimator has no exact target: its row measures the bias
        rows.append(AuditRow(
            preset=name, regime=regime, is_clip=clip,
            relative_bias=relative_error(mom.mean, tg["kl_seq"]), cosine=cosine(mom.mean, tg["kl_seq"]),
            variance=mom.variance, target=target,
            target_error=None if target is None else relative_error(mom.mean, tg[target]),
            value_bias=abs(mom.value_mean - kl) / kl,
            **_batch_columns(pol, spec, regime, tg["kl_seq"], batch_sizes if clip is None else (), gamma),
            discount=gamma,
        ))
    return rows


def _batch_columns(pol: Policies, spec: Preset, regime: str, exact: Tensor, sizes: tuple[int, ...],
                   discount: float = 1.0) -> dict:
    if not (spec.uses_batch_statistics and sizes):
        return {}
    behaviour = None if regime == "on-policy" else pol.behaviour_logits
    moments = {g: batch_moments(pol.space, pol.logits, pol.ref_logits, spec, g, behaviour_logits=behaviour,
                                discount=discount) for g in sizes}
    return {"batch_variance": {g: g * var for g, (_, var) in moments.items()},
            "batch_bias": {g: relative_error(mean, exact) for g, (mean, _) in moments.items()}}


#: the trainer's gradient under `task_audit`: (label, preset, statistics fitted with the task)
TASK_CONFIGS = (("sequence-plain", "sequence-plain", False), ("sequence, KL-only fit", "sequence", False),
                ("sequence", "sequence", True))


@dataclass(frozen=True)
class TaskRow:
    """The trainer's task + KL gradient of one configuration under one regime, exact over every ordered batch of G."""

    config: str  # a TASK_CONFIGS label
    regime: str
    variance: dict[int, float]  # G -> G x tr Cov of the batch's task + KL gradient
    bias: dict[int, float]  # G -> |E g - E g(sequence-plain)| / |E g(sequence-plain)|

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def task_audit(vocab: int = 4, horizon: int = 4, seed: int = 0, *, drift: float = 1.0, off_policy: float = 0.5,
               batch_sizes: tuple[int, ...] = (2, 3), scale: float = 1.0) -> list[TaskRow]:
    """The gradient a GRPO trainer takes, task + KL, per TASK_CONFIGS (`batch_moments(total=True)`): reward R(y) =
    scale x u(y), u ~ U(0, 1) per sequence (seeded by `seed`), GRPO advantages R - the batch mean, task beta 0.5,
    the termination control variate on. Every configuration has the same expected gradient (bias ~ 1e-15 against
    sequence-plain's, tests/core/test_cli.py); the variance says whether fitting the statistics to the KL term alone
    (before issue 20) or to the task + KL weight the trainer applies lowers the noise of what is trained."""
    pol = random_policies(vocab, horizon, seed, drift=drift, off_policy=off_policy)
    rewards = scale * torch.rand(pol.space.num_sequences, generator=torch.Generator().manual_seed(seed),
                                 dtype=DTYPE)
    rows = []
    for regime in ("on-policy", "off-policy"):
        behaviour = None if regime == "on-policy" else pol.behaviour_logits
        moments = {label: {g: batch_moments(pol.space, pol.logits, pol.ref_logits, preset, g,
                                            behaviour_logits=behaviour, rewards=rewards, eos=True, fit_task=fit,
                                            total=True) for g in batch_sizes}
                   for label, preset, fit in TASK_CONFIGS}
        plain = moments[TASK_CONFIGS[0][0]]
        rows += [TaskRow(label, regime, {g: g * var for g, (_, var) in by_g.items()},
                         {g: relative_error(mean, plain[g][0]) for g, (mean, _) in by_g.items()})
                 for label, by_g in moments.items()]
    return rows


def format_task_table(rows: list[TaskRow]) -> str:
    """Third table: task + KL variance per configuration and G, and its ratio to sequence-plain's."""
    sizes = sorted(rows[0].variance)
    plain = {(r.regime, g): r.variance[g] for r in rows if r.config == TASK_CONFIGS[0][0] for g in sizes}
    head = "".join(f"{f'var@{g}':>9}" for g in sizes) + "".join(f"{f'bias@{g}':>9}" for g in sizes)
    lines = ["", "the trainer's gradient, task + KL (GRPO advantages of a random reward per sequence, task beta 0.5, "
             "termination control variate on), exact over every ordered batch of G: var@G = G x trace Cov; bias@G "
             "against sequence-plain's mean; ratio = var@G / sequence-plain's",
             f"{'configuration':<24}{'regime':>11} | {head} | ratio to sequence-plain at G = "
             f"{', '.join(map(str, sizes))}"]
    for r in rows:
        var = "".join(f"{r.variance[g]:>9.3g}" for g in sizes)
        bias = "".join(f"{r.bias[g]:>9.1e}" for g in sizes)
        ratio = ", ".join(f"{r.variance[g] / plain[(r.regime, g)]:.3f}" for g in sizes)
        lines.append(f"{r.config:<24}{r.regime:>11} | {var}{bias} | {ratio}")
    return "\n".join(lines)


def format_table(rows: list[AuditRow], *, vocab: int, horizon: int, seed: int) -> str:
    """Plain-text table: one line per preset, on-policy and off-policy side by side."""
    by = {}
    for r in rows:
        label = (f"{r.preset} (is_clip={r.is_clip:g})" if r.is_clip is not None
                 else f"{r.preset} (discount={r.discount:g})" if r.discount < 1.0 else r.preset)
        by.setdefault(label, {})[r.regime] = r
    space = sequence_space(vocab, horizon)
    head = (f"exact audit: V={vocab} (incl. EOS), T={horizon}, seed={seed}, {space.num_sequences} sequences, "
            f"{len(space.nodes) * vocab} parameters, beta=1\n"
            "bias = |E[grad] - grad KL_seq| / |grad KL_seq|; var = trace of the one-sample gradient covariance; "
            "target err = |E[grad] - documented target| / |target|\n")
    cols = f"{'preset':<24}{'unbiased':>10} | {'on: bias':>9}{'cos':>8}{'var':>9}{'target err':>11} | " \
           f"{'off: bias':>9}{'cos':>8}{'var':>9}{'target err':>11}"
    lines = [head, cols, "-" * len(cols)]

    def cells(r: AuditRow | None) -> str:
        if r is None:
            return f"{'':>9}{'':>8}{'':>9}{'':>11}"
        te = "-" if r.target_error is None else f"{r.target_error:.1e}"
        cos = "-" if math.isnan(r.cosine) else f"{r.cosine:.3f}"
        return f"{r.relative_bias:>9.3g}{cos:>8}{r.variance:>9.3g}{te:>11}"

    for label, regimes in by.items():
        spec = PRESETS[label.split(" ")[0]]
        flag = ("on" if spec.unbiased_on_policy else "-") + "/" + ("off" if spec.unbiased_off_policy else "-")
        if " " in label:
            flag = "biased"
        lines.append(f"{label:<24}{flag:>10} | {cells(regimes.get('on-policy'))} | {cells(regimes.get('off-policy'))}")
    return "\n".join(lines + _batch_table(rows))


def _batch_table(rows: list[AuditRow]) -> list[str]:
    """Second table: the batch estimators at each batch size G, beside the i.i.d. presets' var (same at every G)."""
    batch = [r for r in rows if r.batch_variance]
    if not batch:
        return []
    sizes = sorted(batch[0].batch_variance)
    token = {r.regime: r.variance for r in rows if r.preset == "token" and r.is_clip is None}
    head = "".join(f"{f'var@{g}':>9}" for g in sizes) + "".join(f"{f'bias@{g}':>9}" for g in sizes)
    lines = ["", "batch estimators (statistics leave-one-out over the batch's other sequences), exact over every ordered "
             "batch of G sequences: var@G = G x trace Cov of the batch gradient (an i.i.d. preset's var at every G), "
             "bias@G as above; ratio = var@G / var(token)",
             f"{'preset':<24}{'regime':>11} | {head} | ratio to token at G = {', '.join(map(str, sizes))}"]
    for r in batch:
        var = "".join(f"{r.batch_variance[g]:>9.3g}" for g in sizes)
        bias = "".join(f"{r.batch_bias[g]:>9.1e}" for g in sizes)
        ratio = ", ".join(f"{r.batch_variance[g] / token[r.regime]:.2f}" for g in sizes) if r.regime in token else "-"
        lines.append(f"{r.preset:<24}{r.regime:>11} | {var}{bias} | {ratio}")
    for r in rows:
        if r.preset in ("sequence-plain", "reward-plain", "token") and r.is_clip is None:
            lines.append(f"{r.preset:<24}{r.regime:>11} | {f'{r.variance:.3g} at every G':<{9 * len(sizes)}}"
                         f"{'':>{9 * len(sizes)}} | {r.variance / token[r.regime]:.2f}" if r.regime in token else "")
    return lines

