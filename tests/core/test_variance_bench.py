"""bench/variance.py at tiny sizes: its exact DP, its closed-form batch gradients and its estimates are right.

- The DP over (position, state) gives KL_seq and grad KL_seq of the bigram policy exactly: equal to the enumeration
  of every sequence (kl_adapters.audit) with the tabular logits of each prefix = the bigram row of its last token.
- The batch gradient without autograd, (1/G) sum_j sum_t c_t (e_{s_t, y_t} - e_{s_t} (x) pi(.|s_t)) (+ the pathwise
  term of `full`), equals autograd through kl_surrogate / full_kl_surrogate on the same batch.
- The Monte Carlo estimates: `token` has ratio 1 to itself; an unbiased preset's bias stays within a few standard
  errors.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import variance  # noqa: E402

from kl_adapters import kl_surrogate  # noqa: E402
from kl_adapters.audit import kl_seq, sequence_space  # noqa: E402
from kl_adapters.full_vocab import full_kl_surrogate  # noqa: E402

VOCAB, HORIZON = 4, 3


def _node_logits(space, table):
    """Tabular logits of every prefix of the enumerated space: the bigram row of its last token (BOS row if empty)."""
    last = [p[-1] if p else VOCAB - 1 for p in space.nodes]
    return table[torch.tensor(last)]


def test_dynamic_programming_equals_enumeration():
    model = variance.bigram(VOCAB, HORIZON, drift=0.7, offp=0.3, eos=0.9, seed=1)
    grad, kl = variance.exact_gradient(model, HORIZON)
    space = sequence_space(VOCAB, HORIZON)
    theta = model.logits.clone().requires_grad_(True)
    brute = kl_seq(space, _node_logits(space, theta), _node_logits(space, model.ref_logits))
    assert kl == pytest.approx(float(brute.detach()), rel=1e-12)
    torch.testing.assert_close(grad, torch.autograd.grad(brute, theta)[0].flatten(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("name", ["sequence", "token", "k3-reward", "full"])
def test_closed_form_batch_gradient_equals_autograd(name, off_policy):
    model = variance.bigram(VOCAB, 6, drift=0.5, offp=0.3, eos=2.0, seed=2)
    s = variance.sample(model, 8, 6, off_policy, torch.Generator().manual_seed(0))
    group_size = 4
    group = torch.arange(8) // group_size
    g = variance.preset_gradients(name, s, model, group, group_size)
    theta = model.logits.clone().requires_grad_(True)
    eos = s.eos(model.vocab)  # the bench passes the end-of-sequence probabilities, as the adapters do
    if name == "full":
        loss = full_kl_surrogate(theta[s.states], model.ref_logits[s.states], s.tokens, s.mask, old_logp=s.old_logp,
                                 group=group, eos=eos)
    else:
        logp = torch.log_softmax(theta, -1)[s.states, s.tokens]
        extra = {"group": group, "eos": eos} if name == "sequence" else {}
        loss = kl_surrogate(logp, s.ref_logp, s.mask, preset=name, old_logp=s.old_logp, **extra)
    # kl_surrogate averages over all 8 rows, i.e. over the 2 batches: the mean of the batch gradients
    torch.testing.assert_close(g.mean(0), torch.autograd.grad(loss, theta)[0].flatten(), rtol=1e-10, atol=1e-13)


def test_grid_smoke_ratios_and_bias():
    args = variance.parse_args(["--horizons", "8", "--groups", "1", "4", "--drifts", "0.3", "--vocab", "5",
                                "--tokens", "4096", "--presets", "sequence", "sequence-plain", "token", "full"])
    rows = variance.run_grid(args)
    assert {r["regime"] for r in rows} == {"on", "off"} and len(rows) == 2 * 2 * 4
    for r in rows:
        assert r["n_batches"] == 4096 // 8 // r["G"]
        if r["preset"] == "token":
            assert r["ratio"] == pytest.approx(1.0)
        else:
            assert r["bias"] < 5 * r["bias_se"], r  # unbiased on- and off-policy
        if r["preset"] in ("sequence", "full"):  # paired on the same batches against sequence-plain
            assert r["plain_ratio_se"] >= 0
            if r["preset"] == "sequence" and r["G"] == 1:  # no other rows: sequence is sequence-plain
                assert r["plain_ratio"] == pytest.approx(1.0) and r["plain_ratio_se"] == pytest.approx(0.0, abs=1e-12)
        else:
            assert "plain_ratio" not in r
    assert "KL vs plain" in variance.grid_table(rows, args.presets)
    assert "paired mean squared error ratio" in variance.targets_report(rows)


def test_task_mode_smoke():
    """With a task reward: task + KL ratios to sequence-plain, unbiased against (1 - 1/G) grad E[R] - beta grad KL, at
    the drifted policy and after exact ascent steps."""
    args = variance.parse_args(["--horizons", "8", "--groups", "4", "--drifts", "0.3", "--vocab", "5", "--regimes",
                                "on", "--tokens", "4096", "--presets", "sequence", "full", "--task", "0.5",
                                "--states", "0", "30"])
    rows = variance.run_grid(args)
    assert {r["state"] for r in rows} == {0, 30} and {r["preset"] for r in rows} >= {"sequence-plain", "token"}
    for r in rows:
        if r["preset"] == "sequence-plain":
            assert r["total_ratio"] == pytest.approx(1.0)
        if r["preset"] != "token":
            assert r["total_bias"] < 5 * r["total_bias_se"], r


def test_micro_mode_smoke():
    args = variance.parse_args(["--micro", "--horizons", "8", "--rollouts", "4", "--micro-sizes", "1", "2",
                                "--vocab", "5", "--tokens", "2048", "--presets", "sequence", "full"])
    rows = variance.run_micro(args)
    assert {(r["m"], r["statistics"]) for r in rows} == {(1, "rollout"), (1, "micro"), (2, "rollout"), (2, "micro")}
    assert all(r["bias"] < 5 * r["bias_se"] for r in rows)
