"""The task benchmark through OpenRLHF (bench/task.py --framework openrlhf: bench/task_openrlhf.py on
kl_adapters.demo.task.harness). The harness's own bookkeeping is pinned in tests/verl/test_task_harness.py.

* advantages: OpenRLHF's experience maker (group_norm: std-normalised within each prompt group, std + 1e-9) agrees
  with the harness's TRL advantages (std + 1e-4) to its epsilon;
* beta means TRL's (bench/task_openrlhf.py): on a round of several prompt groups with prompts of different widths, the
  gradient of OpenRLHF's training step is the token-mean task gradient plus grad kl_surrogate(preset,
  beta = rl.beta B / N_tok) (rl.beta / N_tok times the sum over the B sequences, TRL's loss_type "dapo" with beta per
  token), with kl_ctl = beta for OpenRLHF's k3 loss and unbiased_gradient (k1 per token on-policy) and under
  --algo.kl.preset (sequence-plain: the sequence KL, over the policy loss's token count);
* kl_adapters:sequence: the experience maker attaches the rollout statistics to every row, and they change the
  gradient;
* a smoke run of every configuration through bench/task.py's main (smoke scale, 4 steps, lag 2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent / "bench"), str(TESTS)]

import task_openrlhf  # noqa: E402
from openrlhf_harness import HAS_LOSS_AGG_MODE  # noqa: E402
from task_checks import RL, grad, perturbed_round, relative, run_task_benchmark  # noqa: E402

#: every configuration's arguments (demo_openrlhf.cli_argv) include --actor.loss_agg_mode token-mean
pytestmark = pytest.mark.skipif(not HAS_LOSS_AGG_MODE, reason="bench/task_openrlhf.py passes --actor.loss_agg_mode, "
                                                              "which arrived in OpenRLHF 0.11.2")
HORIZON = 6  # task_checks.perturbed_round's max_new_tokens


@pytest.fixture(scope="module")
def sampled():
    return perturbed_round()


def loss_and_batch(config: str, sampled):
    """A TaskOpenRLHFLoss (made now: kl-adapters' activation is per process) and the round after its rollout."""
    policy, reference, round_ = sampled
    loss_fn = task_openrlhf.TaskOpenRLHFLoss(config, RL, HORIZON)
    return loss_fn, loss_fn.rollout(policy, reference, round_)


def openrlhf_logps(model, batch):
    """[B, T] log-probs from OpenRLHF's Actor.forward (its position ids), with gradient."""
    from demo_openrlhf import actor_of

    return actor_of(model)(sequences=batch.input_ids, action_mask=batch.mask, attention_mask=batch.attention_mask)


def test_openrlhf_advantages_agree_with_trls(sampled):
    _, batch = loss_and_batch("beta=0", sampled)
    assert batch.advantages.abs().sum() > 0
    torch.testing.assert_close(batch.advantages, sampled[2].advantages, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("config, preset", [("openrlhf-default-k3", "k3-loss"), ("unbiased_gradient", "token"),
                                            ("kl_adapters:sequence-plain", "sequence-plain")])
def test_beta_means_trls(sampled, config, preset):
    from kl_adapters import kl_surrogate

    policy, reference, _ = sampled
    loss_fn, batch = loss_and_batch("beta=0", sampled)
    task = grad(loss_fn(policy, batch), policy)
    tokens = batch.mask.sum()
    token_mean = -(batch.advantages[:, None] * openrlhf_logps(policy, batch)).sum() / tokens  # on-policy: ratio 1
    assert relative(task - grad(token_mean, policy), task) < 1e-4

    loss_fn, batch = loss_and_batch(config, sampled)
    ours = grad(loss_fn(policy, batch), policy)
    with torch.no_grad():
        ref = openrlhf_logps(reference, batch)
    beta = RL.beta * batch.mask.shape[0] / tokens
    expected = grad(kl_surrogate(openrlhf_logps(policy, batch), ref, batch.mask, preset=preset, beta=beta), policy)
    assert relative(ours - task - expected, expected) < 1e-4
    assert loss_fn.metrics[0]["kl_ctl"] == RL.beta


def test_rollout_statistics_reach_every_row(sampled):
    """kl_adapters:sequence: each row of the round carries the adapter's rollout statistics (fitted in OpenRLHF's
    experience maker), the training step uses them: its gradient differs from sequence-plain's."""
    from kl_adapters.adapters.openrlhf.statistics import KEYS

    policy, _, _ = sampled
    plain, batch = loss_and_batch("kl_adapters:sequence-plain", sampled)
    without = grad(plain(policy, batch), policy)
    loss_fn, batch = loss_and_batch("kl_adapters:sequence", sampled)
    assert len(loss_fn.items) == batch.mask.shape[0]
    assert all(set(KEYS.values()) <= set(item.info) for item in loss_fn.items)
    assert relative(grad(loss_fn(policy, batch), policy) - without, without) > 1e-4


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="OpenRLHF configuration"):
        task_openrlhf.TaskOpenRLHFLoss("k3+", RL, HORIZON)


def test_smoke_run(tmp_path):
    """Every configuration through bench/task.py (in this process): evaluation rows, finite metrics, lag 2's
    staleness; kl_ctl = beta in every configuration (0 for beta=0); kl-adapters' metrics exactly under its flag."""
    configs = list(task_openrlhf.CONFIGS)
    runs = run_task_benchmark("openrlhf", configs, tmp_path / "out", tmp_path / "cache")
    for config, run in runs.items():
        adapter = config.startswith("kl_adapters:")
        assert all(("kl_adapters/seq_kl" in s) == adapter for s in run["steps"])
        for s in run["steps"]:
            beta = 0.0 if config == "beta=0" else 0.05
            assert s["kl_ctl"] == beta
        assert run["key"]["framework"] == "openrlhf" and run["key"]["rl"]["lag"] == 2
