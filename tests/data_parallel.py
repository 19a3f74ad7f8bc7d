"""Launcher of the data-parallel tests (tests/<suite>/test_data_parallel.py, docs/data-parallel.md): runs a worker
script once per rank as a plain subprocess with the environment torch.distributed and accelerate read (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), so no external launcher is
needed; every rank gets a timeout, and a failing rank's output is in the assertion message."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, world: int, *args: str, timeout: float = 120, env: dict | None = None) -> None:
    """`python script *args` as ranks 0..world-1 of one gloo job on this machine; raises AssertionError naming the rank
    that failed (the others are then killed, as they would wait for it) or the timeout, with the ranks' output."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    base.update(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    procs = [subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=logs[r], stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline, failure = time.monotonic() + timeout, None
    try:
        while failure is None and any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                failure = f"rank {failed[0]} exited {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout:g} s"
            else:
                time.sleep(0.2)
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failure is None and failed:
            failure = f"rank {failed[0]} exited {procs[failed[0]].returncode}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failure is not None:
        output = []
        for rank, log in enumerate(logs):
            log.seek(0)
            output.append(f"--- rank {rank}:\n{log.read()[-3000:]}")
        raise AssertionError("\n".join([failure, *output]))


def relative_error(got, expected) -> float:
    """max |got - expected| / max |expected| of two gradients (float64 arithmetic)."""
    got, expected = got.double(), expected.double()
    return float((got - expected).abs().max() / expected.abs().max())
