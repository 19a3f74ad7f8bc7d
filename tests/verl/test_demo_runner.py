"""bench/demo_verl.py (issue 6's exact-objective benchmark, verl side): the runner works end to end, and its loss is
verl's real ppo_loss going through the adapter when (and only when) verl's config names kl_adapters:<preset>.

Gradient identities checked on one sampled group (pi != pi_ref), with N_tok the group's completion tokens:
    grad ppo_loss[kl_adapters:sequence]              = (G T / N_tok) grad harness.core_loss("sequence")
    grad (reward path: apply_kl_penalty + grpo + ppo_loss) = the same (on-policy, "reward" == "sequence" token by token)
    grad ppo_loss[k3+]                               = (G T / N_tok) grad harness.core_loss("token")   (k1 per token)
    grad ppo_loss[low_var_kl]                        = (G T / N_tok) grad harness.core_loss("k3-loss"), != the two above
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent / "bench"), str(TESTS)]

import demo_common  # noqa: E402
import demo_verl  # noqa: E402
from demo_checks import REFERENCE_CHECKSUM, kl_part_error, reference_checksum, run_runner, sampled_group  # noqa: E402

from kl_adapters.demo.problem import ToyProblem  # noqa: E402

G = 8


def test_same_reference_policy_as_the_trl_benchmark():
    """pi_ref, hence pi*, is the same problem in every environment (demo_checks.REFERENCE_CHECKSUM)."""
    assert reference_checksum(ToyProblem()) == pytest.approx(REFERENCE_CHECKSUM, abs=1e-6)


def test_runner_end_to_end(tmp_path):
    """3 steps, G=8, 1 seed, two configurations through the script's own main (in this process: --workers 0)."""
    pytest.importorskip("matplotlib")
    configs = ["verl-default", "kl_adapters:sequence"]
    doc = run_runner(demo_common, demo_verl, configs, tmp_path, G)
    for config in configs:
        (metrics,) = doc["framework_metrics"][config]
        assert all(m["kl_coef"] == pytest.approx(ToyProblem.beta * (G - 1) / G) for m in metrics)
    # the adapter's metrics appear only where verl's config named it
    assert all("kl_adapters/seq_kl" in m for m in doc["framework_metrics"]["kl_adapters:sequence"][0])
    assert not any("kl_adapters/seq_kl" in m for m in doc["framework_metrics"]["verl-default"][0])


@pytest.fixture(scope="module")
def sampled():
    return sampled_group(G)


@pytest.mark.parametrize("config, preset, same", [("kl_adapters:sequence", "sequence", True),
                                                  ("kl_adapters:reward (reward path)", "sequence", True),
                                                  ("k3+", "token", True), ("verl-default", "sequence", False),
                                                  ("verl-default", "token", False),
                                                  ("verl-default", "k3-loss", True), ("beta=0", None, True)])
def test_loss_is_verls_through_the_adapter(sampled, config, preset, same):
    problem, model, batch = sampled
    loss_fn = demo_verl.VerlLoss(problem, config, G)
    err = kl_part_error(loss_fn, problem, model, batch, preset, G)
    assert (err < 1e-4) == same, f"relative error of the KL part {err:.2e}"
    assert ("kl_adapters/seq_kl" in loss_fn.metrics[0]) == config.startswith("kl_adapters:")
