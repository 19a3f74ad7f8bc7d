"""The verl test environment is the one the adapter is tested against (CPU torch, pinned framework)."""

import importlib.metadata

import torch


def test_cpu_torch_and_pinned_framework():
    assert not torch.version.cuda, "the verl environment must use a CPU build of torch"
    assert importlib.metadata.version("verl") == {"trl": "1.16.0", "verl": "0.9.1", "openrlhf": "0.11.2"}["verl"]
