"""Shared setup of the OpenRLHF suite: CPU import stubs on the path (also for Ray workers), tiny local models, a local
Ray cluster, and a clean kl-adapters state around every test.

flash_attn and vllm cannot be installed without CUDA; tests/openrlhf/cpu_stubs holds import-only stubs for them (each
file says so). openrlhf_cpu_shim.py replaces OpenRLHF's CUDA / DeepSpeed-engine calls. Both exist only for tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = HERE / "cpu_stubs"
for _path in (str(HERE), str(STUBS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
# Ray workers (and subprocesses) of this suite import the same stubs and shim.
os.environ["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("KL_ADAPTERS", None)

import pytest  # noqa: E402

from openrlhf_cpu_shim import save_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _kl_adapters_off():
    """Every test starts and ends with kl-adapters off and OpenRLHF unpatched."""
    import kl_adapters

    kl_adapters.disable()
    yield
    kl_adapters.disable()


@pytest.fixture(scope="session")
def actor_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("actor")), seed=1)


@pytest.fixture(scope="session")
def ref_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("ref")), seed=2)


@pytest.fixture
def cpu_cuda(monkeypatch):
    """openrlhf_cpu_shim.cuda_shims() for this test (restored afterwards)."""
    from openrlhf_cpu_shim import cuda_shims

    for (owner, name), fn in cuda_shims().items():
        monkeypatch.setattr(owner, name, fn)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (2 CPUs, 1 logical GPU) whose workers see the CPU stubs and shims but no KL_ADAPTERS,
    and serialise tensors as OpenRLHF's train_ppo_ray has them do (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1)."""
    import ray

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "KL_ADAPTERS": "",
                                       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"},
                          "worker_process_setup_hook": "openrlhf_cpu_shim.install_cuda_shims"})
    try:
        yield ray
    finally:
        ray.shutdown()
