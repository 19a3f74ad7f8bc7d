"""Helpers shared by the Ray fault tests of the verl and OpenRLHF suites (tests only; each suite puts tests/ on sys.path
and on its Ray workers' PYTHONPATH): a worker process importing a framework that reports another release, and waiting
for an actor Ray is restarting."""

from __future__ import annotations

import importlib
import importlib.metadata
import time
from collections.abc import Callable


def import_as_release(module: str, distribution: str, reported: str) -> str | None:
    """Import `module` while importlib.metadata reports `distribution`==`reported` in this process (what the version
    guard reads); the error it raised as "Type: message", None when it imported."""
    real = importlib.metadata.version
    importlib.metadata.version = lambda name: reported if name == distribution else real(name)
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        return f"{type(exc).__name__}: {exc}"
    finally:
        importlib.metadata.version = real


def once_restarted(ray, call: Callable, seconds: float = 300.0):
    """ray.get(call()) once the actor `call` addresses is back: while Ray restarts it, calls raise
    ActorUnavailableError. A restart imports the framework afresh: on two cores shared with other jobs it took over
    120 s once (2026-11-29), so the deadline is generous."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return ray.get(call(), timeout=seconds)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
