"""The KL budget controller (kl_adapters.budget): update rules, aggregation, fixed point, checkpoint state, bad input,
and the kl_target option of the activation syntax."""

import json
import math
import os

import pytest

from kl_adapters import activation
from kl_adapters.activation import Settings, parse
from kl_adapters.budget import RULES, KLBudget, check_budget_preset, check_target


def steps(budget: KLBudget, kls: list[float]) -> list[float]:
    """beta after each step of one observation of mean KL kl."""
    out = []
    for kl in kls:
        budget.observe(kl * 4, 4)
        out.append(budget.update())
    return out


def test_rules_follow_their_formulas():
    target, beta = 0.5, 0.1
    kls = [0.0, 0.2, 1.5, 0.7, 0.5]
    errors = [k / target - 1 for k in kls]
    # dual ascent on log beta
    expected, b = [], beta
    for e in errors:
        b *= math.exp(0.02 * e)
        expected.append(b)
    assert steps(KLBudget(target, beta, rule="dual"), kls) == pytest.approx(expected, rel=1e-14)
    # PI: the proportional term acts on the change of the error (0 at the first step)
    expected, b, prev = [], beta, errors[0]
    for e in errors:
        b *= math.exp(0.02 * e + 0.5 * (e - prev))
        expected.append(b)
        prev = e
    assert steps(KLBudget(target, beta), kls) == pytest.approx(expected, rel=1e-14)
    # Ziegler et al.: relative error clipped at +-0.2, multiplicative step 1 + k e
    expected, b = [], beta
    for e in errors:
        b *= 1 + 0.1 * min(max(e, -0.2), 0.2)
        expected.append(b)
    assert steps(KLBudget(target, beta, rule="ziegler"), kls) == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("rule", list(RULES))
def test_scale_free(rule):
    """The same relative errors give the same relative betas whatever the units of beta and of the target."""
    kls = [0.0, 0.3, 2.0, 1.1, 0.9, 1.0]
    a = steps(KLBudget(1.0, 0.2, rule=rule), kls)
    b = steps(KLBudget(250.0, 7e-4, rule=rule), [k * 250.0 for k in kls])
    assert [x / 0.2 for x in a] == pytest.approx([x / 7e-4 for x in b], rel=1e-12)


def test_step_estimate_is_the_mean_over_all_observed_sequences():
    """Micro-batches and ranks add (sum, count); the step's estimate is sum / count, then the pending sums reset."""
    budget = KLBudget(1.0, 1.0, rule="dual", gains={"k_i": 1.0})
    budget.observe(3.0, 2)  # two sequences, KL 1.5 each on average
    budget.observe(0.0, 0)  # an empty micro-batch
    budget.observe(1.0, 2)  # mean 0.5
    budget.update()
    assert budget.kl == pytest.approx(1.0) and budget.beta == pytest.approx(1.0)
    assert budget.update() == budget.beta and budget.steps == 1  # nothing observed: unchanged, not a step


@pytest.mark.parametrize("rule", list(RULES))
def test_fixed_point_is_the_target(rule):
    """A plant with the demo problem's shape: the policy's log KL relaxes towards log KL*(beta) = log(target) - 3.8
    log(beta / beta*) (its slope at beta* = 0.2) with a lag of 20 steps. Every rule settles at beta* from 10x below and
    10x above."""
    for start in (0.02, 2.0):
        budget, log_kl = KLBudget(0.6, start, rule=rule), math.log(0.6)
        for _ in range(3000):
            budget.observe(math.exp(log_kl), 1)
            budget.update()
            log_kl += (math.log(0.6) - 3.8 * math.log(budget.beta / 0.2) - log_kl) / 20
        assert budget.beta == pytest.approx(0.2, rel=1e-3) and budget.kl == pytest.approx(0.6, rel=4e-3)


def test_slack_budget_sends_beta_to_zero():
    budget = KLBudget(1.0, 0.5)
    for _ in range(500):
        budget.observe(0.2, 1)  # the constraint never binds
        budget.update()
    assert 0 < budget.beta < 1e-3


@pytest.mark.parametrize("rule", list(RULES))
def test_state_round_trip_continues_the_same_run(rule):
    kls = [0.1, 0.9, 1.4, 0.8, 1.05, 0.97, 1.0]
    whole = KLBudget(1.0, 0.3, rule=rule)
    expected = steps(whole, kls)
    first = KLBudget(1.0, 0.3, rule=rule)
    steps(first, kls[:3])
    first.observe(5.0, 1)  # an unfinished step is not part of a checkpoint
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores: JSON
    resumed = KLBudget(1.0, 0.3, rule=rule)
    resumed.load_state_dict(state)
    assert resumed.steps == 3 and resumed.beta == first.beta
    assert steps(resumed, kls[3:]) == expected[3:]


def test_resume_keeps_the_configured_target_and_rule():
    done = KLBudget(1.0, 0.3)
    steps(done, [2.0, 1.5])
    resumed = KLBudget(2.0, 0.3, rule="dual")  # the resumed run changed its budget and rule
    resumed.load_state_dict(done.state_dict())
    assert resumed.beta == done.beta and resumed.target == 2.0 and resumed.rule == "dual" and resumed.error is None
    with pytest.raises(ValueError, match="version"):
        resumed.load_state_dict({**done.state_dict(), "version": 99})
    with pytest.raises(ValueError, match="beta"):
        resumed.load_state_dict({**done.state_dict(), "beta": 0.0})


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf"), True, "1", None])
def test_bad_targets_are_refused(value):
    with pytest.raises(ValueError, match="kl_target must be a finite number > 0"):
        check_target(value)


@pytest.mark.parametrize("kwargs, message", [
    ({"beta": 0.0}, "starts from the configured beta"),
    ({"beta": float("inf")}, "starts from the configured beta"),
    ({"rule": "pid"}, "unknown KL budget rule"),
    ({"gains": {"k": 0.1}}, "has no gain"),
    ({"gains": {"k_i": -1.0}}, "gain k_i must be"),
])
def test_bad_controller_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KLBudget(**{"target": 1.0, "beta": 0.1, **kwargs})


def test_non_finite_observation_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        KLBudget(1.0, 0.1).observe(float("nan"), 3)


@pytest.mark.parametrize("preset", ["sequence", "sequence-plain", "reward", "reward-plain", "reward-sum", "full"])
def test_presets_unbiased_for_the_sequence_kl_take_a_budget(preset):
    check_budget_preset(preset, None)


@pytest.mark.parametrize("preset", ["token", "k1-loss", "k2-loss", "k3-loss", "k3-reward"])
def test_biased_presets_are_refused(preset):
    with pytest.raises(ValueError, match="does not follow its gradient"):
        check_budget_preset(preset, None)


def test_on_policy_presets_are_refused_off_policy_and_is_clip_everywhere():
    check_budget_preset("sequence", None, off_policy=True)
    with pytest.raises(ValueError, match="off-policy"):
        check_budget_preset("reward", None, off_policy=True)
    with pytest.raises(ValueError, match="is_clip"):
        check_budget_preset("sequence", 5.0)


def test_activation_syntax_carries_the_target():
    assert parse("sequence:kl_target=2.5") == Settings("sequence", None, 2.5)
    settings = Settings("reward", None, 0.125)
    assert parse(str(settings)) == settings and str(settings) == "reward:kl_target=0.125"
    assert str(Settings("sequence")) == "sequence"  # unchanged without options


@pytest.mark.parametrize("value, message", [
    ("sequence:kl_target=-1", "kl_target must be a finite number > 0"),
    ("sequence:kl_target=nan", "kl_target must be a finite number > 0"),
    ("sequence:kl_target=abc", "option kl_target needs a number"),
    ("token:kl_target=1", "does not follow its gradient"),
    ("sequence:is_clip=3,kl_target=1", "is_clip"),
])
def test_activation_refuses_bad_budgets(value, message):
    with pytest.raises(ValueError, match=message):
        parse(value)


def test_enable_exports_the_budget(monkeypatch):
    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    try:
        settings = activation.enable("sequence", kl_target=1.5)
        assert settings.kl_target == 1.5 and activation.active() == settings
        assert os.environ[activation.ENV_VAR] == "sequence:kl_target=1.5"
    finally:
        activation.disable()


def test_metrics_names():
    assert KLBudget(0.5, 0.1).metrics() == {"kl_adapters/beta": 0.1, "kl_adapters/kl_target": 0.5}
