"""The task's long-completion setting (issue 46; bench/results/task/confirmatory/protocol.md): its reference is the
protocol's design choice, refused until the design has made one; at the smoke scale a toy reference of the same
splits, so the setting's plumbing runs in CI."""

from __future__ import annotations

import pytest

from kl_adapters.demo.task import arithmetic, driver, settings


def test_the_long_setting_trains_on_its_own_splits_with_360_new_tokens(tmp_path):
    prepared = driver.prepare("long", "smoke", 8, tmp_path, say=lambda *_: None)
    assert prepared.reference.name == settings.SCALES["smoke"].long_reference.key()
    assert prepared.max_new_tokens == 360 and prepared.reward == "accuracy" and prepared.proxy is None
    digits = {len(str(arithmetic.operands(e.prompt)[0])) for e in prepared.train}
    assert digits == {26, 28, 30} and all(e.prompt.endswith(":") for e in prepared.train)
    assert {len(str(arithmetic.operands(e.prompt)[0])) for e in prepared.tests["ood"]} <= {34, 36}


def test_the_long_setting_is_refused_until_its_design_has_chosen_a_reference(tmp_path, monkeypatch):
    monkeypatch.setitem(settings.SCALES, "cpu", settings.Scale(settings.ReferenceSpec(), settings.RLSettings()))
    with pytest.raises(SystemExit, match="has not chosen one yet"):
        driver.prepare("long", "cpu", 8, tmp_path, say=lambda *_: None)
    with pytest.raises(SystemExit, match="runs at scale 'cpu'"):
        driver.prepare("long", "quick", 8, tmp_path, say=lambda *_: None)


def test_the_design_and_the_long_reference_are_one_spec():
    """bench/long_design.py judges exactly the references the setting would train (the cache keys of the judged
    lines: 37c037ea6b42 is noise 0.03, small)."""
    assert settings.long_reference(0.03, "small").key() == "37c037ea6b42"
    design = settings.LONG_DESIGN
    if design is not None:
        assert settings.SCALES["cpu"].long_reference == settings.long_reference(*design)
