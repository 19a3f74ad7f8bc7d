"""Launcher of the data-parallel tests (tests/<suite>/test_data_parallel.py, docs/data-parallel.md): runs a worker
script once per rank as a plain subprocess with the environment torch.distributed and accelerate read (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), so no external launcher is
needed; every rank gets a timeout, and a failing rank's output is in the assertion message. Each rank runs through
this file's bootstrap (`python -X faulthandler data_parallel.py script *args`), which ends the rank with `end_rank`
once the script returns, so no worker has to."""

from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump_stacks(procs: list[subprocess.Popen], grace: float = 10) -> None:
    """SIGABRT to every rank still running: faulthandler (-X faulthandler) prints each thread's Python stack to the
    rank's log before it dies, so a hang's assertion message says where each rank waited."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGABRT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)


def run_ranks(script: Path, world: int, *args: str, timeout: float = 120, env: dict | None = None) -> None:
    """`python script *args` as ranks 0..world-1 of one gloo job on this machine; raises AssertionError naming the rank
    that failed (the others are then killed, as they would wait for it) or the timeout, with the ranks' output."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    base.update(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    bootstrap = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), str(script), *args]
    procs = [subprocess.Popen(bootstrap, cwd=script.parent, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=logs[r], stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline, failure = time.monotonic() + timeout, None
    try:
        while failure is None and any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                failure = f"rank {failed[0]} exited {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout:g} s"
                dump_stacks(procs)
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


def end_rank() -> NoReturn:
    """A rank's end, after its script returned: a barrier if the script joined a process group (no rank leaves while
    another is still in a collective), then `os._exit(0)` with its output flushed. Not `destroy_process_group`: it can
    hang (pytorch#75097; here TRL's worker hung in CI once, past its 240 s timeout, results written); not the
    interpreter's exit either: gloo's threads at teardown once aborted a rank there ("terminate called without an
    active exception", exit -6). A script that raises never gets here: its traceback and exit status 1 reach
    `run_ranks`, which kills the other ranks."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_as_rank(script: str, *args: str) -> NoReturn:
    """The bootstrap: `script` run as `python script *args` would run it (as __main__, its own folder first on
    sys.path in place of tests/, whose trl/, verl/ and openrlhf/ folders would shadow the frameworks' packages), then
    `end_rank`."""
    sys.path[0] = str(Path(script).resolve().parent)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    end_rank()


def relative_error(got, expected) -> float:
    """max |got - expected| / max |expected| of two gradients (float64 arithmetic)."""
    got, expected = got.double(), expected.double()
    return float((got - expected).abs().max() / expected.abs().max())


if __name__ == "__main__":
    run_as_rank(*sys.argv[1:])
