"""versions.TESTED is the one source of the supported framework releases; pyproject's extras and docs agree with it.

The guard reads TESTED directly (tests/<fw>/test_guards.py); here: each framework's extra in pyproject.toml admits
every tested release and no older one, and docs/versions.md's "Framework versions" table lists exactly the tested
releases.
"""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from kl_adapters.adapters.versions import TESTED, supported_range

ROOT = Path(__file__).resolve().parents[2]


def extras() -> dict[str, Requirement]:
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {fw: next(Requirement(r) for r in optional[fw] if Requirement(r).name.lower() == fw) for fw in TESTED}


@pytest.mark.parametrize("framework", sorted(TESTED))
def test_extra_spans_exactly_the_tested_releases(framework):
    spec = extras()[framework].specifier
    tested = [Version(v) for v in TESTED[framework]]
    assert tested == sorted(tested), "TESTED lists releases oldest first"
    assert all(spec.contains(v) for v in tested), f"pyproject's {framework} extra {spec} refuses a tested release"
    lower = [Version(s.version) for s in spec if s.operator == ">="]
    assert lower == [tested[0]], f"pyproject's {framework} extra {spec} must start at the oldest tested release"


def docs_table() -> set[tuple[str, str]]:
    """(framework, release) rows of docs/versions.md's "Framework versions" table (first two columns)."""
    text = (ROOT / "docs" / "versions.md").read_text()
    match = re.search(r"^#+ Framework versions\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    assert match, "docs/versions.md has no 'Framework versions' section"
    rows = re.findall(r"^\| *([A-Za-z]+) *\| *([0-9][0-9.]*) *\|", match.group(1), re.M)
    return {(fw.lower(), version) for fw, version in rows}


def test_docs_table_lists_exactly_the_tested_releases():
    assert docs_table() == {(fw, v) for fw, versions in TESTED.items() for v in versions}


def test_supported_range_names_every_release():
    assert supported_range("trl") == f"trl {', '.join(TESTED['trl'][:-1])} or {TESTED['trl'][-1]}"
