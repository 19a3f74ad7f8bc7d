"""The framework-agnostic activation machinery: enable/disable, KL_ADAPTERS, lazy and reversible patching (the switch,
`kl_adapters.activation`, acting through the adapters' loader, `kl_adapters.adapters.loader`, on stand-in adapters),
the activation table on `parse` and through the .pth hook, the activation log line."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kl_adapters import activation
from kl_adapters.activation import Settings, SettingError, parse
from kl_adapters.adapters import loader

# tests/activation_table.py, loaded by path: tests/ on sys.path would make tests/trl etc. importable as namespace
# packages named like the frameworks this environment does not have
_spec = importlib.util.spec_from_file_location("activation_table", Path(__file__).parents[1] / "activation_table.py")
_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_table)
TABLE, cases, check_refusal = _table.TABLE, _table.cases, _table.check_refusal


def write_fake_framework(folder: Path) -> None:
    """A throwaway framework `fakefw` whose `fakefw.losses.kl()` an adapter `fake_adapter` patches, in `folder`."""
    (folder / "fakefw").mkdir()
    (folder / "fakefw" / "__init__.py").write_text("")
    (folder / "fakefw" / "losses.py").write_text("def kl():\n    return 'original'\n")
    (folder / "fake_adapter.py").write_text(textwrap.dedent("""
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


@pytest.fixture()
def fake_framework(tmp_path, monkeypatch):
    """`write_fake_framework`'s framework on sys.path, its trigger registered with the loader."""
    write_fake_framework(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(loader.ADAPTERS, "fakefw", ("fake_adapter", ("fakefw.losses",)))
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
    assert not any(isinstance(f, loader._PostImportFinder) for f in sys.meta_path)


def test_env_preset_is_checked_before_a_framework_module_runs(fake_framework, monkeypatch):
    """At interpreter start a preset name cannot be checked without importing torch: the value is kept unchecked, and
    the first framework import checks it and stops with its one line before the framework's module runs."""
    monkeypatch.setenv(activation.ENV_VAR, "k5-loss")
    activation._activate(Settings("k5-loss"), unchecked="KL_ADAPTERS='k5-loss'")
    with pytest.raises(SystemExit, match="^kl-adapters: KL_ADAPTERS='k5-loss': unknown KL preset 'k5-loss'"):
        import fakefw.losses  # noqa: F401
    assert "fakefw.losses" not in sys.modules
    with pytest.raises(SettingError, match="unknown KL preset"):  # every later use refuses too
        activation.active()


def test_deferred_refusal_is_raised_by_every_use(fake_framework, monkeypatch):
    """activate_from_env(defer=True) (the import of kl_adapters, from the .pth hook) records a refusal; active(),
    the framework import and activate_from_env() raise it; enable() and disable() replace KL_ADAPTERS and clear it."""
    monkeypatch.setenv(activation.ENV_VAR, "sequence:foo=1")
    assert activation.activate_from_env(defer=True) is None
    with pytest.raises(SettingError, match="unknown option 'foo'"):
        activation.active()
    with pytest.raises(SettingError, match="unknown option 'foo'"):
        activation.activate_from_env()
    with pytest.raises(SystemExit, match="unknown option 'foo'"):
        import fakefw.losses  # noqa: F401
    activation.enable("sequence")
    import fakefw.losses

    assert fakefw.losses.kl() == "patched:sequence"


@pytest.mark.parametrize(("value", "expected"), [
    ("sequence", Settings("sequence")),
    (" reward ", Settings("reward")),
    ("sequence:is_clip=2", Settings("sequence", 2.0)),
    ("sequence:kl_target=0.5", Settings("sequence", None, 0.5)),
    ("off", None), ("", None), ("0", None), (None, None), ("None", None),
])
def test_parse(value, expected):
    assert parse(value) == expected


@pytest.mark.parametrize(("value", "refused"), cases())
def test_table_on_parse(value, refused):
    """The one check every path makes (activation.validate through parse): a refusal names the setting as written."""
    if refused is None:
        assert parse(value) == parse(str(parse(value)))
        return
    with pytest.raises(SettingError) as error:
        parse(value, setting="--some.flag")
    check_refusal(str(error.value), refused, f"--some.flag={value!r}")


PTH_PROBE = textwrap.dedent("""
    import json, sys
    from kl_adapters import activation
    from kl_adapters.adapters import loader
    loader.ADAPTERS["fakefw"] = ("fake_adapter", ("fakefw.losses",))  # a stand-in framework's trigger
    import fakefw.losses  # a refused KL_ADAPTERS stops the run here
    print("TRAINED" + json.dumps({"active": str(activation.active()), "patched": fakefw.losses.kl()}))
""")


@pytest.fixture(scope="module")
def pth_runs(tmp_path_factory) -> dict:
    """One fresh interpreter per table value, KL_ADAPTERS set, run concurrently: the installed
    kl_adapters_autoload.pth line imports kl_adapters at start; the probe imports a stand-in framework."""
    tmp = tmp_path_factory.mktemp("pth")
    write_fake_framework(tmp)
    (tmp / "probe.py").write_text(PTH_PROBE)
    return _table.run_each([sys.executable, "probe.py"], tmp, at_once=len(TABLE))


@pytest.mark.parametrize(("value", "refused"), cases())
def test_table_through_the_pth_hook(pth_runs, value, refused):
    """KL_ADAPTERS in a fresh interpreter: accepted values patch the framework at its import; a refused one (even one
    the .pth line cannot check without torch) stops the run at the framework's import, exit status 1, with one line
    on stderr, never swallowed by Python's site module (which ignores a failing .pth line)."""
    returncode, out, err = pth_runs[value]
    if refused is None:
        assert returncode == 0, err[-2000:]
        probe = json.loads(out.split("TRAINED", 1)[1])
        assert probe == {"active": str(parse(value)), "patched": f"patched:{parse(value)}"}
        return
    assert returncode == 1 and "TRAINED" not in out and "Error processing line" not in err, (out, err)
    assert err.startswith("kl-adapters: ")
    check_refusal(err, refused, f"KL_ADAPTERS={value!r}")


def test_announce_logs_one_line_per_process(caplog):
    caplog.set_level(logging.WARNING, logger="kl_adapters")
    settings = Settings("sequence", None, 0.5)
    for _ in range(3):  # e.g. once per step
        activation.announce("pytest", "loss", settings, "beta 0.04")
    lines = [r.getMessage() for r in caplog.records if r.name == "kl_adapters"]
    assert len(lines) == 1 and lines[0].startswith("kl-adapters: preset sequence active in pytest ")
    assert lines[0].endswith("(KL path: loss; kl_target 0.5; beta 0.04)")


def test_settings_round_trip_exactly():
    settings = Settings("sequence", 1.23456789012345)
    assert parse(str(settings)) == settings


def test_config_flag_wins_over_environment(fake_framework):
    activation.enable("reward")
    assert activation.resolve("sequence", setting="flag") == Settings("sequence")
    assert activation.resolve(None, setting="flag") == Settings("reward")
    assert activation.resolve("off", setting="flag") is None


def test_ray_runtime_env_carries_the_setting(fake_framework):
    assert activation.with_kl_adapters_env({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    activation.enable("sequence")
    env = activation.with_kl_adapters_env({"env_vars": {"A": "1"}, "pip": ["x"]})
    assert env == {"env_vars": {"A": "1", "KL_ADAPTERS": "sequence"}, "pip": ["x"]}


def test_pth_hook_activates_at_startup_without_importing_torch(tmp_path):
    """The installed kl_adapters_autoload.pth line: KL_ADAPTERS set -> active at interpreter start, torch untouched,
    and no adapter loaded (the loader imports one only when its framework is imported)."""
    code = ("import sys, kl_adapters.activation as a; "
            "print('torch' in sys.modules, a.active(), any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path), "
            "sorted(m for m in sys.modules if m.startswith('kl_adapters.adapters.')))")
    env = {**os.environ, "KL_ADAPTERS": "sequence:is_clip=2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "sequence:is_clip=2.0", "True", "['kl_adapters.adapters.loader']"]
    env.pop("KL_ADAPTERS")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "None", "False", "['kl_adapters.adapters.loader']"]
