"""bench/task_family.py's tables (issue 46): every group of the committed exploratory reports, each configuration
against the group's best and against the framework's default, each uncorrected p beside its Holm-adjusted one, which
is never smaller; the committed exploratory_tables.md is what the script writes from the committed reports."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench/results/task"
sys.path.insert(0, str(ROOT / "bench"))
import task_family  # noqa: E402


def test_the_tables_put_each_p_beside_its_correction(tmp_path: Path, capsys) -> None:
    for report in RESULTS.glob("task_*_*.json"):
        shutil.copy(report, tmp_path)
    task_family.main(["--results", str(tmp_path)])
    text = (tmp_path / "exploratory_tables.md").read_text()
    assert text == (RESULTS / "exploratory_tables.md").read_text()
    groups = sum(len(json.loads(r.read_text())["groups"]) for r in RESULTS.glob("task_*_*.json"))
    assert text.count("| configuration |") == groups
    pairs = re.findall(r"\(p (\d\.\d+); Holm (\d\.\d+)\)", text)
    assert len(pairs) > 100 and all(float(holm) >= float(p) for p, holm in pairs)
