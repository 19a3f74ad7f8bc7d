"""The coverage table (bench/coverage.py -> bench/results/coverage*.json, docs/coverage.md): every test a row names,
and every test bench/coverage.py maps a KL path or a feature to, exists in tests/ (its file, and a function of that
name in it); each table's per-framework counts are its rows'."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLES = sorted((ROOT / "bench" / "results").glob("coverage*.json"))


def _bench():
    spec = importlib.util.spec_from_file_location("coverage_bench", ROOT / "bench" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exists(node: str) -> bool:
    """Whether `path::function` names a test function defined in that file."""
    path, _, name = node.partition("::")
    file = ROOT / path
    return file.is_file() and re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M) is not None


def test_there_is_a_table():
    assert [p.name for p in TABLES if p.name == "coverage.json"]


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_every_named_test_exists(table):
    rows = json.loads(table.read_text())["rows"]
    named = {t for r in rows for t in r.get("tests", [])}
    assert named, "the table names no test"
    assert [t for t in sorted(named) if not exists(t)] == []


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_counts_are_the_rows(table):
    doc = json.loads(table.read_text())
    with_kl = [r for r in doc["rows"] if r["before"] not in ("no-kl", "unreadable")]
    for framework, counts in doc["coverage"].items():
        rows = [r for r in with_kl if r["framework"] == framework]
        assert counts == {"kl": len(rows), "accepted": sum(bool(r.get("accepted")) for r in rows),
                          "tested": sum(bool(r.get("tested")) for r in rows)}
        assert all(r["tests"] for r in rows if r.get("tested"))


def test_the_benchs_mappings_name_existing_tests():
    bench = _bench()
    mapped = {t for t in [*bench.PATH_TESTS.values(), *bench.TESTED.values()] if t}
    assert [t for t in sorted(mapped) if not exists(t)] == []


def test_the_settings_are_the_support_matrixs():
    """Every feature bench/coverage.py maps to a setting names one of the support matrix (kl_adapters.support), and a
    feature has a test exactly where the matrix calls its setting tested (the matrix is the one source)."""
    from kl_adapters import support

    bench = _bench()
    for (framework, *_), key in bench.SETTING.items():
        assert (framework, key) in support.MATRIX
    for feature, key in bench.SETTING.items():
        e = support.entry(feature[0], key)
        assert bench.TESTED.get(feature) == (e.test if e.status == support.TESTED else None)


def test_judging_the_rows_again_gives_their_verdicts():
    """The committed table's accepted / tested / untested / tests are what `judge` gives its collected facts with
    today's mappings: moving them into the support matrix changed no number (bench/results/coverage.json; the "before"
    table was judged with the mappings of the commit that made it)."""
    bench = _bench()
    for r in json.loads((ROOT / "bench" / "results" / "coverage.json").read_text())["rows"]:
        again = bench.judge({k: v for k, v in r.items() if k not in ("accepted", "tests", "untested", "tested")})
        assert {k: again.get(k) for k in ("accepted", "tests", "untested", "tested")} == {
            k: r.get(k) for k in ("accepted", "tests", "untested", "tested")}, r["source"]
