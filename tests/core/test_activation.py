"""The framework-agnostic activation machinery: enable/disable, KL_ADAPTERS, lazy and reversible patching."""

import os
import subprocess
import sys
import textwrap

import pytest

from kl_adapters import activation
from kl_adapters.activation import Settings, parse


@pytest.fixture()
def fake_framework(tmp_path, monkeypatch):
    """A throwaway framework `fakefw` whose `fakefw.losses.kl()` an adapter `fake_adapter` patches."""
    (tmp_path / "fakefw").mkdir()
    (tmp_path / "fakefw" / "__init__.py").write_text("")
    (tmp_path / "fakefw" / "losses.py").write_text("def kl():\n    return 'original'\n")
    (tmp_path / "fake_adapter.py").write_text(textwrap.dedent("""
        import sys
        from kl_adapters.activation import active
        calls = []
        _orig = None

        def patch(trigger):
            global _orig
            calls.append(trigger)
            mod = sys.modules[trigger]
            if _orig is None:
                _orig = mod.kl
                mod.kl = lambda: f"patched:{active()}" if active() else _orig()

        def unpatch():
            global _orig
            if _orig is not None:
                sys.modules["fakefw.losses"].kl, _orig = _orig, None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(activation.ADAPTERS, "fakefw", ("fake_adapter", ("fakefw.losses",)))
    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    yield
    activation.disable()
    for name in ("fakefw", "fakefw.losses", "fake_adapter"):
        sys.modules.pop(name, None)


def test_enable_then_import_patches_lazily(fake_framework):
    activation.enable("sequence")
    assert "fakefw.losses" not in sys.modules and "fake_adapter" not in sys.modules  # nothing imported eagerly
    import fakefw.losses

    assert fakefw.losses.kl() == "patched:sequence"
    assert os.environ[activation.ENV_VAR] == "sequence"  # child processes (Ray workers) inherit the setting


def test_enable_after_import_patches_at_once_and_is_idempotent(fake_framework):
    import fake_adapter
    import fakefw.losses

    assert fakefw.losses.kl() == "original"
    activation.enable("reward")
    activation.enable("sequence", is_clip=3.0)
    assert fakefw.losses.kl() == "patched:sequence:is_clip=3.0"
    assert fake_adapter.calls == ["fakefw.losses", "fakefw.losses"]  # patch() ran twice, wrapped once


def test_disable_restores_everything(fake_framework):
    activation.enable("sequence")
    import fakefw.losses

    activation.disable()
    assert fakefw.losses.kl() == "original"
    assert activation.active() is None and activation.ENV_VAR not in os.environ
    assert not any(isinstance(f, activation._PostImportFinder) for f in sys.meta_path)


def test_env_preset_is_validated_when_a_framework_is_patched(fake_framework, monkeypatch):
    """At interpreter start the name cannot be checked without importing torch; the first patch checks it."""
    monkeypatch.setenv(activation.ENV_VAR, "k5-loss")
    activation._activate(parse("k5-loss", check_preset=False))
    with pytest.raises(ValueError, match="unknown KL preset 'k5-loss'"):
        import fakefw.losses  # noqa: F401


@pytest.mark.parametrize(("value", "expected"), [
    ("sequence", Settings("sequence")),
    (" reward ", Settings("reward")),
    ("sequence:is_clip=2", Settings("sequence", 2.0)),
    ("off", None), ("", None), ("0", None), (None, None), ("None", None),
])
def test_parse(value, expected):
    assert parse(value) == expected


@pytest.mark.parametrize(("value", "message"), [
    ("bogus", "unknown KL preset 'bogus'"),
    ("sequence:clip=2", "unknown KL_ADAPTERS option 'clip'"),
    ("sequence:is_clip=abc", "needs a number"),
    ("sequence:is_clip=0.5", ">= 1"),
])
def test_parse_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        parse(value)


def test_settings_round_trip_exactly():
    settings = Settings("sequence", 1.23456789012345)
    assert parse(str(settings)) == settings


def test_config_flag_wins_over_environment(fake_framework):
    activation.enable("reward")
    assert activation.resolve("sequence") == Settings("sequence")
    assert activation.resolve(None) == Settings("reward")
    assert activation.resolve("off") is None


def test_ray_runtime_env_carries_the_setting(fake_framework):
    assert activation.with_kl_adapters_env({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    activation.enable("sequence")
    env = activation.with_kl_adapters_env({"env_vars": {"A": "1"}, "pip": ["x"]})
    assert env == {"env_vars": {"A": "1", "KL_ADAPTERS": "sequence"}, "pip": ["x"]}


def test_pth_hook_activates_at_startup_without_importing_torch(tmp_path):
    """The installed kl_adapters_autoload.pth line: KL_ADAPTERS set -> active at interpreter start, torch untouched."""
    code = ("import sys, kl_adapters.activation as a; "
            "print('torch' in sys.modules, a.active(), any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))")
    env = {**os.environ, "KL_ADAPTERS": "sequence:is_clip=2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "sequence:is_clip=2.0", "True"]
    env.pop("KL_ADAPTERS")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "None", "False"]
