"""The task: addition, with an exact verifier, in two answer formats, from a seeded generator (no downloads).

A prompt is ``"<a>+<b>"`` followed by the format's marker; both operands have the same number of digits d.

* ``short`` (marker ``=``): the completion is the sum, e.g. ``"47+85="`` -> ``"132"`` (at most d + 1 tokens).
* ``scratch`` (marker ``:``): a worked scratchpad, one step per digit from the least significant, ``x+y+c=s``
  (digits x, y, carry-in c, column sum s), steps joined by ``;``, then ``|`` and the sum read off the steps:
  ``"47+85:"`` -> ``"7+5+0=12;4+8+1=13|132"`` (about 8.5 d + d + 2 tokens: 64-256 at the digit counts used).

The verifier (`reward`) is 1 when the answer (the text after the last ``|``, or the whole short completion) equals
str(a + b), else 0.

**Teacher noise.** The reference is trained (`reference.py`) on completions from a noisy teacher, so that it has real
but imperfect skill, as a pretrained model does: the teacher knows the algorithm and slips at a fixed rate.
  * ``short``: with probability ``noise`` one digit of the sum is off by one (mod 10).
  * ``scratch``: each step independently, with probability ``noise``, writes s +- 1 instead of s (clamped to 0..19,
    so a slip at a column sum of 0 or 19 may leave it as it was); the carry of the next step and the answer are read
    from what was written, so a slip propagates as a careful student's would. The teacher's accuracy is about
    (1 - noise)^d.

**Splits.** Every (a, b) pair belongs to the train half or the test half by a hash (`is_test_pair`), so no test
prompt is ever trained on (reference or RL). A `Split` is a format, the digit counts it draws and the teacher noise
of its training data; `SPLITS` names the in-domain (RL prompts and their held-out test) and out-of-domain (longer
operands, never an RL prompt) split of each format.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

CHARS = "0123456789+=:;|"
MARKERS = {"short": "=", "scratch": ":"}
FORMATS = tuple(MARKERS)


@dataclass(frozen=True)
class Split:
    """Problems of one format with operands of `digits` digits (drawn uniformly), and the teacher's slip rate."""

    name: str
    format: str
    digits: tuple[int, ...]
    noise: float

    def __post_init__(self):
        if self.format not in MARKERS:
            raise ValueError(f"unknown format {self.format!r}; valid: {', '.join(FORMATS)}")


#: the in-domain ("id") and out-of-domain ("ood") split of each format
SPLITS: dict[str, dict[str, Split]] = {
    "short": {"id": Split("short-id", "short", (1, 2, 3), 0.6), "ood": Split("short-ood", "short", (4,), 0.75)},
    "scratch": {"id": Split("scratch-id", "scratch", (6, 7, 8), 0.12),
                "ood": Split("scratch-ood", "scratch", (9, 10), 0.12)},
    # the confirmatory re-test's long completions (bench/results/task/confirmatory/protocol.md): about 9.5 d + 2
    # tokens, 268 in domain; its teacher noise is chosen by the protocol's design (one of LONG_NOISES), so a
    # reference of this setting names it (`reference.ReferenceSpec.noise`); the value here is the first candidate
    "long": {"id": Split("long-id", "scratch", (26, 28, 30), 0.03),
             "ood": Split("long-ood", "scratch", (34, 36), 0.03)},
}
#: the long setting's teacher slip rates, in the order the protocol's design step 1 tries them
LONG_NOISES = (0.03, 0.02, 0.015, 0.01)


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # the correct sum


def is_test_pair(a: int, b: int) -> bool:
    """One pair in five is held out for testing (a fixed hash, the same on every machine)."""
    return hashlib.blake2b(f"{a}+{b}".encode(), digest_size=2).digest()[0] % 5 == 0


def draw(split: Split, n: int, seed: int, *, test: bool) -> list[Example]:
    """n problems of the split from the train or test half, seeded by (split, seed)."""
    rng = random.Random(f"{split.name}/{seed}/{'test' if test else 'train'}")
    out = []
    while len(out) < n:
        d = rng.choice(split.digits)
        low = 10 ** (d - 1) if d > 1 else 0
        a, b = rng.randint(low, 10**d - 1), rng.randint(low, 10**d - 1)
        if is_test_pair(a, b) == test:
            out.append(Example(f"{a}+{b}{MARKERS[split.format]}", str(a + b)))
    return out


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt[:-1].split("+")
    return int(a), int(b)


def solution(prompt: str, noise: float = 0.0, rng: random.Random | None = None) -> str:
    """The teacher's completion of a prompt (without EOS): exact when noise = 0, else with the module's slips."""
    a, b = operands(prompt)
    slip = (lambda: rng.random() < noise) if noise > 0 else (lambda: False)
    if prompt.endswith(MARKERS["short"]):
        s = str(a + b)
        if slip():
            i = rng.randrange(len(s))
            s = (s[:i] + str((int(s[i]) + rng.choice((-1, 1))) % 10) + s[i + 1:]).lstrip("0") or "0"
        return s
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry, steps, written = 0, [], []
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        if slip():
            s = min(19, max(0, s + rng.choice((-1, 1))))
        steps.append(f"{x}+{y}+{carry}={s}")
        written.append(s % 10)
        carry = s // 10
    return ";".join(steps) + "|" + (str(carry) if carry else "") + "".join(map(str, reversed(written)))


def scratch_steps(prompt: str, completion: str) -> tuple[int, int, int]:
    """Where a scratchpad goes wrong: (steps written, steps whose x and y are the prompt's digits of that column,
    steps whose s is x + y + c as written). Parsing stops at the first step that is not ``x+y+c=s``; a step past the
    operands' length has no right digits. Design diagnostics only (bench/long_design.py); the reward is `reward`."""
    a, b = operands(prompt)
    xs, ys = str(a)[::-1], str(b)[::-1]
    written = copied = summed = 0
    for i, step in enumerate(completion.split("|", 1)[0].split(";")):
        lhs, _, rhs = step.partition("=")
        terms = lhs.split("+")
        if len(terms) != 3 or not all(t.isdigit() for t in (*terms, rhs)):
            break
        x, y, c = map(int, terms)
        written += 1
        copied += i < min(len(xs), len(ys)) and (x, y) == (int(xs[i]), int(ys[i]))
        summed += int(rhs) == x + y + c
    return written, copied, summed


def answer_of(completion: str) -> str:
    """The answer part of a completion: after the last "|" (scratch), or all of it (short)."""
    return completion.rsplit("|", 1)[-1]


def reward(completion: str, answer: str) -> float:
    """The verifier: 1.0 when the completion's answer is exactly the sum, else 0.0."""
    return float(answer_of(completion) == answer)
