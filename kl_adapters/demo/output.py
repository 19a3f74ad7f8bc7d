"""Where a benchmark run's output goes, and what it records about the machine: `output_to` points the frameworks'
printing (this process and the workers it starts) at a log file and gives the terminal one print function;
`environment` is the versions, device and source revision written into every result's JSON; `read_runs` /
`append_run` read and extend a benchmark's run store (<name>.jsonl.gz: one JSON object per line, gzip-compressed).

Shared by the demo's drivers (`run`, `long_horizon_run`, `task.driver`) and the bench/ scripts; it imports nothing
from the demo, so that no driver imports another for them.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


@contextlib.contextmanager
def output_to(log: Path):
    """Point file descriptors 1 and 2 (this process and the workers it starts) at `log`; yield a print function
    for the terminal. The descriptors are restored on exit, so an exception's traceback reaches the terminal."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    with open(log, "w") as sink:
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)
        try:
            yield lambda *parts, **kw: print(*parts, **kw, file=console, flush=True)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            console.close()


def environment() -> dict:
    """Python, torch and framework versions, device, and the kl-adapters source (`git describe --always --dirty` of
    the checkout it runs from, when it runs from one): what a result was measured with."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for dist in ("kl-adapters", "trl", "transformers", "verl", "openrlhf", "ray"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[dist] = importlib.metadata.version(dist)
    source = Path(__file__).resolve().parents[2]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        env["kl_adapters_source"] = subprocess.run(
            ["git", "-C", str(source), "describe", "--always", "--dirty"], capture_output=True, text=True,
            check=True, timeout=10).stdout.strip()
    return env


def read_runs(store: Path) -> list[dict]:
    """The runs in a benchmark's store (<name>.jsonl.gz), in the order they finished; [] when there is none yet."""
    if not store.exists():
        return []
    with gzip.open(store, "rt") as f:
        return [json.loads(line) for line in f]


def append_run(store: Path, run: dict) -> None:
    """Append one run to a store as its own gzip member, so a killed benchmark keeps every run that finished (a file of
    several members reads back as one stream)."""
    with gzip.open(store, "at") as f:
        f.write(json.dumps(run) + "\n")
