"""Bad input gets a clear error."""

import math
from dataclasses import replace

import pytest
import torch

from kl_adapters import get_preset, kl_reward, kl_surrogate, per_sequence_beta


def _batch(b=2, t=3):
    lp = -torch.rand(b, t)
    return lp, lp + 0.1, torch.ones(b, t, dtype=torch.bool)


def test_unknown_preset_lists_valid_names():
    lp, ref, m = _batch()
    with pytest.raises(ValueError, match=r"unknown KL preset 'k4'.*sequence.*reward.*token.*k3-loss"):
        kl_surrogate(lp, ref, m, preset="k4")
    with pytest.raises(ValueError, match="valid presets"):
        get_preset(None)


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda lp, ref, m: (lp, ref[:, :2], m), ValueError, r"ref_logp has shape \(2, 2\), expected \(2, 3\)"),
        (lambda lp, ref, m: (lp, ref, m[:1]), ValueError, "mask has shape"),
        (lambda lp, ref, m: (lp[0], ref[0], m[0]), ValueError, "must be 2-D"),
        (lambda lp, ref, m: (lp, ref.long(), m), TypeError, "ref_logp must be a floating-point"),
        (lambda lp, ref, m: (lp.tolist(), ref, m), TypeError, "logp must be a torch.Tensor"),
        (lambda lp, ref, m: (lp, ref, m.long() * 2), ValueError, "mask must contain only 0/1"),
        (lambda lp, ref, m: (lp, ref, m.float() * 0.5), ValueError, "mask must contain only 0/1"),
        (lambda lp, ref, m: (lp.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan"))), ref, m),
         ValueError, "logp has non-finite values"),
        (lambda lp, ref, m: (lp, ref.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(-math.inf)), m),
         ValueError, "ref_logp has non-finite values"),
    ],
)
def test_bad_batches_raise(mutate, error, message):
    lp, ref, m = mutate(*_batch())
    with pytest.raises(error, match=message):
        kl_surrogate(lp, ref, m)


def test_nonfinite_old_logp_raises_and_padding_may_hold_nan():
    lp, ref, m = _batch()
    with pytest.raises(ValueError, match="old_logp has non-finite"):
        kl_surrogate(lp, ref, m, old_logp=torch.full_like(lp, float("nan")))
    m[0, 2] = False
    lp[0, 2] = float("nan")
    assert torch.isfinite(kl_surrogate(lp, ref, m))


@pytest.mark.parametrize("beta", [-0.1, float("nan"), float("inf"), "0.1", True, torch.ones(2)])
def test_bad_beta_raises(beta):
    lp, ref, m = _batch()
    with pytest.raises((ValueError, TypeError), match="beta"):
        kl_surrogate(lp, ref, m, beta=beta)
    with pytest.raises((ValueError, TypeError), match="beta"):
        kl_reward(lp, ref, m, beta=beta)


def test_tensor_beta_is_accepted():
    lp, ref, m = _batch()
    assert torch.allclose(kl_surrogate(lp, ref, m, beta=torch.tensor(0.5)), kl_surrogate(lp, ref, m, beta=0.5))


def test_is_clip_conflicts_raise():
    lp, ref, m = _batch()
    with pytest.raises(ValueError, match="only exist off-policy"):
        kl_surrogate(lp, ref, m, is_clip=2.0)
    with pytest.raises(ValueError, match="silent no-op"):
        kl_surrogate(lp, ref, m, preset="k3-loss", old_logp=lp, is_clip=2.0)
    with pytest.raises(ValueError, match=">= 1"):
        kl_surrogate(lp, ref, m, old_logp=lp, is_clip=0.5)


def test_per_sequence_beta_conventions():
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert per_sequence_beta(0.1, m, "token-mean") == 0.1 * 2 / 4  # exact: a Python float, not a float32 tensor
    assert per_sequence_beta(0.1, m, "token-mean", num_tokens=8) == 0.1 * 2 / 8
    from_tensor = per_sequence_beta(0.1, m, "token-mean", num_tokens=torch.tensor(7))  # e.g. a global token count
    assert from_tensor.dtype == torch.float64 and float(from_tensor) == pytest.approx(0.1 * 2 / 7, rel=1e-15)
    assert per_sequence_beta(0.1, m, "seq-mean-token-sum") == 0.1
    assert per_sequence_beta(0.1, m, "token-sum") == pytest.approx(0.2)
    assert per_sequence_beta(0.1, m, "seq-mean-token-sum-norm", max_length=4) == pytest.approx(0.025)
    with pytest.raises(ValueError, match="max_length"):
        per_sequence_beta(0.1, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="length-normalized"):
        per_sequence_beta(0.1, m, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="unknown aggregation"):
        per_sequence_beta(0.1, m, "mean")


def test_per_sequence_beta_reproduces_a_token_mean_kl_loss():
    """beta * sum(mask * k)/N_tok has the gradient of per_sequence_beta(...) * kl_surrogate(preset k3-loss)."""
    torch.manual_seed(0)
    lp = (-torch.rand(3, 5)).requires_grad_(True)
    ref = lp.detach() + 0.3 * torch.randn(3, 5)
    m = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).bool()
    d = ref - lp
    native = 0.2 * ((torch.exp(d) - d - 1) * m).sum() / m.sum()
    g_native = torch.autograd.grad(native, lp)[0]
    ours = kl_surrogate(lp, ref, m, preset="k3-loss", beta=float(per_sequence_beta(0.2, m, "token-mean")))
    g_ours = torch.autograd.grad(ours, lp)[0]
    assert torch.allclose(g_native, g_ours, atol=1e-7)


def test_padding_garbage_gives_what_zero_padding_gives():
    """Validation reads min / max over all tokens and masks by multiplication when everything is finite; garbage in the
    padding (nan, inf, pi(EOS) outside [0, 1]) takes the exact path at real tokens and torch.where: the same weights."""
    from kl_adapters import EndOfSequence, TaskAdvantages, kl_statistics, kl_term

    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 5, generator=gen)
    ref, old = lp + 0.1 * torch.randn(4, 5, generator=gen), lp + 0.05 * torch.randn(4, 5, generator=gen)
    m = torch.ones(4, 5, dtype=torch.bool)
    m[1, 3:] = m[2, 4] = False
    prob, is_eos = 0.2 * torch.rand(4, 5, generator=gen), torch.zeros(4, 5, dtype=torch.bool)
    adv = torch.randn(4, 5, generator=gen)

    def run(fill):
        def padded(x, value):
            return torch.where(m, x, torch.full_like(x, value)) if fill else torch.where(m, x, torch.zeros_like(x))

        task = TaskAdvantages(padded(adv, float("inf")), 0.1)
        eos = EndOfSequence(padded(prob, 3.0), is_eos)
        args = (padded(lp, float("nan")), padded(ref, -math.inf), m)
        stats = kl_statistics(*args, old_logp=padded(old, float("nan")), task=task, eos=eos)
        stats = replace(stats, baseline=padded(stats.baseline, float("nan")), eos_count=padded(stats.eos_count, math.inf))
        own = kl_term(*args, old_logp=padded(old, float("nan")), task=task, eos=eos).coefficients
        given = kl_term(*args, old_logp=padded(old, float("nan")), statistics=stats, eos=eos).coefficients
        return own, given

    for clean, dirty in zip(run(False), run(True)):
        assert torch.isfinite(dirty).all()
        assert torch.equal(clean, dirty)
