"""The framework releases kl-adapters is tested with: the one source of the version guard, docs and extras.

`TESTED[framework]` lists exactly the releases whose adapter tests ran green (newest last); the guard
(`_guard.require_version`) accepts those and refuses the rest, `pyproject.toml`'s extras must span them
(tests/core/test_versions.py), and `scripts/compat.sh` is how a release gets onto this list (see docs/versions.md,
"Framework versions"). Imports nothing (read by the torch-free activation path and the verl plugin).
"""

from __future__ import annotations

#: framework (its pip distribution name) -> releases whose adapter tests ran green, oldest first
TESTED: dict[str, tuple[str, ...]] = {
    "trl": ("1.14.0", "1.14.1", "1.14.2", "1.15.0", "1.16.0"),
    "verl": ("0.9.0", "0.9.1"),
    "openrlhf": ("0.10.4", "0.11.0", "0.11.1", "0.11.2"),
}


def supported_range(framework: str) -> str:
    """Human-readable list of the tested releases, e.g. 'trl 1.14.0, 1.15.0 or 1.16.0'."""
    versions = TESTED[framework]
    listed = versions[0] if len(versions) == 1 else f"{', '.join(versions[:-1])} or {versions[-1]}"
    return f"{framework} {listed}"
