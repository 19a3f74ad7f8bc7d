"""`kl-adapters measure` in verl's environment: the configuration read from verl overrides by the doctor's reader
(its transformers release, 5.10, loads and samples the tiny models)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure_checks import launch_measurement, tiny_inputs  # noqa: E402


def test_a_configuration_read_from_verl_overrides(capsys, tmp_path):
    doc = launch_measurement(capsys, tiny_inputs(tmp_path), "verl", "actor_rollout_ref.actor.use_kl_loss=True",
                             "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                             "actor_rollout_ref.actor.kl_loss_coef=0.001")
    assert [c["preset"] for c in doc["context"]["judged"]] == ["k3-loss"] and doc["context"]["beta"] == 0.001
    assert doc["measurement"]["rows"][0]["name"] == "verl loss"
