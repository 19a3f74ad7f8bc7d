"""The task benchmark's generator, teacher and verifier (kl_adapters.demo.task.arithmetic): pure Python, no model."""

import random

import pytest

from kl_adapters.demo.task import arithmetic
from kl_adapters.demo.task.arithmetic import SPLITS, Split, answer_of, draw, reward, scratch_steps, solution


@pytest.mark.parametrize("fmt", arithmetic.FORMATS)
def test_the_exact_teacher_is_always_right(fmt):
    for example in draw(SPLITS[fmt]["id"], 200, seed=0, test=False) + draw(SPLITS[fmt]["ood"], 200, 0, test=True):
        assert reward(solution(example.prompt), example.answer) == 1.0


def test_the_scratchpad_format():
    assert solution("47+85:") == "7+5+0=12;4+8+1=13|132"
    assert solution("5+4:") == "5+4+0=9|9"
    assert solution("47+85=") == "132"
    assert answer_of("7+5+0=12;4+8+1=13|132") == "132" and answer_of("132") == "132"


@pytest.mark.parametrize("fmt", arithmetic.FORMATS)
def test_a_slip_is_always_wrong_and_the_teacher_accuracy_is_as_documented(fmt):
    """short: accuracy 1 - noise (a slip changes one digit); scratch: about (1 - noise)^d (a slip changes the written
    column sum, except where clamping to 0..19 leaves a sum of 0 or 19 as it was)."""
    split = Split("t", fmt, (3,), 0.3)
    rng = random.Random(0)
    examples = draw(split, 4000, seed=1, test=False)
    accuracy = sum(reward(solution(e.prompt, split.noise, rng), e.answer) for e in examples) / len(examples)
    expected = 0.7 if fmt == "short" else 0.7**3
    assert abs(accuracy - expected) < 0.03
    always_slip = Split("t", fmt, (3,), 1.0)
    assert all(reward(solution(e.prompt, 1.0, rng), e.answer) == 0.0 for e in draw(always_slip, 300, 2, test=False))


def test_splits_are_disjoint_deterministic_and_sized():
    split = SPLITS["short"]["id"]
    train, test = draw(split, 3000, seed=0, test=False), draw(split, 500, seed=0, test=True)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert draw(split, 50, seed=0, test=True) == test[:50]
    assert {len(e.prompt.split("+")[0]) for e in draw(SPLITS["scratch"]["ood"], 200, 0, test=True)} == {9, 10}
    assert all(e.prompt.endswith(":") for e in draw(SPLITS["scratch"]["id"], 20, 0, test=False))


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown format"):
        Split("x", "long", (1,), 0.1)


def test_the_long_setting_is_a_scratchpad_of_the_registered_digits():
    """bench/results/task/confirmatory/protocol.md: in domain 26, 28 or 30 digits per operand, out of domain 34 or 36,
    the scratchpad format; about 9.5 d + 2 characters per exact completion."""
    long = SPLITS["long"]
    assert {len(e.prompt.split("+")[0]) for e in draw(long["id"], 300, 0, test=True)} == {26, 28, 30}
    assert {len(e.prompt.split("+")[0]) for e in draw(long["ood"], 200, 0, test=True)} == {34, 36}
    assert all(s.format == "scratch" for s in long.values())
    examples = draw(long["id"], 300, 0, test=True)
    mean = sum(len(solution(e.prompt)) for e in examples) / len(examples)
    assert 9.5 * 28 + 2 - 5 < mean < 9.5 * 28 + 2 + 5


def test_scratch_steps_locate_the_first_kind_of_error():
    """A step with a wrong operand digit counts against copying, one with a wrong sum against summing; parsing stops
    at the first malformed step."""
    assert scratch_steps("47+85:", "7+5+0=12;4+8+1=13|132") == (2, 2, 2)
    assert scratch_steps("47+85:", "7+5+0=12;3+8+1=12|122") == (2, 1, 2)
    assert scratch_steps("47+85:", "7+5+0=11;4+8+1=13|131") == (2, 2, 1)
    assert scratch_steps("47+85:", "7+5+0=12;4+8|") == (1, 1, 1)
    assert scratch_steps("47+85:", "7+5+0=12;4+8+1=13;1+1+0=2|") == (3, 2, 3)
