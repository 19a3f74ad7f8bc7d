"""`kl-adapters measure` in OpenRLHF's environment: the configuration read from OpenRLHF's arguments by the doctor's
reader (its transformers release, 5.15, loads and samples the tiny models)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure_checks import launch_measurement, tiny_inputs  # noqa: E402


def test_a_configuration_read_from_openrlhf_arguments(capsys, tmp_path):
    doc = launch_measurement(capsys, tiny_inputs(tmp_path), "openrlhf", "--algo.kl.use_loss", "--algo.kl.estimator",
                             "k3", "--algo.kl.init_coef", "0.01")
    assert [c["preset"] for c in doc["context"]["judged"]] == ["k3-loss"] and doc["context"]["beta"] == 0.01
