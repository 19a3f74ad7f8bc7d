"""The doctor's support-matrix lines, checked the same way in the trl, verl and openrlhf suites (tests only; each suite
puts tests/ on sys.path)."""

from __future__ import annotations

from kl_adapters import support
from kl_adapters.doctor import format_report


def check_verdict_printed(framework: str, key: str, report, base, *, in_base: bool = False) -> None:
    """The matrix's one line for setting `key` (kl_adapters.support: a note when tested, a warning when accepted
    untested or refused) is in `report` (the doctor with the setting on), in `base` (without it) only when `in_base`,
    and the verdict is "refused" exactly when the line is a refused-path warning."""
    notes, warnings = support.doctor_lines(framework, [key])
    ((code, line),) = [(None, note) for note in notes] + warnings
    assert line in format_report(report) and (line in format_report(base)) == in_base
    assert (code, line) in [(h.code, h.message) for h in report.hazards] + [(None, n) for n in report.notes]
    assert (report.verdict == "refused") == (code == "refused-path"), report.hazards
