"""The installed `kl-adapters` console script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).with_name("kl-adapters")


def run(*args):
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not SCRIPT.exists(), reason="kl-adapters is not installed in this environment")
def test_audit_json_meets_done_criteria():
    doc = json.loads(run("audit", "--json", "-V", "3", "-T", "4", "--seed", "2"))
    # V=3 (2 non-EOS tokens), T=4: 15 prefixes of length 0..3 each closed by EOS + 8 * 2 full-length sequences
    assert doc["config"]["vocab"] == 3 and doc["num_sequences"] == 15 + 16
    rows = {(r["preset"], r["regime"], r["is_clip"]): r for r in doc["rows"]}
    assert rows[("sequence", "on-policy", None)]["relative_bias"] < 1e-6
    assert rows[("sequence", "off-policy", None)]["relative_bias"] < 1e-6
    assert rows[("reward", "on-policy", None)]["relative_bias"] < 1e-6
    assert rows[("k3-loss", "on-policy", None)]["relative_bias"] > 0.05
    assert rows[("sequence", "off-policy", 2.0)]["target"] is None


@pytest.mark.skipif(not SCRIPT.exists(), reason="kl-adapters is not installed in this environment")
def test_audit_table_and_presets_listing():
    table = run("audit")
    assert "sequence" in table and "on/off" in table and "k3-loss" in table
    listing = run("presets")
    assert "importance weights" in listing
    assert listing.startswith("sequence        RECOMMENDED for a KL in the loss") and listing.count("RECOMMENDED") == 2
    assert set(json.loads(run("presets", "--json"))) >= {"sequence", "reward", "token", "k1-loss", "k3-reward"}


def test_unknown_subcommand_fails():
    out = subprocess.run([sys.executable, "-m", "kl_adapters.cli", "nope"], capture_output=True, text=True,
                         env={**os.environ})
    assert out.returncode != 0 and "invalid choice" in out.stderr


def test_task_audit_is_exact_and_compares_the_trainers_gradient():
    """`kl-adapters audit --task`: the task + KL gradient of every configuration has sequence-plain's mean (every
    ordered batch of G = 3, 4 enumerated), and its variance is reported per G."""
    from kl_adapters.audit import TASK_CONFIGS, format_task_table, task_audit

    rows = task_audit(3, 2, 0, drift=0.5, batch_sizes=(3, 4))
    assert {(r.config, r.regime) for r in rows} == {(c[0], g) for c in TASK_CONFIGS for g in ("on-policy",
                                                                                               "off-policy")}
    for r in rows:
        assert all(b < 1e-12 for b in r.bias.values()) and all(v > 0 for v in r.variance.values())
    table = format_task_table(rows)
    assert "sequence, KL-only fit" in table and "ratio to sequence-plain at G = 3, 4" in table


def test_task_audit_needs_a_batch_with_statistics():
    out = subprocess.run([sys.executable, "-m", "kl_adapters.cli", "audit", "--task", "1", "--batch-sizes", "1,2"],
                         capture_output=True, text=True, env={**os.environ})
    assert out.returncode == 2 and "--task needs a scale > 0 and --batch-sizes with a G >= 3" in out.stderr
