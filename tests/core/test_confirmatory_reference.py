"""The confirmatory re-test's reference and proxy reward model are committed (docs/task.md, "Confirmatory"):
`KL_ADAPTERS_CACHE=bench/results/task/confirmatory/cache` makes the task harness load exactly the checkpoints
L1-L4 ran on, without re-training them, and the long setting's reference its design chose (protocol steps 1-2,
`settings.LONG_DESIGN`). Pinned here: the committed folders are the ones today's recipes (the `cpu` scale's, which the
benchmark and the confirmatory runs use) look up, their weights are the bytes the runs used (sha256), and the long
setting's choice is the design file's first in-band line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kl_adapters.demo.task import arithmetic, proxy, reference
from kl_adapters.demo.task.settings import LONG_DESIGN, LONG_SIZES, SCALES

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "bench/results/task/confirmatory/cache/task-reference"
DESIGN = ROOT / "bench/results/task/confirmatory/design_long.txt"
#: sha256 of the weights in ~/.cache/kl-adapters/task-reference when L1-L4 ran (2026-11-29)
WEIGHTS = {"26fbcd1b1ec1": "50689c1be32022d052080a160a1927073120add938512e15da891c1149cb9f7f",
           "proxy-532aa402c6cd": "8aa47214c3f6dfa1119259e30f094367af951cf45d97e6325d86aee0d879c8a5"}
#: sha256 of the long setting's reference as bench/long_design.py judged it (noise 0.02, small; 2026-11-29)
LONG_WEIGHTS = {"413893ce2c12": "349d8726dd7446914b8bb1c4d33c5435fbe027a362d815db4dcbc8a3d7b6129b"}


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


def test_the_long_setting_loads_the_design_s_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Protocol step 1: the first noise of arithmetic.LONG_NOISES whose line (at the first size with one) is in the
    band; `settings.LONG_DESIGN` names it and the `cpu` scale loads its committed checkpoint."""
    lines = [line for line in DESIGN.read_text().splitlines() if line.startswith("noise ")]
    verdict = {(float(line.split()[1]), line.split()[3]): "(in the 20-60% band)" in line for line in lines}
    first = next((noise, size) for size in LONG_SIZES for noise in arithmetic.LONG_NOISES
                 if verdict.get((noise, size)) is not False)
    assert verdict[first] and first == LONG_DESIGN
    monkeypatch.setattr(reference, "_train", _never)
    ref = reference.build(SCALES["cpu"].long_reference, cache=CACHE, say=_never)
    assert hashlib.sha256((ref / "model.safetensors").read_bytes()).hexdigest() == LONG_WEIGHTS[ref.name]


def test_the_analysis_reads_the_betas_step_3_chose() -> None:
    """Protocol step 3: bench/confirmatory.py tests H1-H7 at the betas of the design file's `chosen betas` line, the
    line bench/long_design.py writes from the 150-step policy's bias shares (its `pick_betas`)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import confirmatory

    chosen = next(line for line in DESIGN.read_text().splitlines() if line.startswith("chosen betas"))
    betas = confirmatory.long_betas(DESIGN.parent)
    assert list(betas) == ["beta_1", "beta_2", "beta_3"] and betas["beta_1"] < betas["beta_2"] < betas["beta_3"]
    assert chosen.endswith(": " + ", ".join(f"{b:g}" for b in betas.values()))
