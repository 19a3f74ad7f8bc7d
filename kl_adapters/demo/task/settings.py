"""What one task run is: the setting, the RL settings and the scale (model, prompts, steps), as plain data.

`SCALES` holds the scale option of bench/task.py (`--scale`): the same command runs a larger model, more prompts and
more steps where there is a GPU. "cpu" is the committed benchmark's scale (2 CPU cores); "quick" is `kl-adapters demo
--task` (a reference trained on the short splits only, 100 steps); "smoke" is CI's few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .proxy import ProxySpec
from .reference import ReferenceSpec

SETTINGS = ("short", "scratch", "proxy", "long")

#: the long-completion setting's reference (bench/results/task/confirmatory/protocol.md, steps 1-2): a Llama of 4
#: layers, 4 heads and 512 positions trained with batch 32 on the long splits (in / out of domain 0.7 / 0.3) with design
#: seed 300, at one of the protocol's sizes and one of `arithmetic.LONG_NOISES`; bench/long_design.py judges them
LONG_SIZES = {"small": {"hidden": 96, "steps": 4000}, "large": {"hidden": 128, "steps": 6000}}
LONG_MIXTURE = (("long", "id", 0.7), ("long", "ood", 0.3))
#: the design's choice (teacher noise, size): its first in-band line in design_long.txt (pinned by
#: tests/core/test_confirmatory_reference.py); None until the design lands one, and `long` is refused until then
LONG_DESIGN: tuple[float, str] | None = (0.02, "small")


def long_reference(noise: float, size: str) -> ReferenceSpec:
    """The long setting's reference at one teacher noise and size of the protocol's design."""
    return ReferenceSpec(layers=4, heads=4, max_positions=512, batch=32, seed=300, mixture=LONG_MIXTURE, noise=noise,
                         **LONG_SIZES[size])


@dataclass(frozen=True)
class RLSettings:
    """One RL run's hyper-parameters (every configuration of a comparison shares them)."""

    steps: int = 150
    prompts_per_step: int = 8  # distinct prompts per optimizer step
    group: int = 8  # completions per prompt (TRL's num_generations)
    learning_rate: float = 3e-4  # AdamW (TRL default: weight decay 0), decayed linearly to 0
    beta: float = 0.05  # the KL coefficient, in TRL's meaning (per token, relative to the task loss)
    lag: int = 1  # optimizer steps per generation (TRL's steps_per_generation): rollouts up to lag - 1 steps stale
    eval_every: int = 50
    eval_prompts: int = 512  # held-out prompts per split and evaluation (one completion each)

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group


@dataclass(frozen=True)
class Scale:
    reference: ReferenceSpec
    rl: RLSettings
    proxy: ProxySpec = ProxySpec()
    max_new_tokens: dict[str, int] = field(default_factory=lambda: {"short": 8, "scratch": 128, "long": 360})
    #: the long setting's own reference (None: not at this scale)
    long_reference: ReferenceSpec | None = None


SHORT_ONLY = (("short", "id", 0.7), ("short", "ood", 0.3))

SCALES: dict[str, Scale] = {
    "cpu": Scale(ReferenceSpec(), RLSettings(), long_reference=long_reference(*LONG_DESIGN) if LONG_DESIGN else None),
    "quick": Scale(ReferenceSpec(steps=3000, threads=2, mixture=SHORT_ONLY), RLSettings(steps=100, eval_prompts=256)),
    "smoke": Scale(ReferenceSpec(hidden=32, layers=2, steps=40, batch=32), RLSettings(steps=3, prompts_per_step=2,
                   group=4, eval_every=3, eval_prompts=16), ProxySpec(samples=64, hidden=16, layers=1, steps=5),
                   long_reference=ReferenceSpec(hidden=16, layers=1, steps=2, batch=4, max_positions=512,
                                                mixture=LONG_MIXTURE, noise=0.03)),
    "gpu": Scale(ReferenceSpec(hidden=256, layers=6, heads=8, steps=20_000, batch=256, learning_rate=1e-3, threads=8),
                 RLSettings(steps=500, prompts_per_step=32, group=8, learning_rate=3e-4, eval_prompts=2048)),
}
