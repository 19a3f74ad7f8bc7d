"""README.md and docs/*.md point only at what exists: every relative link resolves (the file, and its #anchor under
GitHub's heading-slug rules), and every repository path they name, in a link, in backticks or in prose
(`bench/variance.py`, `tests/core/test_x.py::test_name`, `bench/results/variance_full.{txt,json}`,
`tests/<fw>/test_gpu.py`), exists: the file or folder, at least one match for a `*` or `<placeholder>`, every
alternative of a `{a,b}`, and the test function after `::`."""

from __future__ import annotations

import glob
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the repository's top-level folders: a path the docs name starts with one of them
TOP = ("bench", "docs", "envs", "examples", "kl_adapters", "patches", "scripts", "tests")
#: paths the docs name that a command writes and that do not exist yet, with the reason
NOT_YET = {
    "bench/results/gpu_<fw>_<device>.json": "written by the GPU benchmark on a device (docs/gpu.md)",
}

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w./<>{}*-])((?:" + "|".join(TOP) + r")/[\w./<>{}*,+=:-]*)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped (letters, digits, _, - and spaces kept),
    lower case, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, with GitHub's -1, -2, ... for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6} (.+?)#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's inline links and images, outside code (fenced blocks and `spans`)."""
    text = re.sub(r"`[^`\n]*`", "", _FENCE.sub("", page.read_text()))
    return _LINK.findall(text)


def named_paths(page: Path) -> list[str]:
    """Every repository path the page names (relative to the repository): a file (a dot in its last part, or a
    `::test`) or a folder (a trailing /). Words like `kl_adapters/seq_kl` (a metric's name) are not paths."""
    found = {p.rstrip(".,:;") for p in _PATH.findall(page.read_text())}
    return sorted(p for p in found if p.endswith("/") or "::" in p or "." in p.rsplit("/", 1)[-1])


def _alternatives(path: str) -> list[str]:
    """`a.{x,y}` -> [`a.x`, `a.y`] (every brace group expanded)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def missing(path: str) -> str | None:
    """Why `path` (repository-relative, as the docs write it) does not exist, or None."""
    if path in NOT_YET:
        return None
    path, _, function = path.partition("::")
    path = re.sub(r":\d+(-\d+)?$", "", path)  # file:line
    for alternative in _alternatives(path):
        pattern = re.sub(r"<[^<>/]*>", "*", alternative)
        matches = glob.glob(str(ROOT / pattern)) if "*" in pattern else [str(ROOT / pattern)]
        if not any(Path(m).exists() for m in matches):
            return f"{alternative}: no such file or folder"
        name = function.split("[")[0]
        if name and not any(re.search(rf"^\s*(?:async )?def {re.escape(name)}\(", Path(m).read_text(), re.M)
                            for m in matches if Path(m).is_file()):
            return f"{alternative}: no function {name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_repository_path_exists(page: Path):
    problems = [reason for path in named_paths(page) if (reason := missing(path))]
    assert not problems, problems


def test_docs_index_lists_every_page():
    listed = {target.partition("#")[0] for target in links(ROOT / "docs" / "README.md")}
    unlisted = [p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in listed]
    assert not unlisted, f"docs/README.md does not link {unlisted}"
    assert "docs/README.md" in {target.partition("#")[0] for target in links(ROOT / "README.md")}


def test_the_checks_themselves():
    """The slug, brace and placeholder rules on known cases (a broken rule would pass everything)."""
    assert slug("`kl-adapters doctor`: what does my KL configuration optimize?") == (
        "kl-adapters-doctor-what-does-my-kl-configuration-optimize")
    assert slug("Long horizons (`bench/variance.py`)") == "long-horizons-benchvariancepy"
    assert _alternatives("bench/results/variance_full.{txt,json}") == [
        "bench/results/variance_full.txt", "bench/results/variance_full.json"]
    assert missing("tests/core/test_docs.py::test_the_checks_themselves") is None
    assert missing("tests/core/test_docs.py::no_such_test") is not None
    assert missing("tests/<fw>/test_doctor.py") is None and missing("tests/nope/test_doctor.py") is not None
    assert missing("kl_adapters/doctor/report.py:12-30") is None
    assert named_paths(ROOT / "docs" / "README.md")
