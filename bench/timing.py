"""Benchmark helpers: median-of-repeats timing and result files that name the command, device and versions.

Numbers in bench/results/ come only from `write_result`, so every figure carries the command that produced it.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def measure(fn: Callable[[], object], *, repeats: int = 20, warmup: int = 3, sync: Callable[[], None] | None = None):
    """Run fn warmup+repeats times; return per-call seconds (median, min, max, all) of the timed repeats."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats,
            "times_s": times}


def write_result(name: str, data: dict) -> Path:
    """Write bench/results/<name>.json with the command line that produced it and the environment."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    root = RESULTS.parent.parent
    interpreter = Path(sys.executable)
    shown = interpreter.relative_to(root) if interpreter.is_relative_to(root) else interpreter.name
    from kl_adapters.demo.run import environment

    doc = {"command": " ".join(shlex.quote(str(a)) for a in [shown, *sys.argv]),
           "environment": environment(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
