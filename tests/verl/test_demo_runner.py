"""bench/demo_verl.py (issue 6's exact-objective benchmark, verl side): the runner works end to end, and its loss is
verl's real ppo_loss going through the adapter when (and only when) verl's config names kl_adapters:<preset>.

Gradient identities checked on one sampled group (pi != pi_ref), with N_tok the group's completion tokens:
    grad ppo_loss[kl_adapters:sequence]              = (G T / N_tok) grad harness.core_loss("sequence") with the
        reduced preset's inputs: task=TaskAdvantages(r_i - mean_j r_j, kl_loss_coef, normalized=False: what verl's
        driver tells the workers for grpo without std) and eos=EndOfSequence(the harness's pi(EOS), y == EOS, T)
    grad (reward path: apply_kl_penalty + grpo + ppo_loss) = the same without eos (the TaskRunner has no logits;
        on-policy, "reward" == "sequence" token by token)
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
import demo_checks  # noqa: E402
from demo_checks import REFERENCE_CHECKSUM, kl_part_error, reference_checksum, run_runner, sampled_group  # noqa: E402

from kl_adapters.demo.harness import core_loss  # noqa: E402

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


@pytest.mark.parametrize("config, preset, same", [("k3+", "token", True), ("verl-default", "sequence", False),
                                                  ("verl-default", "token", False),
                                                  ("verl-default", "k3-loss", True), ("beta=0", None, True)])
def test_loss_is_verls_through_the_adapter(sampled, config, preset, same):
    problem, model, batch = sampled
    loss_fn = demo_verl.VerlLoss(problem, config, G)
    err = kl_part_error(loss_fn, problem, model, batch, preset, G)
    assert (err < 1e-4) == same, f"relative error of the KL part {err:.2e}"
    assert ("kl_adapters/seq_kl" in loss_fn.metrics[0]) == config.startswith("kl_adapters:")


def reduced_kl_grad(problem, model, batch, eos: bool):
    """(G T / N_tok) grad of the KL part of harness.core_loss("sequence") with the inputs the adapter hands the core."""
    from kl_adapters import EndOfSequence, TaskAdvantages, kl_surrogate
    from kl_adapters.demo.harness import batch_logps_and_eos, kl_coefficient

    logp, prob, is_eos = batch_logps_and_eos(problem, model, batch)
    coef = kl_coefficient(problem, G)
    inputs = {"task": TaskAdvantages(batch.advantages, coef, normalized=False)}
    if eos:
        inputs["eos"] = EndOfSequence(prob, is_eos, problem.horizon)
    kl = kl_surrogate(logp, batch.ref_logp, batch.completion_mask, preset="sequence", beta=coef / problem.horizon,
                      **inputs)
    return G * problem.horizon / batch.completion_mask.sum() * demo_checks._grad(kl, model)


@pytest.mark.parametrize("config, eos", [("kl_adapters:sequence", True), ("kl_adapters:reward (reward path)", False)])
def test_reduced_presets_get_the_task_and_eos(sampled, config, eos):
    """The reduced presets through verl's code: the KL part equals the core's with the harness's advantages as the task
    (shift-only) and, on the loss path, the end-of-sequence probabilities the harness supplies in model_output."""
    problem, model, batch = sampled
    loss_fn = demo_verl.VerlLoss(problem, config, G)
    ours = demo_checks._grad(loss_fn(model, batch), model)
    task = G * problem.horizon / batch.completion_mask.sum() * demo_checks._grad(
        core_loss(problem, None, G)(model, batch), model)
    expected = reduced_kl_grad(problem, model, batch, eos)
    err = ((ours - task - expected).norm() / expected.norm()).item()
    assert err < 1e-4, f"relative error of the KL part {err:.2e}"
    other = reduced_kl_grad(problem, model, batch, not eos)
    assert ((ours - task - other).norm() / other.norm()).item() > 1e-3  # on this group eos changes the gradient
    assert "kl_adapters/seq_kl" in loss_fn.metrics[0]


def test_harness_eos_probabilities(sampled):
    """harness.batch_logps_and_eos: the same log-probs as batch_logps, pi(EOS) = softmax of the logits at EOS."""
    import torch

    from kl_adapters.demo.harness import batch_logps, batch_logps_and_eos

    problem, model, batch = sampled
    logp, prob, is_eos = batch_logps_and_eos(problem, model, batch)
    assert torch.equal(logp, batch_logps(model, batch))
    mask = batch.completion_mask
    attention = torch.cat([torch.ones_like(mask[:, :1], dtype=torch.long), mask.long()], 1)
    logits = model(input_ids=batch.input_ids, attention_mask=attention).logits[:, :-1].double()
    torch.testing.assert_close(prob.double(), logits.softmax(-1)[..., 0] * mask, rtol=1e-5, atol=1e-7)
    assert torch.equal(is_eos, mask & (batch.input_ids[:, 1:] == 0)) and is_eos.any()
