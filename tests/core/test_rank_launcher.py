"""The data-parallel tests' launcher (tests/data_parallel.py): a rank that hangs is reported with where it waited, and
`end_rank` ends a gloo job with every rank at exit status 0 (it replaced `destroy_process_group`, which hung a TRL
rank in CI once)."""

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


def test_end_rank_ends_a_gloo_job_cleanly(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, torch, torch.distributed as dist
        spec = importlib.util.spec_from_file_location("data_parallel", {str(Path(data_parallel.__file__))!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        dist.init_process_group("gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
        print("sum", int(total))
        module.end_rank()
        raise SystemExit(3)  # not reached: end_rank exits with 0
    """))
    data_parallel.run_ranks(script, 2, timeout=60)  # raises, naming the rank, on any exit status but 0
