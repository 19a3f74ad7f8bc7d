"""Imported for its effect by the bench scripts: this checkout on sys.path, so that a script measures the checkout's
kl_adapters and not the copy installed in the environment it runs with (scripts/envs.sh installs kl-adapters
non-editable: that copy is the code of the environment's last build). It goes behind the entries of PYTHONPATH, so a
"before" measurement still runs the current script against another checkout's package (`PYTHONPATH=<checkout of C>
python bench/<script>.py`). Pinned by tests/core/test_bench_imports.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]), ROOT)
