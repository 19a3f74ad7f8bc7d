"""The confirmatory re-test's reference and proxy reward model are committed (docs/task.md, "Confirmatory"):
`KL_ADAPTERS_CACHE=bench/results/task/confirmatory/cache` makes the task harness load exactly the checkpoints
L1-L4 ran on, without re-training them. Pinned here: the committed folders are the ones today's recipes
(the `cpu` scale's, which the benchmark and the
confirmatory runs use) look up, and their weights are the bytes the runs used (sha256)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kl_adapters.demo.task import proxy, reference
from kl_adapters.demo.task.settings import SCALES

CACHE = Path(__file__).resolve().parents[2] / "bench/results/task/confirmatory/cache/task-reference"
#: sha256 of the weights in ~/.cache/kl-adapters/task-reference when L1-L4 ran (2026-11-29)
WEIGHTS = {"26fbcd1b1ec1": "50689c1be32022d052080a160a1927073120add938512e15da891c1149cb9f7f",
           "proxy-532aa402c6cd": "8aa47214c3f6dfa1119259e30f094367af951cf45d97e6325d86aee0d879c8a5"}


def _never(*args, **kwargs):
    raise AssertionError("the committed checkpoint was not found: it would be re-trained")


def test_todays_recipes_load_the_committed_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "_train", _never)
    monkeypatch.setattr(proxy, "_model", _never)
    scale = SCALES["cpu"]
    ref = reference.build(scale.reference, cache=CACHE, say=_never)
    fitted = proxy.build(ref, scale.proxy, say=_never)
    assert (ref.name, fitted.name) == tuple(WEIGHTS)
    for folder in (ref, fitted):
        assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == WEIGHTS[folder.name]
