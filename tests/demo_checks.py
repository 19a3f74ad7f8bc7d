"""Helpers shared by the demo tests of every suite (tests only; each suite puts tests/ on sys.path).

The exact-objective benchmark must solve the same problem in every framework environment, and each framework's
runner must train through that framework's loss with the documented gradient: these are the checks they share.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kl_adapters.demo.harness import core_loss, sample_batch
from kl_adapters.demo.problem import ToyProblem, completion_logprobs, enumerated_input_ids, sequence_logprobs

#: sum of log pi_ref over the 31 sequences of ToyProblem() for seed 0: the same in the TRL, verl and OpenRLHF
#: environments (their transformers versions differ), so every framework's benchmark solves the same problem
REFERENCE_CHECKSUM = -125.5008010136


def reference_checksum(problem: ToyProblem) -> float:
    return float(sequence_logprobs(problem, problem.model(seed=0)).sum())


def run_runner(demo_common, module, configs: list[str], out: Path, group: int) -> dict:
    """A bench/demo_<framework>.py runner through its own main (horizon 2, 3 steps, 1 seed, in this process, with the
    gradient check); checks the files, the check and the exact histories, returns the JSON document."""
    code = demo_common.main(name=module.NAME, framework=module.FRAMEWORK, run=module.run, configs=module.CONFIGS,
                            baseline=module.BASELINE, notes=module.__doc__,
                            check=module.check,
                            argv=["--steps", "3", "--seeds", "1", "--group", str(group), "--workers", "0",
                                  "--configs", ",".join(configs), "--out", str(out), "--horizon", "2"])
    assert code == 0
    name = f"{module.NAME}_quick"
    doc = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.png").stat().st_size > 0 and (out / f"{name}.txt").exists() and (out / f"{name}.log").exists()
    assert "--steps 3" in doc["command"] and list(doc["histories"]) == configs
    for config in configs:
        (history,) = doc["histories"][config]
        assert len(history) == 4
        assert all(math.isfinite(v) for step in history for v in step.values())
        (metrics,) = doc["framework_metrics"][config]
        assert len(metrics) == 3
    (ratio,) = doc["ratio"]["per_seed"]
    assert math.isfinite(ratio) and ratio > 0
    check_gradient_rows(doc["gradient_check"], unbiased=[c for c in configs if c.startswith("kl_adapters:")])
    return doc


def check_gradient_rows(rows: list[dict], unbiased: list[str]) -> None:
    """The gradient check's rows: ~0 relative bias for `unbiased` (float32 rounding), a visible one for the others."""
    assert rows
    for row in rows:
        assert (row["relative_bias"] < 1e-4) == (row["config"] in unbiased), row
        assert row["cosine"] > 0.5 and row["batch_rows"] in (1, 2), row


def sampled_group(group: int):
    """A policy moved away from its reference and one group sampled from it (harness.sample_batch)."""
    problem = ToyProblem()
    model = problem.model(0)
    with torch.no_grad():
        ref = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen) * p.abs().mean())
    batch, _ = sample_batch(problem, model, ref, group, torch.Generator().manual_seed(2))
    return problem, model, batch


def _grad(loss, model):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def kl_part_error(loss_fn, problem, model, batch, preset: str | None, group: int) -> float:
    """Relative error of a framework loss's gradient against (G T / N_tok) grad harness.core_loss(preset), measured
    on the KL part (on the task gradient when preset is None)."""
    scale = group * problem.horizon / batch.completion_mask.sum()
    ours = _grad(loss_fn(model, batch), model)
    expected = scale * _grad(core_loss(problem, preset, group)(model, batch), model)
    task = scale * _grad(core_loss(problem, None, group)(model, batch), model)
    return ((ours - expected).norm() / (task.norm() if preset is None else (expected - task).norm())).item()
