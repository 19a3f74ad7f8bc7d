"""The full-vocabulary (Rao-Blackwellized) KL estimator, preset name `full`: exact per-position KL over the vocabulary.

Notation per sequence: KL_t = KL(pi(.|y_<t) || pi_ref(.|y_<t)) = sum_v pi(v) log(pi(v)/pi_ref(v)), exact at each
prefix; g_t = grad log pi(y_t|y_<t); rho_t = pi(y_t)/mu(y_t), w_{1:t} = prod_{s<=t} rho_s (1 on-policy, w_{1:0} = 1).

Gradient (per sequence; the loss averages over the B rows):

    grad KL_seq = E_mu[ sum_t w_{1:t-1} grad KL_t  +  sum_t g_t c_t ],   c_t = sum_{s>t} w_{1:s-1} KL_s  (+ reductions)

with grad KL_t pathwise through the policy's logits at t (prefix fixed) and c_t detached. Derivation:
KL_seq = sum_t E_pi[KL_t(y_<t)], and grad E_pi[f_theta(y_<t)] = E_pi[grad f + f sum_{u<t} g_u]; summing over t,
the score g_u collects every KL_s with s > u. Off-policy, a function of y_<s needs the weight w_{1:s-1}: KL_s already
averages y_s under pi, so one ratio fewer than the sampled-token form (E_mu[w_{1:s-1} f(y_<s)] = E_pi[f]); g_t KL_s
(t < s) is such a function, and grad KL_t is one of y_<t.

Reductions (reductions.py states them and why they keep the gradient exact): the score weight gets

    + a_b sum_{s>t} (w_{1:s} k1_s - w_{1:s-1} KL_s) + h_b sum_{s>t} w_{1:s} eta_s + w_{1:t} (lambda_b Pi_t - m_{b,t})

-- the resampling control variate (E_pi[k1_s | y_<s] = KL_s; near the regularized optimum it puts back the sampled
k1 whose noise the task reward cancels), the termination control variate and the baseline, with statistics from the
other rows of the batch or group (`full_statistics`), fitted to the trainer's task + KL gradient. Pinned by
tests/core/test_full_vocab.py::test_full_is_exact_over_every_batch (every ordered batch of G = 1, 2 sequences, on-
and off-policy, ragged lengths, with task advantages and end-of-sequence probabilities).

Value (for logging): sum_t w_{1:t-1} KL_t per sequence (= sum_t KL_t on-policy), unbiased for KL_seq.

Memory. `full_kl_surrogate` takes both models' logits [B, T, V]; `full_kl_surrogate_from_hidden` takes hidden states
and the output projections, so that neither model's [B, T, V] logits ever exist: both run over the real tokens in
chunks of `chunk_size`, compute the gradient with respect to their inputs in the forward pass (closed form:
d/dz [w KL(softmax z || q) + c log softmax(z)_y] = w p (log p - log q - KL) + c (e_y - p)), and keep only that
gradient (the size of the inputs) for the backward pass. Peak extra memory: O(chunk_size x V) in float32, plus a
float32 accumulator of the projection's gradient [V, H]. Arithmetic in float32 (float64 if an input is float64)
whatever the input dtype.

Passes. The score weights c depend on every row's KL, so without more information each chunk's logits are computed
twice (once for the KL terms, once for the gradient). A caller that already has the policy's log-probs of the sampled
tokens with their autograd graph (a trainer's task loss does) passes them as `logp`: the pathwise weights w_{1:t-1}
then follow from logp before the loop, the chunks are visited once for the KL terms and the pathwise gradient, and
the score part sum_t c_t g_t flows through logp (the gradient of sum_t c_t logp_t): the same gradient (pinned by
tests/core/test_full_vocab.py::test_one_pass_with_logp_equals_two_passes), half the logits computed. logp must match
log softmax(logits) at the sampled tokens (within LOGP_TOLERANCE: rounding of low-precision logits) or a ValueError
says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._validate import (check_batch, check_beta, check_discount, check_eos, check_group, check_statistics,
                        check_statistics_options, check_task, eos_rule)
from .estimators import as_float, capped, reverse_cumsum, working_dtype
from .options import KLOptions
from .presets import FULL
from .reductions import (EndOfSequence, KLStatistics, Returns, TaskAdvantages, batch_statistics, fade_baseline_,
                         others_sum_, past_kl, relative_returns, same_group, score_weight, termination_counts,
                         termination_increments)

#: default number of tokens per chunk (peak extra memory about 6 x chunk_size x V x 4 bytes); at V = 32000, 256 measured
#: 363 MB peak against 1024's 1346 MB, in 4.7 s against 4.2 s (bench/results/full_cost_cpu_kl_term*.json)
CHUNK_SIZE = 256
#: (absolute, relative) tolerance between a given logp and log softmax(logits) at the sampled tokens, to which
#: 2 eps max_v |z_v| is added per token (eps of the coarser of the logits' and logp's dtypes: the rounding of
#: low-precision logits, e.g. 0.23 for bf16 logits of size 30); a temperature applied to one and not the other
#: differs by a fraction of log p itself
LOGP_TOLERANCE = (0.01, 0.02)


def _shift_right(x: Tensor, fill: float) -> Tensor:
    """y_t = x_{t-1}, y_1 = fill, along the last dimension."""
    return torch.cat([torch.full_like(x[..., :1], fill), x[..., :-1]], -1)


def _next(x: Tensor) -> Tensor:
    """y_t = x_{t+1}, y_T = 0, along the last dimension."""
    return torch.cat([x[..., 1:], torch.zeros_like(x[..., :1])], -1)


def full_statistics(kl: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, *, old_logp: Tensor | None = None,
                    group: Tensor | None = None, task: TaskAdvantages | None = None,
                    eos: EndOfSequence | None = None, discount: float = 1.0) -> KLStatistics:
    """Leave-one-out statistics of `full` (`reductions.KLStatistics`) from a [B, T] batch: exact per-token KL_t (kl,
    detached), the sampled tokens' log-probs under both models (logp, ref_logp) and the behaviour policy's (old_logp,
    None = on-policy), fitted with the trainer's `task` advantages and the termination control variate from `eos`.

    For row b, from the other rows of b's group (reductions.batch_statistics): the other rows' return after t given
    they reached t, P_t = sum_{s>t} w_{t+1:s-1} KL_s, the resampling control variate D_t = sum_{s>t} (w_{t+1:s} k1_s -
    w_{t+1:s-1} KL_s) (cv_coef: its coefficient, fitted jointly; 0 on the KL term alone, where D only adds the
    sampling noise `full` removes) and the termination one (eos_coef = -rho kappa_b, kappa_b the mean exact KL per
    token). Compute it on the whole rollout batch and pass slices of it as `statistics=` to the loss on micro-batches.
    """
    check_discount(discount, FULL)
    finite = {}
    for value, check in ((task, check_task), (eos, check_eos)):
        if value is not None:
            finite.update(check(value, logp))
    m = check_batch(logp, ref_logp, mask, old_logp, also_finite={"kl": kl, **finite})
    check_group(group, logp)
    dtype = working_dtype(logp, ref_logp, old_logp, kl)
    mf = as_float(m, dtype)
    lp = torch.where(m, logp.detach().to(dtype), 0.0)
    k1 = lp - torch.where(m, ref_logp.detach().to(dtype), 0.0)
    log_rho = torch.zeros_like(lp) if old_logp is None else lp - torch.where(m, old_logp.detach().to(dtype), 0.0)
    task = None if task is None else TaskAdvantages(torch.where(m, (task.advantages if task.advantages.dim() == 2 else
                                                                    task.advantages[:, None]).detach().to(dtype), 0.0),
                                                    task.beta, task.normalized)
    counts = None if eos is None else termination_counts(eos, m, dtype, discount)
    eta = None if eos is None else termination_increments(eos, m, dtype, discount, counts)
    return _statistics(torch.where(m, kl.detach().to(dtype), 0.0), k1, lp, log_rho, mf, eta, task, group, discount,
                       counts)


def _statistics(kl: Tensor, k1: Tensor, logp: Tensor, log_rho: Tensor, mask: Tensor, eta: Tensor | None,
                task: TaskAdvantages | None, group: Tensor | None, discount: float = 1.0,
                counts: Tensor | None = None) -> KLStatistics:
    """`full_statistics` from validated, detached terms in the working dtype (zero at padding; counts: eta's nu)."""
    same = same_group(group)
    channels = [_next(kl), k1] + ([] if eta is None else [eta])
    ret = relative_returns(torch.stack(channels, 1), mask, log_rho, discount)
    future = ret[:, 0]  # sum_{s>t} w_{t+1:s-1} KL_s
    returns = Returns(ret=future, cv=torch.zeros_like(kl), past=past_kl(k1, mask),
                      eos=None if eta is None else ret[:, 2] - eta, resample=ret[:, 1] - k1 - future)
    x = others_sum_(torch.stack((kl, mask), 1).sum(-1), same)
    kappa = torch.where(x[:, 1] > 0, x[:, 0] / x[:, 1].clamp(min=1.0), 0.0)
    return batch_statistics(returns, torch.zeros_like(kappa), kappa, task, score_weight(logp, mask), mask, same,
                            counts=counts)


def full_coefficients(kl: Tensor, k1: Tensor, log_rho: Tensor, mask: Tensor, statistics: KLStatistics,
                      eta: Tensor | None = None, discount: float = 1.0) -> tuple[Tensor, Tensor]:
    """The detached weights of `full` on a [B, T] batch: (pathwise weight w_{1:t-1} on grad KL_t, score weight
    sum_{s>t} w_{1:s-1} KL_s + sum_{s>t} (a (w_{1:s} k1_s - w_{1:s-1} KL_s) + h w_{1:s} eta_s) + w_{1:t} u_t
    (lambda Pi_t - m_t) on g_t), both zero at padding (reductions.py: the control variates and the baseline; u_t =
    `fade_baseline_`, 1 on-policy).

    kl: exact per-token KL_t; k1: log pi/pi_ref at the sampled tokens; log_rho: log pi/mu there (zeros on-policy);
    mask: 0/1 in kl's dtype; eta: `reductions.termination_increments` or None; discount: gamma of the future terms
    (sum_{s>t} gamma^(s-t) ...; 1 = exact).
    """
    log_w = (log_rho * mask).cumsum(-1)
    running = torch.exp(capped(log_w))  # w_{1:t} at every position (a masked one carries the weight before it)
    w = running * mask
    future_kl = discount * reverse_cumsum(w * _next(kl * mask), discount)  # sum_{s>t} gamma^(s-t) w_{1:s-1} KL_s
    future_k1 = reverse_cumsum(w * k1, discount) - w * k1  # sum_{s>t} gamma^(s-t) w_{1:s} k1_s
    a = statistics.cv_coef[:, None]
    baseline = fade_baseline_(statistics.past_coef[:, None] * past_kl(k1, mask) - statistics.baseline, running)
    score = future_kl + a * (future_k1 - future_kl) + w * baseline
    if eta is not None:
        score = score + statistics.eos_coef[:, None] * (reverse_cumsum(w * eta, discount) - w * eta)
    return _path_weights(log_w, mask), score * mask


def _path_weights(log_w: Tensor, mask: Tensor) -> Tensor:
    """w_{1:t-1} = exp(sum_{s<t} log rho_s) at real tokens (1 on-policy), from log_w = cumsum of the masked log rho."""
    return torch.exp(capped(_shift_right(log_w, 0.0))) * mask


def _check_full_inputs(logits_shape: torch.Size, ref_shape: torch.Size, tokens: Tensor, mask: Tensor,
                       names: tuple[str, str]) -> None:
    """[B, T, *] inputs of both models, [B, T] integer tokens and a [B, T] mask."""
    if len(logits_shape) != 3:
        raise ValueError(f"{names[0]} must be 3-D [B, T, *], got shape {tuple(logits_shape)}")
    if tuple(ref_shape[:2]) != tuple(logits_shape[:2]) or len(ref_shape) != 3:
        raise ValueError(f"{names[1]} has shape {tuple(ref_shape)}, expected [B, T, *] with [B, T] = "
                         f"{tuple(logits_shape[:2])}")
    for name, t in (("tokens", tokens), ("mask", mask)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(logits_shape[:2]):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logits_shape[:2])} ([B, T])")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integer token ids, got {tokens.dtype}")
    if mask.is_complex() or (mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any())):
        raise ValueError("mask must contain only 0/1 (or bool) values")


def _chunk_terms(z: Tensor, z_ref: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of a chunk of logits [n, V]: (p [n, V], log p - log q - KL(p || q) [n, V], KL(p || q) [n],
    log p(y) [n]); log q(y) is log p(y) minus the y entry of log p - log q."""
    lp = torch.log_softmax(z, -1)
    diff = lp - torch.log_softmax(z_ref, -1)
    p = lp.exp()
    kl = (p * diff).sum(-1)
    return p, diff.sub_(kl[:, None]), kl, lp.gather(-1, y[:, None])[:, 0]


def _chunk_grad(p: Tensor, centred: Tensor, y: Tensor, path_w: Tensor, score_c: Tensor | None) -> Tensor:
    """d/dz [path_w KL(softmax z || softmax z_ref) + score_c log softmax(z)_y] per row, [n, V], from _chunk_terms'
    p and centred = log p - log q - KL (overwritten); score_c None: the pathwise part alone."""
    grad = centred.mul_(p).mul_(path_w[:, None])
    if score_c is not None:
        grad.sub_(p * score_c[:, None]).scatter_add_(-1, y[:, None], score_c[:, None])
    return grad


#: chunk logits provider: (flat real-token indices of a chunk) -> (policy logits [n, V], reference logits [n, V])
ChunkLogits = Callable[[Tensor], tuple[Tensor, Tensor]]


def _forward(logits_of: ChunkLogits, on_grad: Callable[[Tensor, Tensor], None], tokens: Tensor, mask: Tensor,
             logp: Tensor | None, options: KLOptions, chunk_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Returns ((1/B) sum_b sum_t w_{1:t-1} KL_t, the score weights c / B [B, T], detached) and hands on_grad(indices,
    grad) each chunk's gradient with respect to its logits: of (1/B) [sum w KL + sum c log pi(y)] in a second pass
    when logp is None; of (1/B) sum w KL in the one pass when logp (detached here) is given, the caller adding
    sum c log pi(y) through its own logp (module docstring, "Passes")."""
    batch, horizon = tokens.shape
    old_logp = options.old_logp
    m = mask if mask.dtype == torch.bool else mask != 0
    mf = as_float(m, dtype)
    flat = m.flatten().nonzero()[:, 0]
    y = tokens.flatten()[flat].long()
    kl_flat = torch.zeros(flat.numel(), dtype=dtype, device=tokens.device)
    lp_flat, lq_flat = torch.zeros_like(kl_flat), torch.zeros_like(kl_flat)

    def log_rho_of(lp: Tensor) -> Tensor:
        return torch.zeros_like(lp) if old_logp is None else (lp - torch.where(m, old_logp.to(dtype), 0.0)) * mf

    given = None if logp is None else torch.where(m, logp.to(dtype), 0.0)
    path_given = (None if given is None
                  else _path_weights(log_rho_of(given).cumsum(-1), mf).flatten()[flat] / max(batch, 1))
    scale_flat = torch.zeros_like(kl_flat)  # 2 eps max_v |z_v| per token (LOGP_TOLERANCE)
    for start in range(0, flat.numel(), chunk_size):  # pass 1: the per-token terms (one pass: and the gradient)
        part = slice(start, start + chunk_size)
        z, z_ref = logits_of(flat[part])
        if int(y[part].min()) < 0 or int(y[part].max()) >= z.shape[-1]:
            raise ValueError(f"tokens must be ids in [0, {z.shape[-1]}) at unmasked positions")
        p, centred, kl_flat[part], lp_flat[part] = _chunk_terms(z.to(dtype), z_ref.to(dtype), y[part])
        lq_flat[part] = lp_flat[part] - kl_flat[part] - centred.gather(-1, y[part, None])[:, 0]
        if path_given is not None:
            eps = max(torch.finfo(z.dtype).eps, torch.finfo(logp.dtype).eps)
            low, high = z.aminmax(dim=-1)
            scale_flat[part] = 2 * eps * torch.maximum(low.abs(), high.abs()).to(dtype)
            on_grad(flat[part], _chunk_grad(p, centred, y[part], path_given[part], None))

    def scatter(x: Tensor) -> Tensor:
        return torch.zeros(batch * horizon, dtype=dtype, device=tokens.device).index_copy_(0, flat, x).view(batch,
                                                                                                         horizon)
    flags = [~torch.isfinite(lp_flat).all(), ~torch.isfinite(lq_flat).all(), ~torch.isfinite(kl_flat).all()]
    if given is not None:
        atol, rtol = LOGP_TOLERANCE
        gap = (given.flatten()[flat] - lp_flat).abs()
        flags.append((gap > atol + rtol * lp_flat.abs() + scale_flat).any())
    bad = torch.stack(flags).tolist()
    for name, is_bad in zip(("logits", "ref_logits", "KL(pi || pi_ref)"), bad):
        if is_bad:
            raise ValueError(f"{name} has non-finite values (nan/inf) at unmasked positions")
    if given is not None and bad[3]:
        raise ValueError(f"logp does not match log softmax(logits) at the sampled tokens (largest difference "
                         f"{float(gap.max()):.3g} at real tokens; tolerance LOGP_TOLERANCE = {LOGP_TOLERANCE} plus "
                         "the logits' rounding): pass the same policy's log-probs of these tokens, with the same "
                         "temperature")
    logp_, ref_logp = scatter(lp_flat), scatter(lq_flat)
    statistics, task, eos = options.statistics, options.task, options.eos
    finite = {}
    for value, check in ((statistics, check_statistics), (task, check_task), (eos, check_eos)):
        if value is not None:
            finite.update(check(value, logp_))
    check_batch(logp_ if given is None else given, ref_logp, mask, old_logp, also_finite=finite,
                also_false=eos_rule(statistics, eos))
    check_group(options.group, logp_)
    kl = scatter(kl_flat)
    lp = logp_ if given is None else given
    log_rho, k1 = log_rho_of(lp), (lp - ref_logp) * mf
    if statistics is not None:  # padding of a given baseline / counts may hold anything, NaN too
        statistics = KLStatistics(*(x.detach().to(dtype) for x in (statistics.cv_coef, statistics.eos_coef,
                                                                   statistics.past_coef)),
                                  *(torch.where(m, x.detach().to(dtype), 0.0)
                                    for x in (statistics.baseline, statistics.eos_count)))
    counts = None
    if eos is not None:
        counts = (termination_counts(eos, m, dtype, options.discount) if statistics is None
                  else statistics.eos_count)
    eta = None if eos is None else termination_increments(eos, m, dtype, options.discount, counts)
    stats = statistics
    if stats is None:
        if task is not None:
            adv = task.advantages.detach().to(dtype)
            task = TaskAdvantages(torch.where(m, adv if adv.dim() == 2 else adv[:, None], 0.0), task.beta,
                                  task.normalized)
        stats = _statistics(kl, k1, lp, log_rho, mf, eta, task, options.group, options.discount, counts)
    path_w, score_c = full_coefficients(kl, k1, log_rho, mf, stats, eta, options.discount)
    if given is None:
        path_flat, score_flat = path_w.flatten()[flat] / max(batch, 1), score_c.flatten()[flat] / max(batch, 1)
        for start in range(0, flat.numel(), chunk_size):  # pass 2: the gradient with respect to each chunk's logits
            part = slice(start, start + chunk_size)
            z, z_ref = logits_of(flat[part])
            p, centred, _, _ = _chunk_terms(z.to(dtype), z_ref.to(dtype), y[part])
            on_grad(flat[part], _chunk_grad(p, centred, y[part], path_flat[part], score_flat[part]))
    return (path_w * kl).sum() / max(batch, 1), score_c / max(batch, 1)


class _FullFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, tokens, mask, logp, options, chunk_size):
        vocab = logits.shape[-1]
        flat_logits, flat_ref = logits.detach().reshape(-1, vocab), ref_logits.detach().reshape(-1, vocab)
        grad = torch.zeros_like(flat_logits) if logits.requires_grad else None

        def on_grad(index: Tensor, g: Tensor) -> None:
            if grad is not None:
                grad[index] = g.to(grad.dtype)

        value, score = _forward(lambda i: (flat_logits[i], flat_ref[i]), on_grad, tokens, mask, logp, options,
                                chunk_size, working_dtype(logits, ref_logits, options.old_logp, logp))
        ctx.save_for_backward(None if grad is None else grad.view_as(logits))
        ctx.mark_non_differentiable(score)
        return value, score

    @staticmethod
    def backward(ctx, grad_out, _grad_score):
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_out.to(grad.dtype)), *(None,) * 6


class _FullFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, tokens, mask, logp, options, chunk_size):
        h, w = hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach()
        h_ref, w_ref = ref_hidden.detach().reshape(-1, ref_hidden.shape[-1]), ref_weight.detach()
        grad_h = torch.zeros_like(h) if hidden.requires_grad else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if weight.requires_grad else None

        def on_grad(index: Tensor, g: Tensor) -> None:
            if grad_h is not None:
                grad_h[index] = (g.to(w.dtype) @ w).to(grad_h.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t().to(acc), h[index].to(acc))

        value, score = _forward(lambda i: (h[i] @ w.t(), h_ref[i] @ w_ref.t()), on_grad, tokens, mask, logp, options,
                                chunk_size, working_dtype(hidden, weight, ref_hidden, ref_weight, options.old_logp, logp))
        ctx.save_for_backward(None if grad_h is None else grad_h.view_as(hidden),
                              None if grad_w is None else grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(score)
        return value, score

    @staticmethod
    def backward(ctx, grad_out, _grad_score):
        grad_h, grad_w = ctx.saved_tensors
        return ((None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)),
                (None if grad_w is None else grad_w * grad_out.to(grad_w.dtype)), *(None,) * 7)


def _with_score_term(value: Tensor, score: Tensor, logp: Tensor | None, mask: Tensor) -> Tensor:
    """value, plus sum_t c_t logp_t / B with value 0 when the score part flows through the caller's logp (one pass)."""
    if logp is None:
        return value
    m = mask if mask.dtype == torch.bool else mask != 0
    term = (score * torch.where(m, logp.to(score.dtype), 0.0)).sum()
    return value + (term - term.detach())


def _check_options(beta: float | Tensor, chunk_size: int, options: KLOptions) -> None:
    """The public functions' common checks of their scalar arguments and options."""
    check_beta(beta)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check_statistics_options(options.statistics, options.group, options.task)
    check_discount(options.discount, FULL)


def _check_logps(old_logp: Tensor | None, logp: Tensor | None, tokens: Tensor) -> None:
    """old_logp and logp, when given, are floating-point [B, T] tensors like tokens (checked before any pass)."""
    for name, t in (("old_logp", old_logp), ("logp", logp)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor or None, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.shape != tokens.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(tokens.shape)} ([B, T])")


def full_kl_surrogate(
    logits: Tensor,
    ref_logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    *,
    beta: float | Tensor = 1.0,
    old_logp: Tensor | None = None,
    logp: Tensor | None = None,
    statistics: KLStatistics | None = None,
    group: Tensor | None = None,
    task: TaskAdvantages | None = None,
    eos: EndOfSequence | None = None,
    discount: float = 1.0,
    chunk_size: int = CHUNK_SIZE,
) -> Tensor:
    """Preset `full` from both models' logits at the completion positions: a 0-dim loss term to add to a minimized loss.

    logits [B, T, V] (policy, carrying the gradient; logits[b, t] predicts tokens[b, t]), ref_logits [B, T, V]
    (reference, detached), tokens [B, T] sampled ids, mask [B, T] (bool or 0/1; ragged lengths and holes allowed;
    padding may hold anything), old_logp [B, T] log mu(y_t) of the behaviour policy (None = on-policy).
    Gradient: beta * (1/B) sum_b [sum_t w_{1:t-1} grad KL_t + sum_t c_t g_t] with the reduced score weight c_t
    (module docstring), unbiased for beta * grad KL_seq on- and off-policy; value beta * (1/B) sum_b sum_t
    w_{1:t-1} KL_t. statistics: `full_statistics` of the whole rollout batch sliced to these rows; None = leave-one-out
    within this batch (within `group` when given), fitted with `task` (the trainer's advantages); eos: the
    end-of-sequence probabilities (termination control variate). logp [B, T]: the policy's log-probs of the sampled tokens with their
    autograd graph (e.g. the ones the task loss uses): one pass over the chunks instead of two, the score part of the
    gradient flowing through logp (module docstring, "Passes"). Pinned by tests/core/test_full_vocab.py.
    """
    options = KLOptions(old_logp=old_logp, statistics=statistics, group=group, task=task, eos=eos, discount=discount)
    _check_options(beta, chunk_size, options)
    for name, t in (("logits", logits), ("ref_logits", ref_logits)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
    _check_full_inputs(logits.shape, ref_logits.shape, tokens, mask, ("logits", "ref_logits"))
    _check_logps(old_logp, logp, tokens)
    if ref_logits.shape != logits.shape:
        raise ValueError(f"ref_logits has shape {tuple(ref_logits.shape)}, expected {tuple(logits.shape)}")
    value, score = _FullFromLogits.apply(logits, ref_logits, tokens, mask, None if logp is None else logp.detach(),
                                         options, chunk_size)
    return beta * _with_score_term(value, score, logp, mask)


def full_kl_surrogate_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    tokens: Tensor,
    mask: Tensor,
    *,
    beta: float | Tensor = 1.0,
    old_logp: Tensor | None = None,
    logp: Tensor | None = None,
    statistics: KLStatistics | None = None,
    group: Tensor | None = None,
    task: TaskAdvantages | None = None,
    eos: EndOfSequence | None = None,
    discount: float = 1.0,
    chunk_size: int = CHUNK_SIZE,
) -> Tensor:
    """`full_kl_surrogate` with logits = hidden @ weight.T (policy) and ref_hidden @ ref_weight.T (reference), computed
    chunk by chunk so that neither model's [B, T, V] logits exist; gradients flow to hidden and weight.

    hidden [B, T, H], weight [V, H] (the policy's output projection, no bias), ref_hidden [B, T, H'], ref_weight
    [V, H'] (detached). Same gradient, value, statistics, logp and checks as `full_kl_surrogate`; peak extra memory
    O(chunk_size x V) plus a float32 [V, H] gradient accumulator (tests/core/test_full_vocab.py::
    test_hidden_path_never_materializes_full_logits).
    """
    options = KLOptions(old_logp=old_logp, statistics=statistics, group=group, task=task, eos=eos, discount=discount)
    _check_options(beta, chunk_size, options)
    for name, t in (("hidden", hidden), ("weight", weight), ("ref_hidden", ref_hidden), ("ref_weight", ref_weight)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
    _check_full_inputs(hidden.shape, ref_hidden.shape, tokens, mask, ("hidden", "ref_hidden"))
    _check_logps(old_logp, logp, tokens)
    for name, w, h in (("weight", weight, hidden), ("ref_weight", ref_weight, ref_hidden)):
        if w.dim() != 2 or w.shape[1] != h.shape[-1]:
            raise ValueError(f"{name} must be [V, H] with H = {h.shape[-1]}, got {tuple(w.shape)}")
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"ref_weight has {ref_weight.shape[0]} rows (vocabulary), weight has {weight.shape[0]}")
    value, score = _FullFromHidden.apply(hidden, weight, ref_hidden, ref_weight, tokens, mask,
                                         None if logp is None else logp.detach(), options, chunk_size)
    return beta * _with_score_term(value, score, logp, mask)
