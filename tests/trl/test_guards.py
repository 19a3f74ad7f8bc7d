"""Version guard, code-path guard and bad configuration: clear errors, never a silent patch or a silent no-op."""

import importlib.metadata
import re

import pytest
from conftest import grpo_args, make_trainer, one_batch

import kl_adapters
from kl_adapters.adapters import _guard, versions
from kl_adapters.adapters import trl as adapter


def test_refuses_untested_trl_version(monkeypatch):
    monkeypatch.delenv(_guard.ALLOW_UNTESTED_ENV, raising=False)  # scripts/compat.sh sets it for the whole suite
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "1.13.0" if d == "trl" else real(d))
    with pytest.raises(_guard.UnsupportedFrameworkError, match=re.escape(
            f"supports {versions.supported_range('trl')} (the releases its tests run against); found trl==1.13.0")):
        adapter.patch("trl.trainer.grpo_trainer")
    monkeypatch.setenv(_guard.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="trl==1.13.0"):
        adapter.patch("trl.trainer.grpo_trainer")


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(kl_preset="k4"), "unknown KL preset 'k4'"),
    (dict(kl_preset="sequence", beta=0.0), "silent no-op"),
    (dict(kl_preset=None, kl_is_clip=2.0), "silent no-op"),
    (dict(kl_preset="sequence", kl_is_clip=0.5), ">= 1"),
    (dict(kl_preset="full", kl_is_clip=2.0), "is_clip does not apply to preset 'full'"),
    (dict(kl_preset="full:is_clip=2"), "is_clip does not apply to preset 'full'"),  # the value's is_clip counts too
])
def test_bad_config_raises(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo_args(**overrides)


def test_unknown_subclass_overriding_the_loss_is_refused(model_dir, dataset):
    from trl import GRPOTrainer

    class Custom(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    trainer = make_trainer(model_dir, dataset, trainer_cls=Custom)
    with pytest.raises(_guard.UnsupportedFrameworkError, match="Custom overrides _compute_loss"):
        trainer.compute_loss(trainer.model, one_batch(trainer))


def test_enable_disable_round_trip():
    from trl.trainer.grpo_trainer import GRPOTrainer

    kl_adapters.enable("reward")
    assert hasattr(GRPOTrainer.compute_loss, "__kl_adapters_original__")
    kl_adapters.disable()
    assert not hasattr(GRPOTrainer.compute_loss, "__kl_adapters_original__")
    adapter.patch("trl.trainer.grpo_trainer")  # leave the suite's state as the config field leaves it


def test_changed_trl_method_is_refused_before_anything_is_patched(monkeypatch):
    """patching.install checks every method's leading parameters against the ones the adapter was written for and
    refuses, naming the release, before it replaces any (GRPOTrainer.__init__ stays TRL's)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    adapter.unpatch()
    init = GRPOTrainer.__init__
    monkeypatch.setattr(GRPOTrainer, "compute_loss", lambda self, inputs: None)
    release = importlib.metadata.version("trl")
    with pytest.raises(_guard.UnsupportedFrameworkError, match=re.escape(
            f"trl {release}: trl.trainer.grpo_trainer.GRPOTrainer.compute_loss('self', 'inputs') is not the function "
            "kl-adapters was tested with")):
        adapter.patch("trl.trainer.grpo_trainer")
    assert GRPOTrainer.__init__ is init
    monkeypatch.undo()
    adapter.patch("trl.trainer.grpo_trainer")  # leave the suite's state as the config field leaves it


def test_unpatch_gives_back_trls_own_objects():
    from trl.trainer.grpo_trainer import GRPOTrainer

    adapter.unpatch()
    names = [site.name for site in adapter.SITES["trl.trainer.grpo_trainer"]]
    originals = {name: vars(GRPOTrainer)[name] for name in names}
    adapter.patch("trl.trainer.grpo_trainer")
    assert all(vars(GRPOTrainer)[name] is not original for name, original in originals.items())
    adapter.unpatch()
    assert all(vars(GRPOTrainer)[name] is original for name, original in originals.items())
    adapter.patch("trl.trainer.grpo_trainer")


def test_scoped_state_and_overriding_always_restore():
    """patching.Scoped (what every adapter's wrappers hand each other) and patching.overriding (TRL's beta for one
    compute_loss call): the value holds inside the block, nested blocks see their own, and the previous value is back
    when a block ends, by an exception too."""
    from kl_adapters.adapters.patching import Scoped, overriding

    step = Scoped("test.step")
    assert step.get() is None
    with pytest.raises(RuntimeError), step.bound("outer"):
        with step.bound("inner"):
            assert step.get() == "inner"
        assert step.get() == "outer"
        raise RuntimeError
    assert step.get() is None

    class Trainer:
        beta = 0.04

    trainer = Trainer()
    with pytest.raises(RuntimeError), overriding(trainer, "beta", 0.0):
        assert trainer.beta == 0.0
        raise RuntimeError
    assert trainer.beta == 0.04
