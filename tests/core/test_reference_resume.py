"""An interrupted reference build resumes from its last saved training state and ends with the weights, loss curve and
cache folder an uninterrupted build gives (kl_adapters/demo/task/reference.py; what lets the long setting's references,
hours of CPU each, span sessions: bench/long_design.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kl_adapters.demo.task import reference

SPEC = reference.ReferenceSpec(hidden=16, layers=1, heads=2, steps=6, batch=4, seed=5)


class Interrupted(Exception):
    pass


def _weights(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def test_a_resumed_build_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "CHECKPOINT_EVERY", 2)
    whole = reference.build(SPEC, tmp_path / "whole", say=lambda *_: None)

    save = reference._save_partial

    def save_then_stop(partial, *args):
        save(partial, *args)
        if args[4] == 4:  # the step saved
            raise Interrupted

    monkeypatch.setattr(reference, "_save_partial", save_then_stop)
    with pytest.raises(Interrupted):
        reference.build(SPEC, tmp_path / "split", say=lambda *_: None)
    partial = tmp_path / "split" / f"{SPEC.key()}.partial.pt"
    assert partial.exists() and not (tmp_path / "split" / SPEC.key() / "reference.json").exists()

    said = []
    split = reference.build(SPEC, tmp_path / "split", say=said.append)
    assert any("resumed at step 4/6" in line for line in said)
    assert not partial.exists()
    a, b = _weights(whole), _weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    curves = [json.loads((f / "reference.json").read_text())["loss_every_100"] for f in (whole, split)]
    assert curves[0] == curves[1]
