"""The trl test environment is the one the adapter is tested against (CPU torch, pinned framework)."""

import importlib.metadata
import sys
from pathlib import Path

import torch

from kl_adapters.adapters.versions import TESTED


def test_cpu_torch_and_pinned_framework():
    assert torch.version.cuda or torch.__version__.endswith("+cpu"), "torch must be a CPU or a CUDA build"
    version = importlib.metadata.version("trl")
    assert version in TESTED["trl"]  # scripts/test.sh trl==<v> (compat suite) runs on any tested release
    if Path(sys.prefix).name == "trl":  # .venvs/trl, the main suite's environment: the newest tested release
        assert version == TESTED["trl"][-1]
