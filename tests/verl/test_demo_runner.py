"""bench/demo_verl.py (issue 6's exact-objective benchmark, verl side): the runner works end to end, and its loss is
verl's real ppo_loss going through the adapter when (and only when) verl's config names kl_adapters:<preset>.

Gradient identities checked on one sampled group (pi != pi_ref), with N_tok the group's completion tokens:
    grad ppo_loss[kl_adapters:sequence]              = (G T / N_tok) grad harness.core_loss("sequence")
    grad (reward path: apply_kl_penalty + grpo + ppo_loss) = the same (on-policy, "reward" == "sequence" token by token)
    grad ppo_loss[k3+]                               = (G T / N_tok) grad harness.core_loss("token")   (k1 per token)
    grad ppo_loss[low_var_kl]                        = (G T / N_tok) grad harness.core_loss("k3-loss"), != the two above
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import demo_common  # noqa: E402
import demo_verl  # noqa: E402

from kl_adapters.demo.harness import core_loss, sample_batch  # noqa: E402
from kl_adapters.demo.problem import ToyProblem, completion_logprobs, enumerated_input_ids  # noqa: E402

G = 8


def test_same_reference_policy_as_the_trl_benchmark():
    """tests/trl/test_demo.py::REFERENCE_CHECKSUM: pi_ref, hence pi*, is the same problem in every environment."""
    from kl_adapters.demo.problem import ToyProblem, sequence_logprobs

    problem = ToyProblem()
    assert float(sequence_logprobs(problem, problem.model(seed=0)).sum()) == pytest.approx(-321.6748777134, abs=1e-6)


def test_runner_end_to_end(tmp_path):
    """3 steps, G=8, 1 seed, two configurations through the script's own main (in this process: --workers 0)."""
    pytest.importorskip("matplotlib")
    configs = ["verl-default", "kl_adapters:sequence"]
    code = demo_common.main(name=demo_verl.NAME, framework=demo_verl.FRAMEWORK, run=demo_verl.run,
                            configs=demo_verl.CONFIGS, baseline=demo_verl.BASELINE, notes=demo_verl.__doc__,
                            argv=["--steps", "3", "--seeds", "1", "--group", str(G), "--workers", "0",
                                  "--configs", ",".join(configs), "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "demo_verl.json").read_text())
    assert (tmp_path / "demo_verl.png").stat().st_size > 0 and (tmp_path / "demo_verl.txt").exists()
    assert "--steps 3" in doc["command"] and list(doc["histories"]) == configs
    for config in configs:
        (history,) = doc["histories"][config]
        assert len(history) == 4
        assert all(math.isfinite(v) for step in history for v in step.values())
        (metrics,) = doc["framework_metrics"][config]
        assert len(metrics) == 3 and all(m["kl_coef"] == pytest.approx(0.15 * (G - 1) / G) for m in metrics)
    # the adapter's metrics appear only where verl's config named it
    assert all("kl_adapters/seq_kl" in m for m in doc["framework_metrics"]["kl_adapters:sequence"][0])
    assert not any("kl_adapters/seq_kl" in m for m in doc["framework_metrics"]["verl-default"][0])
    (ratio,) = doc["ratio"]["per_seed"]
    assert math.isfinite(ratio) and ratio > 0


@pytest.fixture(scope="module")
def sampled():
    """A policy moved away from its reference and one group sampled from it (harness.sample_batch)."""
    problem = ToyProblem()
    model = problem.model(0)
    with torch.no_grad():
        ref = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen) * p.abs().mean())
    batch, _ = sample_batch(problem, model, ref, G, torch.Generator().manual_seed(2))
    return problem, model, batch


def _grad(loss, model):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


@pytest.mark.parametrize("config, preset, same", [("kl_adapters:sequence", "sequence", True),
                                                  ("kl_adapters:reward (reward path)", "sequence", True),
                                                  ("k3+", "token", True), ("verl-default", "sequence", False),
                                                  ("verl-default", "token", False),
                                                  ("verl-default", "k3-loss", True), ("beta=0", None, True)])
def test_loss_is_verls_through_the_adapter(sampled, config, preset, same):
    problem, model, batch = sampled
    scale = G * problem.horizon / batch.completion_mask.sum()
    loss_fn = demo_verl.VerlLoss(problem, config, G)
    ours = _grad(loss_fn(model, batch), model)
    expected = scale * _grad(core_loss(problem, preset, G)(model, batch), model)
    task = scale * _grad(core_loss(problem, None, G)(model, batch), model)
    err = ((ours - expected).norm() / (task.norm() if preset is None else (expected - task).norm())).item()
    assert (err < 1e-4) == same, f"relative error of the KL part {err:.2e}"
    assert ("kl_adapters/seq_kl" in loss_fn.metrics[0]) == config.startswith("kl_adapters:")
