"""The verl test environment is the one the adapter is tested against (CPU torch, pinned framework)."""

import importlib.metadata
import sys
from pathlib import Path

import torch

from kl_adapters.adapters.versions import TESTED


def test_cpu_torch_and_pinned_framework():
    assert torch.version.cuda or torch.__version__.endswith("+cpu"), "torch must be a CPU or a CUDA build"
    # a tested release: the newest in the main suite's .venvs/verl, any in a compat suite's .venvs/verl-<version>
    tested = TESTED["verl"] if Path(sys.prefix).name != "verl" else TESTED["verl"][-1:]
    assert importlib.metadata.version("verl") in tested
