"""The task benchmark through TRL (kl_adapters.demo.task; docs/task.md): its evaluation's exactness, the cached
reference, and a smoke run of bench/task.py (a few steps at the "smoke" scale) in every setting."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kl_adapters.demo.output import read_runs
from kl_adapters.demo.task import arithmetic, reference
from kl_adapters.demo.task.evaluate import completion_logps, encode_prompts, sample, sequence_kl
from kl_adapters.demo.task.settings import SCALES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke_reference(tmp_path_factory):
    cache = tmp_path_factory.mktemp("task_cache")
    return cache, reference.build(SCALES["smoke"].reference, cache, say=lambda *_: None)


def test_reference_is_cached_by_its_spec(smoke_reference):
    cache, folder = smoke_reference
    stamp = (folder / "reference.json").stat().st_mtime_ns
    assert reference.build(SCALES["smoke"].reference, cache, say=lambda *_: None) == folder  # not retrained
    assert (folder / "reference.json").stat().st_mtime_ns == stamp
    assert json.loads((folder / "reference.json").read_text())["spec"]["steps"] == SCALES["smoke"].reference.steps
    assert SCALES["smoke"].reference.key() != SCALES["cpu"].reference.key()


def test_the_sampler_keeps_the_policy_distributions_of_a_teacher_forced_forward(smoke_reference):
    """The KV-cache sampler on left-padded prompts of different lengths records, at every live position, the same
    next-token distribution as one forward over prompt + completion (RoPE: left padding moves no relative position),
    so the Rao-Blackwellized KL sums the right distributions."""
    from transformers import AutoModelForCausalLM

    _, folder = smoke_reference
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = reference.tokenizer()
    prompts = [e.prompt for e in arithmetic.draw(arithmetic.SPLITS["short"]["id"], 6, 0, test=True)]
    prompts += ["1+2=", "123+456:"]
    torch.manual_seed(0)
    samples = sample(model, *encode_prompts(tok, prompts), max_new_tokens=12)
    forced = completion_logps(model, samples)
    live = samples.mask
    assert live.any(1).all()
    assert torch.allclose(forced[live], samples.logp[live], atol=1e-5)
    assert torch.allclose(sequence_kl(samples, forced), torch.zeros(len(prompts), dtype=torch.float64), atol=1e-5)


def test_sequence_kl_is_the_sum_of_the_per_position_kls(smoke_reference):
    from transformers import AutoModelForCausalLM

    _, folder = smoke_reference
    policy, ref = (AutoModelForCausalLM.from_pretrained(folder).eval() for _ in range(2))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tok = reference.tokenizer()
    torch.manual_seed(1)
    samples = sample(policy, *encode_prompts(tok, ["12+3=", "7+8="]), max_new_tokens=6)
    ref_logp = completion_logps(ref, samples)
    expected = [sum(float(torch.nn.functional.kl_div(ref_logp[i, t], samples.logp[i, t], log_target=True,
                                                     reduction="sum"))
                    for t in range(samples.tokens.shape[1]) if samples.mask[i, t]) for i in range(2)]
    assert torch.allclose(sequence_kl(samples, ref_logp), torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    assert (sequence_kl(samples, ref_logp) > 0).all()


@pytest.mark.parametrize("setting", ["short", "scratch", "proxy"])
def test_smoke_run_of_the_benchmark(smoke_reference, tmp_path, setting):
    """bench/task.py end to end at the smoke scale: every configuration kind trains through GRPOTrainer.train(),
    each run is stored, the report names every configuration, and the adapter ran under `sequence`."""
    cache, _ = smoke_reference
    configs = "beta=0,trl-default,sequence,sequence+kl_target=0.5"
    cmd = [sys.executable, str(ROOT / "bench/task.py"), "--setting", setting, "--configs", configs, "--seeds", "0",
           "--scale", "smoke", "--workers", "0", "--cache", str(cache), "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = read_runs(tmp_path / f"task_{setting}_trl.jsonl.gz")
    assert [r["config"] for r in runs] == configs.split(",")
    assert all("error" not in r and r["finite"] and len(r["history"]) == 2 for r in runs)
    assert all("kl_adapters_source" in r["environment"] for r in runs)  # each run records the code it ran
    summary = json.loads((tmp_path / f"task_{setting}_trl.json").read_text())
    assert summary["run_environments"] == [runs[0]["environment"]] and "report_environment" in summary
    by_config = {r["config"]: r for r in runs}
    assert "kl_adapters/seq_kl" in by_config["sequence"]["trl"][-1]
    assert "kl_adapters/beta" in by_config["sequence+kl_target=0.5"]["trl"][-1]
    assert "kl_adapters/seq_kl" not in by_config["trl-default"]["trl"][-1]
    text = (tmp_path / f"task_{setting}_trl.txt").read_text()
    assert all(c in text for c in configs.split(",")) and (tmp_path / f"task_{setting}_trl.png").exists()
    score = "gold" if setting == "proxy" else "accuracy"
    assert score in runs[0]["history"][-1]["id"]


def test_long_design_judges_one_noise_level(tmp_path, monkeypatch):
    """bench/long_design.py at toy size: the reference is trained with the line's teacher noise (its own cache key),
    then scored in domain; the line states accuracy, the band, the mean length and the 256-token rule."""
    sys.path.insert(0, str(ROOT / "bench"))
    import long_design

    monkeypatch.setitem(long_design.SIZES, "small", {"hidden": 16, "steps": 2})
    monkeypatch.setattr(long_design, "PROMPTS", 4)
    monkeypatch.setattr(long_design, "MAX_NEW", 12)
    keys = {long_design.spec(noise, "small").key() for noise in arithmetic.LONG_NOISES}
    assert len(keys) == len(arithmetic.LONG_NOISES)
    line = long_design.judge(0.02, "small", tmp_path, say=lambda *_: None)
    assert line.startswith("noise 0.02 size small (hidden 16, 2 steps") and "outside the 20-60% band" in line
    assert "(< 256)" in line and "truncated at 12: " in line and "copy the column's operand digits" in line


def test_long_design_chooses_three_betas_from_the_design_policies(tmp_path, monkeypatch):
    """bench/long_design.py --betas at toy size (protocol step 3): trl-default trained through TRL for each design
    length, `kl-adapters measure` on each at the protocol's seven betas, then the three largest bias shares of the
    last policy, in increasing order."""
    sys.path.insert(0, str(ROOT / "bench"))
    import long_design

    from kl_adapters.demo.task import settings

    smoke = settings.SCALES["smoke"]
    monkeypatch.setitem(settings.SCALES, "cpu", settings.Scale(smoke.reference, smoke.rl, smoke.proxy,
                                                               long_reference=smoke.long_reference))
    monkeypatch.setattr(long_design, "BETA_STEPS", (1, 2))
    monkeypatch.setenv("KL_ADAPTERS_CACHE", str(tmp_path / "cache"))
    lines = long_design.choose_betas(tmp_path / "work", say=lambda *_: None, prompts=3, group=2)
    assert [line.split(" (")[0] for line in lines[:2]] == ["betas: trl-default after 1 steps",
                                                          "betas: trl-default after 2 steps"]
    assert all(f"beta {b} " in lines[1] for b in ("0.01", "0.02", "0.05", "0.1", "0.2", "0.5", "1"))
    # a toy policy's measurement has no estimates (zero reward): the choice is refused, not made up
    assert lines[2].startswith("no betas chosen: on the 2-step policy the measurement has no estimate at beta 0.01")
    assert long_design.pick_betas({0.01: 0.1, 0.02: 0.3, 0.05: 0.3, 0.1: 0.2, 1.0: 0.05}) == [0.02, 0.05, 0.1]
    with pytest.raises(ValueError, match="no estimate at beta 0.5"):
        long_design.pick_betas({0.05: 0.1, 0.5: None})
