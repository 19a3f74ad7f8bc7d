"""Every p-value README.md and docs/task.md quote exists in a committed task report (issue 46).

A quotation is `p 0.012`, `p = 0.012`, or a list after one `p` (`p 0.012, 0.018`, `p = 0.053 and 0.078`,
`p 0.004-0.034`; README's "adjusted p 0.013, 0.016" is one). A committed report holds a p-value where it prints one:
`p = 0.012` / `(p 0.012;` / `Holm 1.000` in the per-setting reports and `exploratory_tables.md`, and any three-decimal
number in the two family tables, `exploratory_family.txt` and `confirmatory/confirmatory.txt`, whose only
three-decimal columns are p-values (uncorrected, Holm, BH q, permutation p). A figure typed by hand, or left behind
when a report was regenerated, fails here with its page and line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs import ROOT
from test_results_cited import tracked

REPORTS = ROOT / "bench" / "results" / "task"
FAMILY_TABLES = [REPORTS / "exploratory_family.txt", REPORTS / "confirmatory" / "confirmatory.txt"]
PAGES = ["README.md", "docs/task.md"]

_VALUE = r"\d\.\d{3}"
#: a quotation: `p`, optionally `=`, then one value or a list of them
QUOTED = re.compile(rf"\bp(?: =)? ({_VALUE}(?:(?:, | and |-){_VALUE})*)\b")
#: where a per-setting report prints a p-value
PRINTED = re.compile(rf"\b(?:p(?: =)?|Holm) ({_VALUE})\b")


def _tracked_reports() -> list[Path]:
    return [ROOT / p for p in tracked() if p.startswith("bench/results/task/") and p.endswith((".txt", ".md"))]


def reported_p_values(reports: list[Path]) -> set[str]:
    values: set[str] = set()
    for report in reports:
        text = report.read_text()
        values |= set(re.findall(rf"\b{_VALUE}\b", text) if report in FAMILY_TABLES else PRINTED.findall(text))
    return values


def quoted_p_values(text: str) -> list[tuple[int, str]]:
    """(line, value) for every p-value the text quotes."""
    return [(text[:m.start()].count("\n") + 1, value) for m in QUOTED.finditer(text)
            for value in re.findall(_VALUE, m.group(1))]


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_p_value_is_in_a_committed_report(page: str):
    known = reported_p_values(_tracked_reports())
    quoted = quoted_p_values((ROOT / page).read_text())
    assert quoted, f"{page} quotes no p-value: the pattern no longer matches its style"
    assert [(line, v) for line, v in quoted if v not in known] == []


def test_the_patterns(tmp_path: Path):
    text = "a (p 0.012, 0.018) b\nc p = 0.053 and 0.078, d p 0.004-0.034; adjusted p 0.013, 0.016; p < 0.05"
    assert [v for _, v in quoted_p_values(text)] == ["0.012", "0.018", "0.053", "0.078", "0.004", "0.034", "0.013",
                                                      "0.016"]
    assert quoted_p_values(text)[2][0] == 2
    report = tmp_path / "task_x.txt"
    report.write_text("-2.7 (p = 0.012, significant)  (p 0.018; Holm 1.000)  KL 0.455")
    assert reported_p_values([report]) == {"0.012", "0.018", "1.000"}
