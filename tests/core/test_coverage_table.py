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
    mapped = {t for t in [*bench.PATH_TESTS.values(), *bench.PATH_OPTION_TESTS.values()] if t}
    assert [t for t in sorted(mapped) if not exists(t)] == []


def test_the_settings_are_the_support_matrixs():
    """Every feature value bench/coverage.py maps to a setting names one of the support matrix (kl_adapters.support),
    and its verdict is the matrix's entry: a test exactly where the matrix calls the setting tested (the matrix is the
    one source; bench/coverage.py keeps no status of its own)."""
    from kl_adapters import support

    bench = _bench()
    for (framework, key, value), name in bench.SETTING.items():
        e = support.entry(framework, name)
        probe = 2 if value == bench.ABOVE_ONE else value
        assert bench.verdict(framework, key, probe) == (e.status, e.test if e.status == support.TESTED else None)
    for (framework, key, value), test in bench.PATH_OPTION_TESTS.items():
        assert bench.verdict(framework, key, value) == (support.TESTED, test)
    assert bench.verdict("verl", "strategy", "some other engine") == (None, None)


@pytest.mark.parametrize("framework, key, value, status", [
    ("verl", "ulysses_sequence_parallel_size", 4, "tested"),
    ("verl", "strategy", "megatron", "accepted, untested"),
    ("verl", "vision-language model", "vision-language", "tested"),
    ("verl", "vision-language model", "vision-language-other", "accepted, untested"),
    ("openrlhf", "vision-language model", "vision-language", "tested"),
    ("trl", "vision-language model", "vision-language", "tested"),
    ("openrlhf", "ds.ring_attn_size", 2, "tested"),
    ("openrlhf", "ds.tensor_parallel_size", 2, "refused"),
    ("trl", "use_liger_kernel", True, "tested"),
    ("trl", "deepspeed / fsdp", True, "accepted, untested"),
])
def test_the_changed_and_added_settings_read_the_matrix(framework, key, value, status):
    """The verdicts this table depends on follow kl_adapters/support.py: Ulysses, TRL's Liger, OpenRLHF's ring
    attention and the Qwen2-VL family of vision-language models tested, TRL under DeepSpeed / FSDP, Megatron and other
    vision-language families accepted but untested, OpenRLHF's tensor parallelism refused."""
    from kl_adapters import support

    bench = _bench()
    assert bench.verdict(framework, key, value)[0] == status == support.entry(
        framework, bench.setting(framework, key, value)).status


def test_the_doc_gives_the_tables_counts():
    """docs/coverage.md's headline and its "after" row are bench/results/coverage.json's totals."""
    doc = json.loads((ROOT / "bench" / "results" / "coverage.json").read_text())["coverage"]
    total = {k: sum(c[k] for c in doc.values()) for k in ("kl", "accepted", "tested")}
    page = (ROOT / "docs" / "coverage.md").read_text()
    assert f"{total['tested']} of {total['kl']}" in page
    row = next(line for line in page.splitlines() if line.startswith("| all |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1].startswith(f"{total['tested']} ("), row
    assert cells[4] == str(total["accepted"]), row


def test_judging_the_rows_again_gives_their_verdicts():
    """The committed table's accepted / tested / untested / tests are what `judge` gives its collected facts with
    today's mappings: moving them into the support matrix changed no number (bench/results/coverage.json; the "before"
    table was judged with the mappings of the commit that made it)."""
    bench = _bench()
    for r in json.loads((ROOT / "bench" / "results" / "coverage.json").read_text())["rows"]:
        again = bench.judge({k: v for k, v in r.items() if k not in ("accepted", "tests", "untested", "tested")})
        assert {k: again.get(k) for k in ("accepted", "tests", "untested", "tested")} == {
            k: r.get(k) for k in ("accepted", "tests", "untested", "tested")}, r["source"]
