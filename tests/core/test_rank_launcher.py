"""The data-parallel tests' launcher (tests/data_parallel.py): a rank that hangs is reported with where it waited; a
worker that returns ends with every rank at exit status 0 (the bootstrap's `end_rank`, which replaced
`destroy_process_group`, which hung a TRL rank in CI once); a worker runs as `python worker.py` would run it; a rank
that raises is reported with its traceback."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

# loaded by path: tests/ on sys.path would make tests/trl etc. importable as namespace packages named like the
# frameworks this environment does not have
_spec = importlib.util.spec_from_file_location("data_parallel", Path(__file__).parents[1] / "data_parallel.py")
data_parallel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_parallel)


def test_a_hanging_rank_is_reported_with_its_stack(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, time
        def wait_for_a_peer_that_never_comes():
            while True:
                time.sleep(0.1)
        if os.environ["RANK"] == "1":
            wait_for_a_peer_that_never_comes()
    """))
    with pytest.raises(AssertionError) as failure:
        data_parallel.run_ranks(script, 2, timeout=5)
    message = str(failure.value)
    assert message.startswith("timed out after 5 s")
    rank1 = message.split("--- rank 1:")[1]
    assert "wait_for_a_peer_that_never_comes" in rank1  # faulthandler's stack, printed on SIGABRT


def test_a_gloo_job_ends_with_every_rank_at_exit_0(tmp_path):
    """Through `end_rank` (`os._exit(0)`), not the interpreter's exit, whose atexit handler here would exit 3."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, torch, torch.distributed as dist
        atexit.register(os._exit, 3)
        dist.init_process_group("gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
        assert int(total) == 2
    """))
    data_parallel.run_ranks(script, 2, timeout=60)  # raises, naming the rank, on any exit status but 0


def test_a_worker_runs_as_its_own_script(tmp_path):
    """As `python worker.py job out` would: __main__, its arguments, its own folder first on sys.path and tests/ not on
    it (tests/trl, tests/verl, tests/openrlhf would shadow the frameworks' packages)."""
    script = tmp_path / "worker.py"
    tests = str(Path(data_parallel.__file__).resolve().parent)
    script.write_text(textwrap.dedent(f"""
        import os, sys
        assert __name__ == "__main__"
        assert sys.argv[1:] == ["job.pt", "rank{{rank}}.pt"], sys.argv
        assert sys.path[0] == os.path.dirname(os.path.abspath(__file__)), sys.path
        assert {tests!r} not in sys.path, sys.path
    """))
    data_parallel.run_ranks(script, 2, "job.pt", "rank{rank}.pt", timeout=60)


def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import os
        if os.environ["RANK"] == "1":
            raise ValueError("rank one's own error")
    """))
    with pytest.raises(AssertionError) as failure:
        data_parallel.run_ranks(script, 2, timeout=60)
    message = str(failure.value)
    assert message.startswith("rank 1 exited 1")
    assert "ValueError: rank one's own error" in message.split("--- rank 1:")[1]
