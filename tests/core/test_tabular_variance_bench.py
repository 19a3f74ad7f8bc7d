"""bench/tabular_variance.py at tiny sizes: its closed-form batch gradient is the trainer's, and its table runs.

- (1/G) sum_i sum_t (A_i - beta c_{i,t}) (e_{y_t} - pi(.|y_<t)) per batch equals autograd through the GRPO task loss
  plus kl_surrogate (fitted with TaskAdvantages and EndOfSequence, as the bench passes them) on that batch alone.
- The distance to the optimum falls along the exact ascent path, and a smoke run reports ratio 1 for the plain form.
"""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import tabular_variance as tv  # noqa: E402

from kl_adapters import EndOfSequence, TaskAdvantages, kl_surrogate  # noqa: E402
from kl_adapters.audit import sequence_space, token_logps  # noqa: E402

BETA, G = 0.1, 4


@pytest.mark.parametrize("name", ["sequence", "sequence-plain", "token"])
def test_closed_form_batch_gradient_equals_autograd(name):
    space = sequence_space(4, 3)
    ref, rewards = tv.problem(space, 0, 1.0)
    logits = ref + 0.7 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    idx = torch.multinomial(token_logps(space, logits).sum(-1).exp(), 2 * G, replacement=True,
                            generator=torch.Generator().manual_seed(2))
    g = tv.batch_gradients(space, logits, ref, rewards, idx, G, BETA, [name])[name]
    for k in range(2):
        rows = idx[k * G:(k + 1) * G]
        theta = logits.clone().requires_grad_(True)
        lp, mask = token_logps(space, theta)[rows], space.mask[rows]
        r = rewards[rows]
        adv = r - r.mean()
        extra = {}
        if name == "sequence":
            node, token = space.node_of_token[rows], space.token[rows]
            prob = torch.softmax(logits, -1)[node, space.eos] * mask
            extra = {"task": TaskAdvantages(adv, BETA), "eos": EndOfSequence(prob, (token == space.eos) & mask)}
        objective = (adv * lp.sum(-1)).mean() - kl_surrogate(lp, token_logps(space, ref)[rows], mask, preset=name,
                                                              beta=BETA, **extra)
        torch.testing.assert_close(g[k], torch.autograd.grad(objective, theta)[0].flatten(), rtol=1e-10, atol=1e-13)


def test_ascent_approaches_the_optimum_and_smoke_table():
    space = sequence_space(3, 3)
    ref, rewards = tv.problem(space, 0, 1.0)
    path = tv.ascent_path(space, ref, rewards, BETA, [0, 20, 200], lr=0.05)
    gaps = [tv.distance_to_optimum(space, logits, ref, rewards, BETA) for logits in path.values()]
    assert gaps[0] > gaps[1] > gaps[2] >= 0
    args = argparse.Namespace(vocab=3, horizon=3, beta=BETA, ref_scale=1.0, seeds=[0], steps=[0, 50], ascent_lr=0.05,
                              groups=[8], batches=64, batches_per_call=32, presets=["sequence-plain", "sequence"])
    rows = tv.measure(args)
    assert [r["presets"]["sequence-plain"]["ratio"] for r in rows] == [1.0, 1.0]
    assert "sequence above sequence-plain" in tv.table(rows, args)
