"""bench/demo_openrlhf.py (issue 6's exact-objective benchmark, OpenRLHF side): the runner works end to end, and its
loss is the one OpenRLHF's ActorPPOTrainer.training_step builds, through the adapter only under --algo.kl.preset.

Gradient identities checked on one sampled group (pi != pi_ref), N_tok the group's completion tokens, with the
runner's kl_ctl beta (G-1)/G (OpenRLHF's own KL losses and the adapter's share the policy loss's normaliser N_tok):
    grad loss[kl_adapters:sequence-plain] = (G T / N_tok) grad harness.core_loss("sequence-plain")
    grad loss[unbiased_gradient]      = (G T / N_tok) grad harness.core_loss("token")      (on-policy: IS weight 1)
    grad loss[openrlhf-default-k3]    = (G T / N_tok) grad harness.core_loss("k3-loss"), != "sequence"
    grad loss[kl_adapters:sequence]   = the same with the core's statistics called by hand (task, eos)
so every configuration optimizes its documented objective with the intended strength relative to the task.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent / "bench"), str(TESTS)]

import demo_common  # noqa: E402
import demo_openrlhf  # noqa: E402
from demo_checks import REFERENCE_CHECKSUM, kl_part_error, reference_checksum, run_runner, sampled_group  # noqa: E402

from kl_adapters.demo.problem import ToyProblem  # noqa: E402
from openrlhf_harness import HAS_LOSS_AGG_MODE  # noqa: E402

G = 8
#: every configuration's arguments (demo_openrlhf.cli_argv) include --actor.loss_agg_mode token-mean
NEEDS_0_11_2 = pytest.mark.skipif(not HAS_LOSS_AGG_MODE, reason="bench/demo_openrlhf.py passes --actor.loss_agg_mode, "
                                                                 "which arrived in OpenRLHF 0.11.2")


def test_same_reference_policy_as_the_trl_benchmark():
    """pi_ref, hence pi*, is the same problem in every environment (demo_checks.REFERENCE_CHECKSUM)."""
    assert reference_checksum(ToyProblem()) == pytest.approx(REFERENCE_CHECKSUM, abs=1e-6)


@NEEDS_0_11_2
def test_runner_end_to_end(tmp_path):
    """3 steps, G=8, 1 seed, three configurations (with the gradient check) through the script's own main (in this
    process: --workers 0)."""
    pytest.importorskip("matplotlib")
    configs = ["openrlhf-default-k3", "kl_adapters:sequence", "kl_adapters:sequence-plain"]
    doc = run_runner(demo_common, demo_openrlhf, configs, tmp_path, G)
    for config in configs:
        (metrics,) = doc["framework_metrics"][config]
        assert all(math.isfinite(v) for m in metrics for v in m.values())
    # the adapter's metrics appear only under its flag; every configuration's kl_ctl is beta (G-1)/G
    for config in ("kl_adapters:sequence", "openrlhf-default-k3"):
        assert all(("kl_adapters/seq_kl" in m) == (config != "openrlhf-default-k3")
                   and m["kl_ctl"] == pytest.approx(ToyProblem.beta * (G - 1) / G)
                   for m in doc["framework_metrics"][config][0])


@pytest.fixture(scope="module")
def sampled():
    return sampled_group(G)


@pytest.mark.parametrize("config, preset, same", [("kl_adapters:sequence-plain", "sequence-plain", True),
                                                  ("unbiased_gradient", "token", True),
                                                  ("openrlhf-default-k3", "k3-loss", True),
                                                  ("openrlhf-default-k3", "sequence", False), ("beta=0", None, True)])
@NEEDS_0_11_2
def test_loss_is_openrlhfs_through_the_adapter(sampled, config, preset, same):
    problem, model, batch = sampled
    loss_fn = demo_openrlhf.OpenRLHFLoss(problem, config, G)
    err = kl_part_error(loss_fn, problem, model, batch, preset, G)
    assert (err < 1e-4) == same, f"relative error of the KL part {err:.2e}"
    assert ("kl_adapters/seq_kl" in loss_fn.metrics[0]) == config.startswith("kl_adapters:")


@NEEDS_0_11_2
def test_reduced_preset_is_fitted_with_the_task_and_eos(sampled):
    """kl_adapters:sequence through OpenRLHF's compute_advantages_and_returns and training_step: the KL gradient is
    (G T / N_tok) grad kl_surrogate("sequence", statistics=kl_statistics(the sampling policy's log-probs, task =
    OpenRLHF's advantages r - mean r against beta (G-1)/G, eos = the harness's pi(EOS)), eos = the current policy's),
    from the first step on."""
    import torch

    from kl_adapters import EndOfSequence, TaskAdvantages, kl_statistics, kl_surrogate
    from kl_adapters.demo.harness import batch_logps_and_eos, core_loss, kl_coefficient

    problem, model, batch = sampled
    loss_fn = demo_openrlhf.OpenRLHFLoss(problem, "kl_adapters:sequence", G)
    params = list(model.parameters())
    grad = lambda loss: torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])  # noqa: E731
    ours = grad(loss_fn(model, batch))
    mask, coef = batch.completion_mask, kl_coefficient(problem, G)
    logp, prob, is_eos = batch_logps_and_eos(problem, model, batch)
    eos = EndOfSequence(prob, is_eos, problem.horizon)
    stats = kl_statistics(batch.old_logp, batch.ref_logp, mask, task=TaskAdvantages(batch.advantages, coef), eos=eos)
    assert (stats.eos_coef != 0).any() and (stats.past_coef != 0).any()
    scale = G * problem.horizon / mask.sum()
    task = scale * grad(core_loss(problem, None, G)(model, batch))
    kl = scale * grad(kl_surrogate(logp, batch.ref_logp, mask, preset="sequence", beta=coef / problem.horizon,
                                   statistics=stats, eos=eos))
    assert (ours - task - kl).norm() < 1e-4 * kl.norm()
