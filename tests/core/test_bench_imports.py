"""Every bench script measures this checkout's kl_adapters, not a copy installed in the environment it runs with:
the environments install kl-adapters non-editable (scripts/envs.sh), so a script that imported the package before
putting the checkout on sys.path would measure the code of the last environment build, silently. Pinned statically:
before its first module-level import of kl_adapters (or of a bench module that imports it), each script (a file with
a `__main__` block) imports bench/checkout_path.py, which puts the checkout on sys.path, or a module that does."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
#: bench modules that put the checkout on sys.path when imported
PATH_SETTERS = ("checkout_path", "openrlhf_paths", "openrlhf_overhead")


def _importers() -> list[str]:
    """kl_adapters and the bench modules that import it at module level without setting the path themselves."""
    return ["kl_adapters"] + [f.stem for f in sorted(BENCH.glob("*.py")) if f.stem not in PATH_SETTERS
                              and re.search(r"^(from|import) kl_adapters\b", f.read_text(), re.M)]


def _scripts() -> list[Path]:
    return [f for f in sorted(BENCH.glob("*.py")) if '__name__ == "__main__"' in f.read_text()]


@pytest.mark.parametrize("script", _scripts(), ids=lambda f: f.name)
def test_the_script_imports_this_checkout(script: Path) -> None:
    lines = script.read_text().splitlines()
    pattern = rf"(from|import) ({'|'.join(_importers())})\b"
    first = next((i for i, line in enumerate(lines) if re.match(pattern, line)), None)
    if first is None:
        return
    before = "\n".join(lines[:first])
    assert re.search(rf"^(from|import) ({'|'.join(PATH_SETTERS)})\b", before, re.M), (
        f"{script.name} imports kl_adapters (line {first + 1}) before putting the checkout on sys.path")


def test_the_checkout_goes_behind_pythonpath() -> None:
    """A "before" measurement (PYTHONPATH=<another checkout>) still imports that checkout's package."""
    import subprocess

    code = ("import sys; sys.path[0] = sys.argv[1]; import checkout_path; "  # sys.path[0]: a script's own folder
            "print(sys.path[1:sys.path.index(checkout_path.ROOT)])")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], env={"PYTHONPATH": "/nonexistent/a:/nonexistent/b"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['/nonexistent/a', '/nonexistent/b']"  # after the script's folder and PYTHONPATH's entries
