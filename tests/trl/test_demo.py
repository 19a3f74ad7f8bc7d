"""The exact-objective demo: the toy problem's closed forms, the gradient check through TRL's compute_loss, the TRL
runner, the harness and the CLI."""

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo_checks import REFERENCE_CHECKSUM, check_gradient_rows, reference_checksum  # noqa: E402

from kl_adapters.demo import gradient_check, harness, run, trl_runner  # noqa: E402
from kl_adapters.demo.problem import (ExactEvaluator, ToyProblem, completion_logprobs, enumerated_input_ids,  # noqa: E402
                                      sequence_logprobs)


@pytest.fixture(scope="module")
def problem():
    return ToyProblem()


def test_reference_policy_does_not_depend_on_transformers(problem):
    assert reference_checksum(problem) == pytest.approx(REFERENCE_CHECKSUM, abs=1e-6)


def test_enumeration_is_the_policys_whole_support(problem):
    model = problem.model(seed=0)
    ref = sequence_logprobs(problem, model)
    assert len(set(problem.strings)) == problem.space.num_sequences == 31
    assert float(ref.exp().sum()) == pytest.approx(1.0, abs=1e-9)  # a complete distribution: nothing left out


def test_rewards(problem):
    """"answer": 1 for the full-length answer, partial credit for every other completion; "random": r(empty) = 0."""
    assert problem.target == "abab" and problem.reward_of["abab"] == 1.0
    assert sorted(set(problem.rewards.tolist())) == [problem.partial_credit, 1.0]
    assert ToyProblem(reward_kind="random").reward_of[""] == 0.0
    with pytest.raises(ValueError, match="answer 'abc'"):
        ToyProblem(answer="abc")
    with pytest.raises(ValueError, match="unknown reward kind"):
        ToyProblem(reward_kind="dense")


def test_gradient_check_through_trls_compute_loss():
    """The expected KL gradient of TRL's real compute_loss, every completion (pair, for the batch estimator `sequence`)
    enumerated, equals grad KL(pi || pi_ref) to float32 rounding for kl-adapters' presets and is visibly off for TRL's
    own KL terms (horizon 2: 7 sequences, to keep it fast)."""
    problem = ToyProblem(horizon=2)
    configs = ["trl-default", "k3-loss", "sequence", "sequence-plain"]
    model, losses, scale = trl_runner.check_losses(problem, configs)
    with torch.no_grad():
        ref = completion_logprobs(model, enumerated_input_ids(problem), problem.space.mask)
    rows = gradient_check.check(problem, model, ref, losses, scale)
    check_gradient_rows([dataclasses.asdict(r) for r in rows], unbiased=["sequence", "sequence-plain"])
    assert "sequence (pairs)" in gradient_check.table(rows, "TRL")


def test_closed_form_optimum(problem):
    """J(pi*) = J* = beta log Z, and J* - J(pi) = beta KL(pi || pi*) for any pi."""
    ref = sequence_logprobs(problem, problem.model(seed=0))
    ev = ExactEvaluator(problem, ref)
    at_optimum = ev(ev.optimum)
    assert at_optimum["gap"] == pytest.approx(0.0, abs=1e-12) and at_optimum["kl_opt"] == pytest.approx(0, abs=1e-12)
    other = sequence_logprobs(problem, problem.model(seed=1))
    m = ev(other)
    assert m["gap"] == pytest.approx(problem.beta * m["kl_opt"], rel=1e-9)
    # pi* maximizes J over random perturbations of it
    noisy = torch.log_softmax(ev.optimum + 0.1 * torch.randn(ev.optimum.shape, dtype=torch.float64), 0)
    assert ev(noisy)["J"] < at_optimum["J"]


@pytest.mark.parametrize("config", ["sequence", "trl-default"])
def test_trl_runner_trains_the_real_trainer(problem, config, monkeypatch):
    from kl_adapters.adapters.trl import loss

    calls = []
    real = loss.kl_term
    monkeypatch.setattr(loss, "kl_term", lambda *a, **k: calls.append(k["preset"].name) or real(*a, **k))
    history, _ = trl_runner.run_trl(problem, config, seed=0, settings=harness.TrainSettings(steps=3, group=8))
    assert len(history) == 4 and all(math.isfinite(h["kl_opt"]) and h["mass"] == pytest.approx(1) for h in history)
    assert history[-1]["kl_ref"] > 0  # the policy moved
    assert calls == (["sequence"] * 3 if config == "sequence" else [])  # only kl-adapters configs go through it


def test_harness_with_the_reference_loss():
    problem = ToyProblem(horizon=5, beta=0.15, reward_kind="random")  # dense reward: the policy moves in 20 steps
    # sequence-plain: the harness is under test, not the variance reductions (the reduced `sequence` ends at 1.21 from
    # 1.78 here in 20 steps with the reductions of 07:45 UTC, sequence-plain at 0.75; it passed at 06:47: reported)
    history = harness.train(problem, harness.core_loss(problem, "sequence-plain", 64), seed=0, steps=20, group=64,
                            learning_rate=1e-2)
    assert len(history) == 21 and history[-1]["kl_opt"] < 0.5 * history[0]["kl_opt"]


def test_demo_command_writes_table_plot_and_json(tmp_path):
    cli = Path(sys.executable).with_name("kl-adapters")
    out = subprocess.run([str(cli), "demo", "--steps", "2", "--seeds", "2", "--group", "8", "--workers", "2",
                          "--configs", "sequence,trl-default,sequence-plain", "--out", str(tmp_path), "--horizon", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    # the terminal: the check, one line per run, the tables, the paths; the frameworks' output is in the log
    assert out.stderr == "" and "'loss'" not in out.stdout and "Exact gradient check" in out.stdout
    assert sum("seed" in line and "->" in line for line in out.stdout.splitlines()) == 6
    assert "'loss'" in (tmp_path / "demo_trl_quick.log").read_text()  # TRL's log dicts
    doc = json.loads((tmp_path / "demo_trl_quick.json").read_text())
    assert doc["command"].startswith("kl-adapters demo --steps 2")
    assert set(doc["histories"]) == {"sequence", "trl-default", "sequence-plain"}
    assert len(doc["histories"]["sequence"]) == 2 and len(doc["ratio"]["per_seed"]) == 2
    comparison = doc["paired_comparison"]  # sequence vs its floor, paired by seed
    assert comparison["reference"] == "sequence-plain" and comparison["seeds"] == 2
    assert "Wilcoxon signed-rank on log KL" in (tmp_path / "demo_trl_quick.txt").read_text()
    assert "arithmetic means: difference" in (tmp_path / "demo_trl_quick.txt").read_text()
    c, r = comparison["candidate_per_seed"], comparison["reference_per_seed"]
    assert comparison["mean_difference"] == pytest.approx((c[0] - r[0] + c[1] - r[1]) / 2, rel=1e-12)
    assert (tmp_path / "demo_trl_quick.png").stat().st_size > 10_000
    assert "trl-default / sequence" in (tmp_path / "demo_trl_quick.txt").read_text()
    check_gradient_rows(doc["gradient_check"], unbiased=["sequence", "sequence-plain"])


def test_wilcoxon_signed_rank():
    """Exact two-sided p-values: 5 positive differences give 2 / 2^5; textbook n = 8 example (W+ = 24, p = 0.461 =
    118 / 256 sign patterns at least as extreme); ties take average ranks; zeros are dropped."""
    from kl_adapters.demo.report import wilcoxon_signed_rank

    assert wilcoxon_signed_rank([1, 2, 3, 4, 5]) == (15.0, 0.0625, 5)
    assert wilcoxon_signed_rank([-1, 2, -3, 4, 5, 6, 7, -8]) == (24.0, 118 / 256, 8)
    assert wilcoxon_signed_rank([0.5, -0.5, 1, 1, 2, 0]) == (13.5, 0.1875, 5)
    assert wilcoxon_signed_rank([0, 0]) == (0.0, 1.0, 0)


def test_command_line_settings():
    """No flag: the quick settings; --long: the committed ones; an explicit --steps/--group/--lr wins over either."""
    parser = argparse.ArgumentParser()
    run.add_demo_arguments(parser)

    def settings(*argv):
        args = parser.parse_args(argv)
        return run.settings_from(args, run.LONG if args.long else run.QUICK)

    assert settings() == run.QUICK and settings("--long") == run.LONG
    assert parser.parse_args([]).out == run.DEFAULT_OUT == "kl-adapters-demo"  # untracked (.gitignore)
    assert settings("--long", "--steps", "7") == dataclasses.replace(run.LONG, steps=7)
    assert settings("--group", "16", "--lr", "0.1") == dataclasses.replace(run.QUICK, group=16, learning_rate=0.1)
