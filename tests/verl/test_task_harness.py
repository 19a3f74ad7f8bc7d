"""The task benchmark through verl (bench/task.py --framework verl: bench/task_verl.py on
kl_adapters.demo.task.harness).

* the harness's lag bookkeeping: one generation round every `lag` steps, its rows shuffled and split over the next
  `lag` steps (staleness 0 .. lag - 1), the framework's rollout hook once per round, its metrics merged per step;
* advantages: the harness's are TRL's (r - mean) / (std + 1e-4) per prompt group; verl's (compute_advantage "grpo",
  std-normalised within each uid) agree to its epsilon;
* beta means TRL's (bench/task_verl.py): on a round of several prompt groups with prompts of different widths, the
  gradient of verl's ppo_loss is the token-mean task gradient plus grad kl_surrogate(preset, beta = rl.beta B / N_tok)
  (kl_surrogate's beta weighs the mean over the B sequences: rl.beta / N_tok times their sum), N_tok the batch's
  completion tokens (TRL's loss_type "dapo" with beta per token): k3 for verl-default, k1 per token
  for k3+, the sequence KL for kl_adapters:sequence-plain, and for kl_adapters:sequence the same with the inputs the
  adapter hands the core (the uid groups, the std-normalised advantages against kl_loss_coef, pi(EOS));
* a smoke run of every configuration through bench/task.py's main (smoke scale, 4 steps, lag 2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent / "bench"), str(TESTS)]

import task_verl  # noqa: E402
from task_checks import RL, grad, perturbed_round, relative, run_task_benchmark  # noqa: E402

from kl_adapters.demo.completions import logps_and_eos  # noqa: E402
from kl_adapters.demo.task import arithmetic, harness  # noqa: E402
from kl_adapters.demo.task.reference import EOS_ID  # noqa: E402
from kl_adapters.demo.task.settings import RLSettings  # noqa: E402


class Recorder:
    """A loss function that records what the harness hands it (zero gradient), and a rollout hook."""

    def __init__(self):
        self.batches, self.rounds, self.metrics = [], [], []

    def rollout(self, policy, reference, round_):
        self.rounds.append(round_)
        return round_

    def __call__(self, model, batch):
        self.batches.append(batch)
        self.metrics.append({"calls": float(len(self.batches))})
        return 0.0 * sum(p.sum() for p in model.parameters())


def test_lag_bookkeeping(tmp_path):
    """lag 2, 5 steps: rounds sampled at steps 0, 2, 4 (prompts_per_step x lag prompts, G rows each, consecutive);
    each round's rows shuffled and split into 2 disjoint halves consumed by the next 2 steps; staleness 0, 1, 0, 1, 0;
    evaluations at steps 0 and 5."""
    from kl_adapters.demo.task.driver import Prepared
    from kl_adapters.demo.task.reference import tokenizer
    from kl_adapters.tiny_models import tiny_llama

    tiny_llama(len(tokenizer()), hidden=16, layers=1, heads=2).save_pretrained(tmp_path)
    split = arithmetic.SPLITS["short"]
    prepared = Prepared("short", "short", tmp_path, None, arithmetic.draw(split["id"], 64, 0, test=False),
                        {part: arithmetic.draw(s, 4, 0, test=True) for part, s in split.items()}, 4, "accuracy")
    rl = RLSettings(steps=5, prompts_per_step=2, group=2, lag=2, eval_every=5, eval_prompts=4)
    recorder = Recorder()
    result = harness.run(prepared, recorder, rl, seed=0, rollout=recorder.rollout, metrics=recorder.metrics)

    assert [r["step"] for r in result["history"]] == [0, 5] and result["finite"]
    assert [r.sampled_at for r in recorder.rounds] == [0, 2, 4]
    for round_ in recorder.rounds:
        assert round_.mask.shape[0] == rl.prompts_per_step * rl.lag * rl.group
        assert round_.groups.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        prompts = round_.prompts[::rl.group]
        assert len({tuple(p.tolist()) for p in prompts}) == rl.prompts_per_step * rl.lag  # distinct prompts
    assert [b.sampled_at for b in recorder.batches] == [0, 0, 2, 2, 4]
    assert [s["staleness"] for s in result["steps"]] == [0, 1, 0, 1, 0]
    assert [s["calls"] for s in result["steps"]] == [1, 2, 3, 4, 5]
    for k, round_ in enumerate(recorder.rounds):
        halves = recorder.batches[2 * k:2 * k + 2]
        indices = [i for b in halves for i in b.index.tolist()]
        assert all(b.mask.shape[0] == rl.batch for b in halves)
        if len(halves) == 2:
            assert sorted(indices) == list(range(round_.mask.shape[0]))
        assert indices != sorted(indices) or k == 2  # shuffled (a fixed seed: not in order)
        for b in halves:
            assert torch.equal(b.tokens, round_.tokens[b.index]) and torch.equal(b.old_logp, round_.old_logp[b.index])
            assert torch.equal(b.groups, round_.groups[b.index])


def test_grpo_advantages_are_trls():
    """(r - mean) / (std + 1e-4) per group of consecutive rows, std with Bessel's correction (TRL's nanstd)."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = harness.grpo_advantages(r, 4)
    std = (3 * 0.25 ** 2 + 0.75 ** 2) / 3
    torch.testing.assert_close(a[:4], (r[:4] - 0.25) / (std ** 0.5 + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))


@pytest.fixture(scope="module")
def sampled():
    return perturbed_round()


def test_verl_advantages_agree_with_trls(sampled):
    """verl's GRPO advantages of the round (std + 1e-6) against the harness's (TRL's std + 1e-4)."""
    policy, reference, round_ = sampled
    assert round_.advantages.abs().sum() > 0
    ours = task_verl.TaskVerlLoss("beta=0", RL).rollout(policy, reference, round_).advantages
    torch.testing.assert_close(ours, round_.advantages, rtol=1e-3, atol=1e-6)


def expected_kl(policy, round_, preset: str):
    """grad kl_surrogate(preset, beta = rl.beta B / N_tok), i.e. rl.beta / N_tok times the sum over the B sequences;
    for "sequence" with what the adapter hands the core on verl's loss path (uid groups, TaskAdvantages(advantages, kl_loss_coef, normalized), pi(EOS))."""
    from kl_adapters import EndOfSequence, TaskAdvantages, kl_surrogate

    logp, prob, is_eos = logps_and_eos(policy, round_, EOS_ID)
    inputs = {}
    if preset == "sequence":
        inputs = {"group": round_.groups, "task": TaskAdvantages(round_.advantages, RL.beta, normalized=True),
                  "eos": EndOfSequence(prob, is_eos, round_.tokens.shape[1])}
    beta = RL.beta * round_.mask.shape[0] / round_.mask.sum()  # kl_surrogate's beta weighs the mean over sequences
    kl = kl_surrogate(logp, round_.ref_logp, round_.mask, preset=preset, beta=beta, **inputs)
    return grad(kl, policy)


@pytest.mark.parametrize("config, preset", [("verl-default", "k3-loss"), ("k3+", "token"),
                                            ("kl_adapters:sequence-plain", "sequence-plain"),
                                            ("kl_adapters:sequence", "sequence")])
def test_beta_means_trls(sampled, config, preset):
    policy, reference, round_ = sampled
    batch = task_verl.TaskVerlLoss("beta=0", RL).rollout(policy, reference, round_)
    task = grad(task_verl.TaskVerlLoss("beta=0", RL)(policy, batch), policy)
    logp, _, _ = logps_and_eos(policy, batch, EOS_ID)
    token_mean = -(batch.advantages[:, None] * logp).sum() / batch.mask.sum()  # on-policy: PPO's ratio is 1
    assert relative(task - grad(token_mean, policy), task) < 1e-4
    loss_fn = task_verl.TaskVerlLoss(config, RL)
    ours = grad(loss_fn(policy, batch), policy)
    expected = expected_kl(policy, batch, preset)
    assert relative(ours - task - expected, expected) < 1e-4
    assert loss_fn.metrics[0]["kl_coef"] == RL.beta
    if preset == "sequence":  # the reduced preset's inputs change the gradient: the adapter used them
        assert relative(expected_kl(policy, batch, "sequence-plain") - expected, expected) > 1e-3


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="verl configuration"):
        task_verl.TaskVerlLoss("kl_adapters:reward (reward path)", RL)


def test_smoke_run(tmp_path):
    """Every configuration through bench/task.py (in this process): evaluation rows, finite metrics, lag 2's
    staleness; verl's kl_coef = beta; kl-adapters' metrics exactly under its kl_loss_type."""
    configs = list(task_verl.CONFIGS)
    runs = run_task_benchmark("verl", configs, tmp_path / "out", tmp_path / "cache")
    for config, run in runs.items():
        adapter = config.startswith("kl_adapters:")
        assert all(("kl_adapters/seq_kl" in s and "kl_adapters/grad_weight_gap" in s) == adapter for s in run["steps"])
        assert all(s.get("kl_coef") == (None if config == "beta=0" else 0.05) for s in run["steps"])
        assert run["key"]["framework"] == "verl" and run["key"]["rl"]["lag"] == 2

