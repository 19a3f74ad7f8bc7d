"""Imported for its effect by the OpenRLHF bench scripts: the checkout (its kl_adapters, not an installed copy:
`checkout_path`) and tests/openrlhf (the CPU strategy shim and the harness) on sys.path and, where flash_attn or vllm
cannot be imported (no CUDA), the suite's TEST-ONLY import stubs (tests/openrlhf/cpu_stubs, never called: the scripts
run the Hugging Face attention path); the hub offline."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _path in (str(ROOT / "tests" / "openrlhf"), str(ROOT / "bench")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("vllm") is None:
    sys.path.insert(0, str(ROOT / "tests" / "openrlhf" / "cpu_stubs"))
