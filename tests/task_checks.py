"""Helpers shared by the task-benchmark tests of the verl and OpenRLHF suites (tests only; each suite puts tests/ and
bench/ on sys.path): a smoke run of bench/task.py, and a generation round on which a framework's loss is checked.

The round: a tiny random Llama as pi_ref and a perturbed copy as pi (so the KL and its gradient are not zero), three
prompts of the short format (left-padded to different widths) with four completions each, sampled from pi by
`task.harness.generate` (on-policy: PPO's ratio is 1 up to float rounding) and rewarded by `parity`.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import torch

from kl_adapters.demo.output import read_runs
from kl_adapters.demo.task import arithmetic
from kl_adapters.demo.task.harness import generate
from kl_adapters.demo.task.settings import RLSettings

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: the smoke runs: 4 steps, 2 generation rounds (lag 2: staleness 0, 1, 0, 1), evaluations at steps 0, 3 (eval_every)
#: and 4 (the last)
SMOKE = ["--setting", "short", "--scale", "smoke", "--seeds", "0", "--workers", "0", "--steps", "4", "--lag", "2"]
RL = RLSettings(steps=1, prompts_per_step=3, group=4, beta=0.3)


def run_task_benchmark(framework: str, configs: list[str], out: Path, cache: Path) -> dict[str, dict]:
    """bench/task.py's main in this process on the smoke settings; checks what every run must hold (evaluation rows at
    steps 0, 3, 4 with finite numbers, 4 finite steps, the staleness of lag 2, the files) and returns config -> run
    (its line of the .jsonl.gz)."""
    spec = importlib.util.spec_from_file_location("bench_task", BENCH / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    argv = [*SMOKE, "--framework", framework, "--configs", ",".join(configs), "--cache", str(cache), "--out", str(out)]
    assert task.main(argv) == 0
    name = f"task_short_{framework}"
    runs = {r["config"]: r for r in read_runs(out / f"{name}.jsonl.gz")}
    assert list(runs) == configs and (out / f"{name}.txt").exists() and (out / f"{name}.png").stat().st_size > 0
    for config, run in runs.items():
        assert "error" not in run, f"{config}: {run['error']}"
        assert [row["step"] for row in run["history"]] == [0, 3, 4] and run["finite"]
        assert "kl_adapters_source" in run["environment"]  # each run records the code it ran
        assert all(math.isfinite(v) for row in run["history"] for split in ("id", "ood") for v in row[split].values())
        assert [s["staleness"] for s in run["steps"]] == [0, 1, 0, 1]
        assert all(math.isfinite(v) for s in run["steps"] for v in s.values())
    return runs


def perturbed_round(seed: int = 0):
    """(pi, pi_ref, one generation round of RL.prompts_per_step prompts x RL.group completions from pi)."""
    from kl_adapters.demo.task.reference import tokenizer
    from kl_adapters.tiny_models import tiny_llama

    tok = tokenizer()
    reference = tiny_llama(len(tok), hidden=32, layers=2, seed=seed).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for p in policy.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen) * p.abs().mean())
    examples = [arithmetic.Example(p, a) for p, a in (("7+5=", "12"), ("31+48=", "79"), ("905+117=", "1022"))]
    torch.manual_seed(seed)
    round_ = generate(policy, reference, tok, examples, RL.group, 6, parity, step=0)
    return policy, reference, round_


def parity(completions: list[str], examples: list) -> list[float]:
    """A reward the random policy earns half the time (an even-length completion), so the advantages are not zero."""
    return [float(len(c) % 2 == 0) for c in completions]


def grad(loss: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def relative(error: torch.Tensor, scale: torch.Tensor) -> float:
    return (error.norm() / scale.norm()).item()
