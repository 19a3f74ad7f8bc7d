"""The openrlhf test environment is the one the adapter is tested against (CPU torch, pinned framework)."""

import importlib.metadata
import sys
from pathlib import Path

import pytest
import torch

from kl_adapters.adapters.versions import TESTED


@pytest.mark.compat
def test_cpu_torch_and_pinned_framework():
    assert torch.version.cuda or torch.__version__.endswith("+cpu"), "torch must be a CPU or a CUDA build"
    version = importlib.metadata.version("openrlhf")
    assert version in TESTED["openrlhf"]  # scripts/test.sh openrlhf==<v> (compat suite) runs on any tested release
    if Path(sys.prefix).name == "openrlhf":  # .venvs/openrlhf, the main suite's environment: the newest tested release
        assert version == TESTED["openrlhf"][-1]
