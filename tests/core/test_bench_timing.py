"""bench/timing.py: the paired comparison of two configurations and the bootstrap interval of its median ratio."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import timing  # noqa: E402


def test_compare_reports_the_paired_ratio_and_an_interval_around_it():
    base = [1.0 + 0.01 * (i % 7) for i in range(60)]
    times = {"a": base, "b": [1.02 * t for t in base]}
    result = timing.compare(times, "a", "b")
    assert result["median_paired_ratio"] == pytest.approx(1.02)
    assert result["paired_ratio_ci95"] == pytest.approx([1.02, 1.02])  # every round's ratio is 1.02


def test_median_interval_covers_the_median_and_is_reproducible():
    values = [0.9 + 0.2 * ((37 * i) % 101) / 100 for i in range(101)]
    lo, hi = timing.median_interval(values)
    assert lo < 1.0 < hi and hi - lo < 0.1
    assert timing.median_interval(values) == [lo, hi]
