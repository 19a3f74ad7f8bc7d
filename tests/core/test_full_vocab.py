"""The full-vocabulary estimator (`full`, kl_adapters/full_vocab.py): exact, chunked, bf16-safe, memory-bounded.

Identity pinned by enumeration (module docstring of full_vocab.py):
    grad KL_seq = E_mu[ sum_t w_{1:t-1} grad KL_t + sum_t g_t c_t ],  c_t = sum_{s>t} w_{1:s-1} KL_s + reductions
for every ordered batch of G = 1, 2, 3 sequences of a tabular policy (ragged lengths), on- and off-policy, with the
statistics leave-one-out over the batch's other rows (fitted with GRPO task advantages and end-of-sequence
probabilities, or without), computed by the loss or precomputed (rollout-time path).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kl_adapters.audit import kl_seq, random_policies, relative_error, targets, task_and_eos, token_logps
from kl_adapters.full_vocab import full_kl_surrogate, full_kl_surrogate_from_hidden, full_statistics

#: (vocab incl. EOS, horizon, seed, drift, behaviour's gap per logit); the last with prefix weights outside e^(+-4)
#: (the off-policy baseline fade below 1)
PROBLEMS = [(3, 3, 0, 1.0, 0.6), (3, 3, 1, 0.2, 0.6), (4, 2, 2, 0.6, 0.6), (3, 3, 3, 0.6, 2.0)]


@pytest.fixture(scope="module", params=PROBLEMS, ids=lambda p: f"V{p[0]}T{p[1]}s{p[2]}d{p[3]}o{p[4]}")
def problem(request):
    vocab, horizon, seed, drift, off_policy = request.param
    return random_policies(vocab, horizon, seed, drift=drift, off_policy=off_policy)


def _expected_gradient(pol, size, regime, precomputed=False, with_logp=False, task=False, discount=1.0):
    """Exact E[grad] over every ordered batch of `size` sequences sampled from pi (or mu), in one call: the batches are
    stacked with one group id each (leave-one-out stays inside a batch) and each batch reads its own copy of the
    tabular logits, so one backward pass returns every batch's gradient. with_logp: the one-pass form, the score part
    through the sampled tokens' log-probs; task: statistics fitted to GRPO advantages of a random reward, with the
    termination control variate."""
    sp = pol.space
    batches = torch.cartesian_prod(*[torch.arange(sp.num_sequences)] * size).view(-1, size)
    rows, group = batches.flatten(), torch.arange(len(batches)).repeat_interleave(size)
    theta = pol.logits.expand(len(batches), *pol.logits.shape).clone().requires_grad_(True)
    logits = theta[group[:, None], sp.node_of_token[rows]]
    ref = pol.ref_logits[sp.node_of_token[rows]]
    mask = sp.mask[rows]
    old = token_logps(sp, pol.behaviour_logits)[rows] if regime == "off-policy" else None
    rewards = torch.rand(sp.num_sequences, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    extra = task_and_eos(sp, pol.logits, rows, group, rewards if task else None, task == "normalized", bool(task))
    stats = {"group": group, **extra}
    if precomputed:
        lp, lq = torch.log_softmax(logits.detach(), -1), torch.log_softmax(ref, -1)
        kl = (lp.exp() * (lp - lq)).sum(-1) * mask
        tok = token_logps(sp, pol.logits)[rows], token_logps(sp, pol.ref_logits)[rows]
        stats = {"statistics": full_statistics(kl, *tok, mask, old_logp=old, group=group, discount=discount, **extra),
                 "eos": extra.get("eos")}
    if with_logp:
        stats["logp"] = torch.log_softmax(logits, -1).gather(-1, sp.token[rows].clamp(min=0)[..., None])[..., 0]
    loss = full_kl_surrogate(logits, ref, sp.token[rows], mask, old_logp=old, discount=discount, **stats) * len(batches)
    q = token_logps(sp, pol.logits if regime == "on-policy" else pol.behaviour_logits).sum(-1).exp()
    return torch.einsum("k,kij->ij", q[batches].prod(-1), torch.autograd.grad(loss, theta)[0]).flatten()


@pytest.mark.parametrize("regime", ["on-policy", "off-policy"])
@pytest.mark.parametrize(("size", "precomputed", "with_logp", "task"),
                         [(1, False, False, False), (2, False, False, False), (2, True, False, False),
                          (1, False, True, False), (2, True, True, False), (3, False, False, "advantages"),
                          (3, True, True, "normalized"), (2, False, True, "advantages")])
def test_full_is_exact_over_every_batch(problem, regime, size, precomputed, with_logp, task):
    """E[(1/G) sum_b g_b] = grad KL_seq exactly, statistics leave-one-out within each batch (or precomputed, fitted
    with GRPO advantages, shift-only or normalized, and end-of-sequence probabilities), in two passes or in one with
    the sampled tokens' log-probs given."""
    sampler = problem.logits if regime == "on-policy" else problem.behaviour_logits
    target = targets(problem.space, problem.logits, problem.ref_logits, sampler)["kl_seq"]
    assert relative_error(_expected_gradient(problem, size, regime, precomputed, with_logp, task), target) < 1e-10


@pytest.mark.parametrize("regime", ["on-policy", "off-policy"])
@pytest.mark.parametrize("precomputed", [False, True])
def test_reductions_stay_exact_relative_to_the_discounted_form(problem, regime, precomputed):
    """With the bias-variance dial (discount 0.7): the reduced batch estimator (G = 3, fitted with a task and eos) has
    the expectation of the unreduced one (G = 1), which differs from grad KL_seq."""
    reduced = _expected_gradient(problem, 3, regime, precomputed, task="advantages", discount=0.7)
    alone = _expected_gradient(problem, 1, regime, discount=0.7)
    assert relative_error(reduced, alone) < 1e-10
    sampler = problem.logits if regime == "on-policy" else problem.behaviour_logits
    assert relative_error(alone, targets(problem.space, problem.logits, problem.ref_logits, sampler)["kl_seq"]) > 1e-4


@pytest.mark.parametrize("regime", ["on-policy", "off-policy"])
def test_value_is_unbiased_for_sequence_kl(problem, regime):
    """E_mu[sum_t w_{1:t-1} KL_t] = KL_seq (one sequence at a time)."""
    sp = problem.space
    old = token_logps(sp, problem.behaviour_logits) if regime == "off-policy" else None
    q = token_logps(sp, problem.logits if old is None else problem.behaviour_logits).sum(-1).exp()
    values = torch.stack([full_kl_surrogate(problem.logits[sp.node_of_token[i:i + 1]],
                                            problem.ref_logits[sp.node_of_token[i:i + 1]], sp.token[i:i + 1],
                                            sp.mask[i:i + 1], old_logp=None if old is None else old[i:i + 1])
                          for i in range(sp.num_sequences)])
    assert float(q @ values) == pytest.approx(float(kl_seq(sp, problem.logits, problem.ref_logits)), rel=1e-10)


def _random_batch(batch=3, horizon=6, vocab=11, hidden=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, horizon, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype)
    h_ref = torch.randn(batch, horizon, hidden + 2, generator=gen, dtype=dtype)
    w_ref = torch.randn(vocab, hidden + 2, generator=gen, dtype=dtype)
    tokens = torch.randint(0, vocab, (batch, horizon), generator=gen)
    mask = torch.ones(batch, horizon, dtype=torch.bool)
    mask[0, 4:] = False
    mask[1, 2] = False  # a hole (e.g. a tool token)
    tokens[0, 5] = -100  # junk at padding is never read
    old = -torch.rand(batch, horizon, generator=gen, dtype=dtype) - 2.0
    return h, w, h_ref, w_ref, tokens, mask, old


def _grads(loss, *inputs):
    return [g.to(torch.float64) for g in torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("old", [False, True], ids=["on", "off"])
def test_chunked_hidden_path_equals_unchunked_logits_path(old):
    h, w, h_ref, w_ref, tokens, mask, old_logp = _random_batch()
    old_logp = old_logp if old else None
    logits = (h @ w.T).requires_grad_(True)
    ref = h_ref @ w_ref.T
    base = full_kl_surrogate(logits, ref, tokens, mask, old_logp=old_logp, chunk_size=10 ** 6, beta=0.3)
    (g_logits,) = _grads(base, logits)
    for chunk in (1, 4, 7):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = full_kl_surrogate_from_hidden(hh, ww, h_ref, w_ref, tokens, mask, old_logp=old_logp, chunk_size=chunk,
                                             beta=0.3)
        g_h, g_w = _grads(loss, hh, ww)
        assert float(loss.detach()) == pytest.approx(float(base.detach()), rel=1e-12)
        torch.testing.assert_close(g_h, g_logits @ w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g_w, g_logits.flatten(0, 1).T @ h.flatten(0, 1), rtol=1e-10, atol=1e-12)
        chunked = full_kl_surrogate(logits, ref, tokens, mask, old_logp=old_logp, chunk_size=chunk, beta=0.3)
        torch.testing.assert_close(_grads(chunked, logits)[0], g_logits, rtol=1e-12, atol=1e-14)


def _sampled_logp(h, w, tokens, mask):
    return torch.log_softmax(h @ w.T, -1).gather(-1, torch.where(mask, tokens, 0)[..., None])[..., 0]


@pytest.mark.parametrize("old", [False, True], ids=["on", "off"])
def test_one_pass_with_logp_equals_two_passes(old):
    """Given the sampled tokens' log-probs (with their graph), one pass over the chunks gives the two-pass gradient
    with respect to the hidden states and the projection (the score part flowing through logp), and the same value."""
    h, w, h_ref, w_ref, tokens, mask, old_logp = _random_batch()
    old_logp = old_logp if old else None
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    two = full_kl_surrogate_from_hidden(hh, ww, h_ref, w_ref, tokens, mask, old_logp=old_logp, beta=0.3)
    expected = _grads(two, hh, ww)
    for chunk in (1, 4, 7):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        one = full_kl_surrogate_from_hidden(hh, ww, h_ref, w_ref, tokens, mask, old_logp=old_logp, chunk_size=chunk,
                                            logp=_sampled_logp(hh, ww, tokens, mask), beta=0.3)
        assert float(one.detach()) == pytest.approx(float(two.detach()), rel=1e-12)
        for got, want in zip(_grads(one, hh, ww), expected):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    logits = (h @ w.T).requires_grad_(True)
    one = full_kl_surrogate(logits, h_ref @ w_ref.T, tokens, mask, old_logp=old_logp, beta=0.3,
                            logp=torch.log_softmax(logits, -1).gather(-1, torch.where(mask, tokens, 0)[..., None])[..., 0])
    torch.testing.assert_close(_grads(one, logits)[0] @ w, expected[0], rtol=1e-10, atol=1e-12)


def test_logp_of_another_policy_is_refused():
    """A logp that is not log softmax(logits) at the sampled tokens (here: a temperature applied to one only) is an
    error, not a silently wrong gradient; bf16 rounding of the logits is within LOGP_TOLERANCE."""
    h, w, h_ref, w_ref, tokens, mask, _ = _random_batch(dtype=torch.float32)
    with pytest.raises(ValueError, match="logp does not match log softmax"):
        full_kl_surrogate_from_hidden(h, w, h_ref, w_ref, tokens, mask, logp=_sampled_logp(h / 0.7, w, tokens, mask))
    rounded = _sampled_logp(h.bfloat16().float(), w.bfloat16().float(), tokens, mask).bfloat16()
    full_kl_surrogate_from_hidden(h, w, h_ref, w_ref, tokens, mask, logp=rounded)
    # bf16 hidden states and projection with large logits, sampled tokens the most likely ones (log p near 0, where
    # the relative tolerance gives nothing): a trainer's float32 log-probs of the same model are accepted beside the
    # function's rounded bf16 logits (the margin 2 eps max|z| covers the rounding of logits of any size)
    big, wb = (6 * h).bfloat16(), w.bfloat16()
    likely = (big.float() @ wb.float().T).argmax(-1)
    full_kl_surrogate_from_hidden(big, wb, h_ref.bfloat16(), w_ref.bfloat16(), likely, mask,
                                  logp=_sampled_logp(big.float(), wb.float(), likely, mask))
    with pytest.raises(ValueError, match=r"logp has shape \(3, 5\)"):
        full_kl_surrogate_from_hidden(h, w, h_ref, w_ref, tokens, mask, logp=rounded[:, :5])
    with pytest.raises(TypeError, match="logp must be a floating-point"):
        full_kl_surrogate_from_hidden(h, w, h_ref, w_ref, tokens, mask, logp=tokens)


def test_statistics_of_the_rollout_batch_sliced_into_micro_batches():
    """Micro-batches of 2 rows with the whole batch's statistics sum (weighted m/N) to the whole-batch gradient."""
    h, w, h_ref, w_ref, tokens, mask, _ = _random_batch(batch=4)
    logits = (h @ w.T).requires_grad_(True)
    ref = h_ref @ w_ref.T
    lp, lq = torch.log_softmax(logits.detach(), -1), torch.log_softmax(ref, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1) * mask
    at = tokens.clamp(min=0)[..., None]
    stats = full_statistics(kl, lp.gather(-1, at)[..., 0], lq.gather(-1, at)[..., 0], mask)
    whole = full_kl_surrogate(logits, ref, tokens, mask)
    parts = sum(full_kl_surrogate(logits[r], ref[r], tokens[r], mask[r], statistics=stats[r]) * 0.5
                for r in (slice(0, 2), slice(2, 4)))
    torch.testing.assert_close(_grads(parts, logits)[0], _grads(whole, logits)[0], rtol=1e-12, atol=1e-14)


def test_bf16_inputs_accumulate_in_float32():
    h, w, h_ref, w_ref, tokens, mask, old = _random_batch(batch=2, horizon=32, vocab=64, hidden=8)
    exact = [x.to(torch.bfloat16).to(torch.float64) for x in (h, w, h_ref, w_ref)]
    logits = (exact[0] @ exact[1].T).requires_grad_(True)
    base = full_kl_surrogate(logits, exact[2] @ exact[3].T, tokens, mask, old_logp=old)
    low = (exact[0] @ exact[1].T).to(torch.bfloat16).requires_grad_(True)
    loss = full_kl_surrogate(low, (exact[2] @ exact[3].T).to(torch.bfloat16), tokens, mask,
                             old_logp=old.to(torch.bfloat16))
    assert loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(float(base.detach()), rel=2e-2)
    g_low, g = _grads(loss, low)[0], _grads(base, logits)[0]
    assert relative_error(g_low, g) < 3e-2
    hb, wb = exact[0].to(torch.bfloat16).requires_grad_(True), exact[1].to(torch.bfloat16).requires_grad_(True)
    loss_h = full_kl_surrogate_from_hidden(hb, wb, exact[2].to(torch.bfloat16), exact[3].to(torch.bfloat16), tokens,
                                           mask, old_logp=old.to(torch.bfloat16), chunk_size=16)
    g_h = _grads(loss_h, hb)[0]
    assert float(loss_h.detach()) == pytest.approx(float(base.detach()), rel=3e-2)
    assert relative_error(g_h, g @ exact[1]) < 5e-2


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_hidden_path_never_materializes_full_logits():
    """Forward and backward from hidden states: no tensor reaches [B, T, V]; the largest is O(chunk x V) or [V, H]."""
    batch, horizon, vocab, hidden, chunk = 4, 64, 512, 16, 32
    h, w, h_ref, w_ref, tokens, mask, old = _random_batch(batch, horizon, vocab, hidden, dtype=torch.float32)
    h.requires_grad_(True)
    w.requires_grad_(True)
    for logp in (None, _sampled_logp(h.detach(), w.detach(), tokens, mask).requires_grad_(True)):
        with _LargestTensor() as probe:
            loss = full_kl_surrogate_from_hidden(h, w, h_ref, w_ref, tokens, mask, old_logp=old, chunk_size=chunk,
                                                 logp=logp)
            loss.backward()
        assert probe.largest <= chunk * vocab <= batch * horizon * vocab // 8


def _bad(**change):
    h, w, h_ref, w_ref, tokens, mask, old = _random_batch()
    args = dict(logits=(h @ w.T).requires_grad_(True), ref_logits=h_ref @ w_ref.T, tokens=tokens, mask=mask)
    args.update(change)
    return args


@pytest.mark.parametrize(("change", "error", "match"), [
    (dict(logits=torch.zeros(3, 6)), ValueError, "logits must be 3-D"),
    (dict(ref_logits=torch.zeros(3, 6, 12, dtype=torch.float64)), ValueError, "ref_logits has shape"),
    (dict(tokens=torch.zeros(3, 6)), TypeError, "integer token ids"),
    (dict(tokens=torch.full((3, 6), 11)), ValueError, "tokens must be ids"),
    (dict(mask=torch.ones(3, 5)), ValueError, "mask has shape"),
    (dict(mask=torch.full((3, 6), 2.0)), ValueError, "only 0/1"),
    (dict(ref_logits=torch.full((3, 6, 11), float("nan"), dtype=torch.float64)), ValueError, "ref_logits has non-f"),
    (dict(logits=torch.full((3, 6, 11), float("inf"), dtype=torch.float64)), ValueError, "^logits has non-finite"),
    (dict(old_logp=torch.zeros(3, 5, dtype=torch.float64)), ValueError, "old_logp has shape"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(beta=-1.0), ValueError, "beta"),
    (dict(group=torch.zeros(2, dtype=torch.long)), ValueError, "group has shape"),
])
def test_bad_inputs_raise_clear_errors(change, error, match):
    with pytest.raises(error, match=match):
        full_kl_surrogate(**_bad(**change))


def test_junk_in_padding_is_ignored():
    args = _bad()
    logits = args["logits"].detach().clone()
    logits[0, 5] = float("nan")
    loss = full_kl_surrogate(logits.requires_grad_(True), args["ref_logits"], args["tokens"], args["mask"])
    assert torch.isfinite(_grads(loss, logits)[0]).all()


def test_statistics_must_align_with_the_batch():
    args = _bad()
    zeros = torch.zeros(5, 6, dtype=torch.float64)
    stats = full_statistics(zeros, zeros, zeros, torch.ones(5, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="statistics.cv_coef has shape"):
        full_kl_surrogate(**args, statistics=stats)


def test_hidden_path_checks_projection_shapes():
    h, w, h_ref, w_ref, tokens, mask, _ = _random_batch()
    with pytest.raises(ValueError, match="weight must be"):
        full_kl_surrogate_from_hidden(h, w[:, :3], h_ref, w_ref, tokens, mask)
    with pytest.raises(ValueError, match="ref_weight has"):
        full_kl_surrogate_from_hidden(h, w, h_ref, w_ref[:5], tokens, mask)


def test_one_registry_holds_full_and_the_api_exports_it():
    """`full` is in kl_adapters.PRESETS (the registry every command, adapter and the API read), not in the
    sampled-token view that kl_surrogate computes; its functions are exported at the top level."""
    import kl_adapters
    from kl_adapters.presets import get_preset

    assert kl_adapters.PRESETS["full"] is get_preset("full") and "full" not in kl_adapters.SAMPLED_TOKEN_PRESETS
    assert set(kl_adapters.SAMPLED_TOKEN_PRESETS) == {n for n, p in kl_adapters.PRESETS.items()
                                                       if not p.needs_full_logits}
    assert kl_adapters.full_kl_surrogate is full_kl_surrogate and "full_kl_surrogate_from_hidden" in dir(kl_adapters)
    with pytest.raises(ValueError, match="full next-token distributions"):
        kl_adapters.kl_surrogate(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), preset="full")
