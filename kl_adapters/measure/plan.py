"""What one measurement computes: the configurations judged, the presets compared, the length bins, the quantities.

A configuration's KL gradient on a batch is sum_t c_t grad log pi(y_t) with its preset's weight c (`kl_adapters.native`
says which preset a framework's own setting equals: one table for the adapters, the doctor and this command). The
exact reference is `REFERENCE` (= `sequence` with its statistics fitted to the KL term alone: unbiased for grad KL_seq
on- and off-policy, with the variance reductions that make differences from it less noisy). The quantities whose
per-fold means are measured (`quantities`):

    exact@b    the reference's gradient from the completions of length bin b     (their sum: E = the exact estimate)
    judged@b   the judged configuration minus the reference, in bin b            (their sum: D_judged)
    diff:p     every other compared preset p minus the reference                 (D_p)
    task       GRPO's task-loss gradient -A_j sum_t rho_t grad log pi (with a reward)

so that every configuration's bias E[D_p] costs one backward, and the judged one's split by length two per bin.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..native import NAMED, NativeKL, by_name
from ..presets import SAMPLED_TOKEN_PRESETS, Preset

#: the exact estimator every configuration is compared with (its statistics fitted to the KL term alone)
REFERENCE = SAMPLED_TOKEN_PRESETS["sequence"]


class PlanError(ValueError):
    """A measurement that cannot be planned (unknown configuration, one with no per-token weight): one line."""


@dataclass(frozen=True)
class Configuration:
    """A configuration to judge: its name, the preset with its gradient, why, where it was read."""

    name: str
    preset: str
    reason: str
    source: str


def configuration(name: str) -> Configuration:
    """A configuration by name: a preset's own name, or a native name of `kl_adapters.native.NAMED`."""
    if name in SAMPLED_TOKEN_PRESETS:
        return Configuration(name, name, SAMPLED_TOKEN_PRESETS[name].gradient, "kl_adapters/presets.py")
    native = by_name(name)
    if native is None:
        known = [*NAMED, *SAMPLED_TOKEN_PRESETS]
        close = difflib.get_close_matches(name, [n for n in known if "<" not in n], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PlanError(f"unknown configuration {name!r}{hint}; give a preset ({', '.join(SAMPLED_TOKEN_PRESETS)}) or "
                        f"one of {', '.join(NAMED)}")
    return of_native(name, native)


def of_native(name: str, native: NativeKL) -> Configuration:
    """A native setting as a configuration; PlanError when no preset has its gradient (nothing to compute it with)."""
    if native.preset is None or native.preset not in SAMPLED_TOKEN_PRESETS:
        raise PlanError(f"configuration {name!r} cannot be measured: {native.reason} [{native.source}]"
                        + ("" if native.preset is None else f" (preset {native.preset!r} needs full logits)"))
    return Configuration(name, native.preset, native.reason, native.source)


def length_bins(lengths: Tensor, edges: tuple[int, ...] | int) -> tuple[tuple[int, int], ...]:
    """[low, high) completion-length bins: `edges` given (ascending inner edges), or that many bins at the lengths'
    quantiles (fewer where lengths tie); the last bin ends after the longest completion."""
    top = int(lengths.max()) + 1
    if isinstance(edges, int):
        q = torch.quantile(lengths.to(torch.float64).flatten(), torch.linspace(0, 1, edges + 1, dtype=torch.float64))
        inner = sorted({int(torch.ceil(x)) for x in q[1:-1]} - {0})
    else:
        inner = list(edges)
    cuts = [1, *[e for e in inner if 1 < e < top], top]
    return tuple((lo, hi) for lo, hi in zip(cuts, cuts[1:]) if lo < hi)


@dataclass(frozen=True)
class Plan:
    """The configurations judged (the first gets the length split), the KL coefficient, the task's advantages."""

    judged: tuple[Configuration, ...]
    beta: float
    bins: tuple[tuple[int, int], ...]
    scale_rewards: bool = True
    with_task: bool = False
    reference: Preset = REFERENCE
    presets: dict[str, Preset] = field(default_factory=lambda: dict(SAMPLED_TOKEN_PRESETS))

    def __post_init__(self):
        if not self.judged:
            raise PlanError("nothing to judge: give at least one configuration")
        if not self.beta > 0:
            raise PlanError(f"beta must be > 0 (the KL coefficient), got {self.beta}")

    @property
    def compared(self) -> tuple[str, ...]:
        """Every sampled-token preset (each configuration's preset is one of them)."""
        return tuple(self.presets)

    @property
    def split(self) -> str:
        """The preset whose difference from the reference is split by completion length (the first judged)."""
        return self.judged[0].preset

    @property
    def quantities(self) -> tuple[str, ...]:
        names = [f"exact@{b}" for b in range(len(self.bins))] + [f"judged@{b}" for b in range(len(self.bins))]
        names += [f"diff:{p}" for p in self.compared if p != self.split]
        return tuple(names + (["task"] if self.with_task else []))

    def weights(self, *parts: str) -> Tensor:
        """The [Q] weight vector of a sum of named parts: "exact", "exact@b", "diff:<preset>", "diff@b", "task"."""
        index = {q: i for i, q in enumerate(self.quantities)}
        w = torch.zeros(len(index), dtype=torch.float64)
        for part in parts:
            if part == "exact":
                names = [f"exact@{b}" for b in range(len(self.bins))]
            elif part == f"diff:{self.split}":
                names = [f"judged@{b}" for b in range(len(self.bins))]
            elif part.startswith("diff@"):
                names = [f"judged@{part[5:]}"]
            else:
                names = [part]
            for n in names:
                w[index[n]] += 1.0
        return w
