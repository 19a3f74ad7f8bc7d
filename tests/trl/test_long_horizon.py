"""The long-horizon benchmark (issue 22): the exact optimum against brute-force enumeration, the Markov reference, the
sampled evaluation against exact enumeration, TRL's GRPOTrainer training the problem, the gradient-variance
measurement, the report's statistics, and the benchmark's command line (a smoke run of seconds)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kl_adapters.audit import sequence_space
from kl_adapters.demo import long_horizon_report as report
from kl_adapters.demo.long_horizon_harness import LongSettings
from kl_adapters.demo.long_horizon_problem import (A_ID, CHARS, EOS_ID, VOCAB, LongHorizonProblem, evaluate, rewards,
                                                   sample, states)
from kl_adapters.demo.long_horizon_trl import gradient_variance, make_trainer, overrides, run_trl
from kl_adapters.demo.output import read_runs
from kl_adapters.demo.problem import completion_logprobs

ROOT = Path(__file__).resolve().parents[2]
TINY = LongSettings(steps=2, group=4, eval_every=1, eval_samples=32, final_samples=64)


@pytest.fixture(scope="module")
def problem():
    return LongHorizonProblem(horizon=5, seed=3)


def every_completion(problem):
    """([N, T] token ids, [N, T] mask) of every completion of at most T tokens (EOS ends one and counts as a token)."""
    space = sequence_space(VOCAB, problem.horizon)  # audit token v < V - 1 is CHARS[v], V - 1 is EOS
    tokens = torch.where(space.token == space.eos, EOS_ID, space.token + 1).masked_fill(~space.mask, EOS_ID)
    return tokens, space.mask


def input_ids(tokens):
    return torch.cat([torch.full_like(tokens[:, :1], A_ID), tokens], 1)


def test_reference_is_the_models_markov_chain():
    """Zero attention output projections: the logits at every position of any prefix are P_t(. | previous token)."""
    problem = LongHorizonProblem(horizon=16, seed=1)
    ids = torch.randint(0, VOCAB, (6, problem.horizon), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(problem.model()(input_ids=ids).logits.double(), -1)
    table = problem.reference[torch.arange(problem.horizon).expand_as(ids), ids]
    assert torch.allclose(logp, table, atol=1e-6)


def test_reference_calibration():
    """pi_ref(EOS) = eos_rate / T (up to the letters' small random logits) and P_ref(R = 1) = success_rate, exactly,
    at every horizon."""
    for horizon in (8, 64):
        problem = LongHorizonProblem(horizon=horizon)
        assert problem.reference_success == pytest.approx(problem.success_rate, abs=1e-6)
        eos = problem.reference[:, 1:, EOS_ID].exp()
        assert float(eos.mean()) == pytest.approx(problem.eos_rate / horizon, rel=0.2)


def test_optimum_matches_brute_force(problem):
    """log Z, J*, pi* and P_ref(R = 1) from the dynamic program equal their definitions over every completion:
    pi*(y) = pi_ref(y) exp(R(y) / beta) / Z, the product of the DP's conditionals along y."""
    tokens, mask = every_completion(problem)
    prev, flag = states(tokens)
    t = torch.arange(problem.horizon).expand_as(tokens)
    ref = torch.where(mask, problem.reference[t, prev, tokens], 0.0).sum(1)
    with torch.no_grad():
        model_ref = completion_logprobs(problem.model(), input_ids(tokens), mask, torch.float64).sum(1)
    assert torch.allclose(ref, model_ref, atol=1e-5)  # the table is the model's distribution
    assert float(ref.exp().sum()) == pytest.approx(1.0, abs=1e-12)  # every completion, nothing else
    text = ["".join(CHARS[v - 1] for v, m in zip(row, keep) if m and v != EOS_ID)
            for row, keep in zip(tokens.tolist(), mask.tolist())]
    r = rewards(tokens)
    assert r.tolist() == problem.reward(text) and set(r.tolist()) == {0.0, 1.0}
    log_z = torch.logsumexp(ref + r / problem.beta, 0)
    assert float(problem.log_z[0, A_ID, 0]) == pytest.approx(float(log_z), abs=1e-12)
    assert problem.j_star == pytest.approx(problem.beta * float(log_z), abs=1e-12)
    optimum = torch.where(mask, problem.log_optimum[t, prev, flag, tokens], 0.0).sum(1)
    assert torch.allclose(optimum, ref + r / problem.beta - log_z, atol=1e-12)
    assert problem.reference_success == pytest.approx(float((ref.exp() * r).sum()), abs=1e-12)
    assert problem.reference_gap == pytest.approx(problem.beta * float((ref.exp() * (ref - optimum)).sum()),
                                                  abs=1e-12)


def perturbed(problem, scale=0.3):
    """The problem's policy with random weights added everywhere (attention included): not Markov, pi != pi_ref."""
    model = problem.model()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def test_evaluation_matches_enumeration(problem):
    """The sampled, Rao-Blackwellized estimates of KL(pi || pi*), KL(pi || pi_ref) and E[R] of a non-Markov policy
    agree with their exact values over every completion within 4 standard errors."""
    model = perturbed(problem)
    tokens, mask = every_completion(problem)
    with torch.no_grad():
        logp = completion_logprobs(model, input_ids(tokens), mask, torch.float64).sum(1)
    prev, flag = states(tokens)
    t = torch.arange(problem.horizon).expand_as(tokens)
    p = logp.exp()
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-9)
    ref = torch.where(mask, problem.reference[t, prev, tokens], 0.0).sum(1)
    opt = torch.where(mask, problem.log_optimum[t, prev, flag, tokens], 0.0).sum(1)
    exact = {"kl_opt": float((p * (logp - opt)).sum()), "kl_ref": float((p * (logp - ref)).sum()),
             "reward": float((p * rewards(tokens)).sum())}
    est = evaluate(problem, sample(model, problem, 4000, torch.Generator().manual_seed(0)))
    for key, value in exact.items():
        assert abs(est[key] - value) < 4 * est[key + "_se"], (key, est[key], value)
    assert est["gap"] == pytest.approx(problem.beta * est["kl_opt"])
    assert est["J"] == pytest.approx(problem.j_star - est["gap"])


def test_grpo_trainer_trains_the_problem():
    """TRL's GRPOTrainer loads the problem's model as policy and reference (its reference is the problem's Markov
    chain) and train() runs, evaluated at every step."""
    problem = LongHorizonProblem(horizon=8)
    trainer = make_trainer(problem, "sequence-plain", TINY)
    ids = torch.arange(VOCAB)[:, None].expand(VOCAB, problem.horizon)
    with torch.no_grad():
        ref = torch.log_softmax(trainer.ref_model(input_ids=ids).logits.double(), -1).transpose(0, 1)
    assert torch.allclose(ref, problem.reference, atol=1e-6)
    out = run_trl(problem, "sequence-plain", TINY)
    assert [row["step"] for row in out["history"]] == [0, 1, 2]
    assert len(out["step_seconds"]) == 2 and len(out["trl"]) == 2
    assert out["history"][-1]["samples"] == TINY.final_samples


def test_configuration_names():
    assert overrides("sequence") == {"kl_preset": "sequence"}
    assert overrides("reward-plain+kl_is_clip=2.0") == {"kl_preset": "reward-plain", "kl_is_clip": 2.0}
    assert overrides("trl-default")["use_bias_correction_kl"] is True
    assert overrides("sequence+kl_discount=0.9") == {"kl_preset": "sequence", "kl_discount": 0.9}  # the dial
    with pytest.raises(ValueError, match="unknown configuration"):
        overrides("nope")
    with pytest.raises(ValueError, match="field=value"):
        overrides("sequence+kl_is_clip")


def test_gradient_variance_through_compute_loss():
    """On the same sampled groups, `token` through the adapter and TRL's own default KL term (k3 * pi/pi_old, whose
    on-policy gradient is the per-token k2 gradient) give the same training gradient; sequence-plain's differs."""
    problem = LongHorizonProblem(horizon=8)
    stats = gradient_variance(problem, perturbed(problem, 0.05), ["trl-default", "token", "sequence-plain"], 4, 3)
    native, token, plain = stats["trl-default"], stats["token"], stats["sequence-plain"]
    assert token["trace"] == pytest.approx(native["trace"], rel=1e-4)
    assert token["mean_norm"] == pytest.approx(native["mean_norm"], rel=1e-4)
    assert plain["mean_norm"] != pytest.approx(native["mean_norm"], rel=1e-2)
    assert all(math.isfinite(s["trace_se"]) and s["batches"] == 3 for s in stats.values())


def test_report_statistics():
    assert report.student_t_p(4.303, 2) == pytest.approx(0.05, abs=1e-4)
    assert report.student_t_p(2.0, 2) == pytest.approx(0.1835, abs=1e-4)
    assert report.student_t_p(1.96, 1000) == pytest.approx(0.0503, abs=1e-4)
    diff, p = report.paired_test([3.0, 4.0, 5.0], [1.0, 1.5, 2.5])
    assert diff == pytest.approx(2.333, abs=1e-3) and p < 0.05

    def run(config, seed, gap):
        return {"horizon": 32, "config": config, "seed": seed, "step_seconds": [0.1],
                "history": [{m: gap if m == "gap" else 0.0 for m in ("gap", "kl_opt", "reward", "kl_ref", "length")}
                            | {m + "_se": 0.0 for m in ("gap", "kl_opt", "reward", "kl_ref", "length")}]}
    runs = [run("trl-default", s, 0.05 + 0.001 * s) for s in range(3)] + [run("sequence", s, 0.01 + 0.002 * s)
                                                                         for s in range(3)]
    summary = report.summarize(runs)
    decided = report.decisions(summary, "trl-default", ["sequence"])[32]
    assert decided["best"] == "sequence" and decided["versus_best"]["trl-default"]["significant"]
    assert decided["ratio"]["per_seed"] == pytest.approx([5.0, 51 / 12, 52 / 14])
    assert "T = 32" in report.table(summary, {32: decided}, "title")
    # a configuration run on fewer seeds is tested against the best on the seeds both ran
    summary = report.summarize(runs + [run("full", s, 0.02 + 0.01 * s) for s in range(2)])
    decided = report.decisions(summary, "trl-default", ["sequence"])[32]
    diff, p = report.paired_test([0.02, 0.03], [0.01, 0.012])
    assert decided["versus_best"]["full"] == {"difference": diff, "p": p, "significant": p < 0.05, "seeds": [0, 1]}
    assert decided["versus_best"]["trl-default"]["seeds"] is None
    assert "seeds 0,1)" in report.table(summary, {32: decided}, "title")


def test_benchmark_command_line(tmp_path):
    """bench/long_horizon.py end to end at T = 8 (seconds), then again: the runs in the .jsonl.gz are not redone."""
    argv = [sys.executable, str(ROOT / "bench" / "long_horizon.py"), "--horizons", "8", "--configs",
            "trl-default,sequence-plain", "--seeds", "0", "--steps", "2", "--group", "4", "--eval-every", "1",
            "--eval-samples", "32", "--final-samples", "64", "--out", str(tmp_path)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[2/2] T=8 sequence-plain seed 0 step    2/2" in first.stdout
    runs = read_runs(tmp_path / "long_horizon_trl.jsonl.gz")
    assert [(r["config"], len(r["history"])) for r in runs] == [("trl-default", 3), ("sequence-plain", 3)]
    assert "T = 8" in (tmp_path / "long_horizon_trl.txt").read_text()
    assert (tmp_path / "long_horizon_trl.png").stat().st_size > 0
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 runs to do (2 already in" in again.stdout


def test_quick_variant_command_line(tmp_path, monkeypatch):
    """`kl-adapters demo --long-horizon` (= `bash scripts/demo.sh trl --long-horizon`) runs `QUICK` through TRL and
    writes its report; here with a tiny horizon and few steps (seconds)."""
    from kl_adapters.cli import main
    from kl_adapters.demo import long_horizon_run

    monkeypatch.setitem(long_horizon_run.QUICK, "horizons", [8])
    monkeypatch.setitem(long_horizon_run.QUICK, "settings", TINY)
    assert main(["demo", "--long-horizon", "--out", str(tmp_path)]) == 0
    runs = read_runs(tmp_path / "long_horizon_trl_quick.jsonl.gz")
    assert {(r["config"], r["seed"]) for r in runs} == {(c, s) for c in long_horizon_run.QUICK["configs"]
                                                      for s in long_horizon_run.QUICK["seeds"]}
    assert "T = 8" in (tmp_path / "long_horizon_trl_quick.txt").read_text()
