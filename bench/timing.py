"""Benchmark helpers: median-of-repeats timing and result files that name the command, device and versions.

Numbers in bench/results/ come only from `write_result`, so every figure carries the command that produced it.
"""

from __future__ import annotations

import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def alternating(fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 3,
                sync: Callable[[], None] | None = None,
                before: Callable[[str, int], None] | None = None) -> dict[str, list[float]]:
    """Per-call seconds of each configuration: one call of each per round, in ABBA order, so that drift in machine load
    hits every configuration alike. `before(config, round)` runs untimed before each call (switching a flag, seeding
    the sampler); the first `warmup` rounds are not kept."""
    configs, times = list(fns), {c: [] for c in fns}
    for i in range(warmup + repeats):
        for config in configs if i % 2 == 0 else configs[::-1]:
            if before:
                before(config, i)
            if sync:
                sync()
            t0 = time.perf_counter()
            fns[config]()
            if sync:
                sync()
            if i >= warmup:
                times[config].append(time.perf_counter() - t0)
    return times


def compare(times: dict[str, list[float]], baseline: str, candidate: str) -> dict:
    """Median per configuration, the ratio of the medians (candidate / baseline), the median of the per-round
    ratios and its 95% bootstrap interval (`median_interval`: "within noise" = it contains 1); every timing is kept."""
    med = {c: statistics.median(t) for c, t in times.items()}
    rounds = [b / a for a, b in zip(times[baseline], times[candidate])]
    return {"median_s": med, "n": {c: len(t) for c, t in times.items()}, "ratio": med[candidate] / med[baseline],
            "median_paired_ratio": statistics.median(rounds), "paired_ratio_ci95": median_interval(rounds),
            "times_s": times}


def median_interval(values: list[float], resamples: int = 4000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the median of `values` (resampled with replacement, seeded)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def write_result(name: str, data: dict) -> Path:
    """Write bench/results/<name>.json with the command line that produced it and the environment."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    root = RESULTS.parent.parent
    interpreter = Path(sys.executable)
    shown = interpreter.relative_to(root) if interpreter.is_relative_to(root) else interpreter.name
    from kl_adapters.demo.output import environment

    doc = {"command": " ".join(shlex.quote(str(a)) for a in [shown, *sys.argv]),
           "environment": environment(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def write_result_and_table(name: str, data: dict, text: str) -> Path:
    """`write_result`, and bench/results/<name>.txt: the same command line ("$ ...") followed by the printed table."""
    path = write_result(name, data)
    path.with_suffix(".txt").write_text(f"$ {json.loads(path.read_text())['command']}\n{text}\n")
    return path
