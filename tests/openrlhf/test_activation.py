"""Every way to switch kl-adapters on in OpenRLHF accepts and refuses the same values (tests/activation_table.py):
the launcher's --algo.kl.preset, and KL_ADAPTERS with OpenRLHF's own train_ppo_ray (its real argument parsing,
stopped before Ray starts; every value in this process as the .pth hook reads it, one value of each outcome in a
fresh interpreter); a refused KL_ADAPTERS stops OpenRLHF's import (exit 1, one line); the flags OpenRLHF renamed get
their new names; one activation line per process."""

from __future__ import annotations

import argparse
import importlib.metadata
import runpy
import sys
from pathlib import Path

import pytest

from kl_adapters import activation
from kl_adapters.activation import SettingError
from kl_adapters.adapters.openrlhf.flags import FLAG
from kl_adapters.adapters.openrlhf.renamed import RENAMED
from openrlhf_harness import base_argv, cli_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from activation_table import (FRESH, activate_as_the_hook, activation_lines, cases, check_refusal,  # noqa: E402
                              check_refused_environment, run_each)

#: the outcomes a fresh interpreter can have in OpenRLHF (a refusal at interpreter start ends like one at the import:
#: the value is refused before any framework module runs, tests/core/test_activation.py's table)
FRESH_OPENRLHF = tuple(value for outcome, value in FRESH.items() if outcome != "refused at start")


def _setting(value: str, refused: str, source: str) -> str:
    """What the refusal names: the value as written, or (a preset OpenRLHF cannot run) the flag the adapter reads."""
    return f"{FLAG} {activation.parse(value)}" if "full next-token" in refused else f"{source}={value!r}"


@pytest.mark.parametrize(("value", "refused"), cases("openrlhf"))
def test_table_on_the_launcher_flag(actor_dir, value, refused, capsys, caplog, monkeypatch):
    monkeypatch.setattr(activation, "_announced", set())
    argv = base_argv(actor_dir) + [FLAG, value]
    if refused is None:
        args = cli_args(argv, wrapper=True)
        assert args.algo.kl.preset == str(activation.parse(value))
        assert f"kl-adapters: preset {activation.parse(value).preset} active in openrlhf" in caplog.text
        return
    with pytest.raises((SystemExit, ValueError)) as error:
        cli_args(argv, wrapper=True)
    message = capsys.readouterr().err.strip().splitlines()[-1] if error.type is SystemExit else str(error.value)
    check_refusal(message, refused, _setting(value, refused, FLAG))


def activation_line(value: str) -> str:
    """The one line OpenRLHF's argument parsing logs when KL_ADAPTERS=`value` applies (its KL loss)."""
    settings = activation.parse(value)
    options = "".join(f"; {key} {getattr(settings, key):g}" for key in activation.OPTIONS
                      if getattr(settings, key) is not None)
    return (f"kl-adapters: preset {settings.preset} active in openrlhf {importlib.metadata.version('openrlhf')} "
            f"(KL path: loss{options})")


@pytest.mark.parametrize(("value", "refused"), cases("openrlhf"))
def test_table_on_kl_adapters_in_process(actor_dir, value, refused, monkeypatch, caplog):
    """KL_ADAPTERS read as the .pth hook reads it (`activate_from_env(defer=True)`), in this process, then OpenRLHF's
    own train_ppo_ray parsing its arguments: accepted values become args.algo.kl.preset (one activation line); values
    kl-adapters refuses raise their one line on every use, and the import hook would stop OpenRLHF's import with it;
    a preset OpenRLHF cannot run is refused at the argument parsing."""
    activate_as_the_hook(value, monkeypatch, caplog)
    try:
        if refused is None:
            assert cli_args(base_argv(actor_dir)).algo.kl.preset == str(activation.parse(value))
            assert activation_lines(caplog) == [activation_line(value)]
        elif "full next-token" in refused:
            with pytest.raises(ValueError) as error:
                cli_args(base_argv(actor_dir))
            check_refusal(str(error.value), refused, _setting(value, refused, activation.ENV_VAR))
        else:
            check_refused_environment(value, refused)
    finally:
        activation.disable()


PROBE = ("from openrlhf_harness import base_argv, cli_args; import sys; "
         "print('PARSED', cli_args(base_argv(sys.argv[1])).algo.kl.preset)")


@pytest.fixture(scope="module")
def environment_runs(actor_dir, tmp_path_factory) -> dict:
    """A fresh interpreter per outcome (`FRESH_OPENRLHF`) with KL_ADAPTERS set (the .pth hook reads it at start),
    running OpenRLHF's own train_ppo_ray to the end of its argument parsing (`cli_args`), all at once."""
    return run_each([sys.executable, "-c", PROBE, actor_dir], tmp_path_factory.mktemp("env"), FRESH_OPENRLHF,
                    at_once=len(FRESH_OPENRLHF))


@pytest.mark.parametrize(("value", "refused"), cases("openrlhf", FRESH_OPENRLHF))
def test_table_on_kl_adapters(environment_runs, value, refused):
    """KL_ADAPTERS with OpenRLHF's own train_ppo_ray: accepted values become args.algo.kl.preset (one activation
    line); refused ones stop the run with one line, exit 1 -- at the import of OpenRLHF's trainer (values
    kl-adapters refuses everywhere) or at its argument parsing (a preset OpenRLHF cannot run)."""
    returncode, out, err = environment_runs[value]
    if refused is None:
        assert returncode == 0 and f"PARSED {activation.parse(value)}" in out, err[-3000:]
        assert [line for line in err.splitlines() if line.startswith("kl-adapters: preset")] == [
            activation_line(value)]
        return
    assert returncode == 1 and "PARSED" not in out, (out, err[-3000:])
    check_refusal(err.strip().splitlines()[-1], refused, _setting(value, refused, activation.ENV_VAR))


def test_a_refused_kl_adapters_is_refused_by_the_launcher_too(actor_dir, monkeypatch, capsys):
    monkeypatch.setenv(activation.ENV_VAR, "sequnce")
    activation.activate_from_env(defer=True)
    with pytest.raises(SystemExit):
        cli_args(base_argv(actor_dir) + [FLAG, "sequence"], wrapper=True)
    assert "KL_ADAPTERS='sequnce': unknown KL preset" in capsys.readouterr().err
    with pytest.raises(SettingError):
        activation.active()


class _Stop(Exception):
    pass


def test_renamed_flags_are_new_flags_of_the_installed_openrlhf(monkeypatch):
    """Every new name in renamed.RENAMED is a flag of the installed train_ppo_ray, and no old one is."""
    parsers = []

    def capture(self, *args, **kwargs):
        parsers.append(self)
        raise _Stop

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", ["train_ppo_ray"])
    with pytest.raises(_Stop):
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    options = set(parsers[0]._option_string_actions)
    assert set(RENAMED.values()) <= options and not set(RENAMED) & options


def test_launcher_names_the_new_flags(actor_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_args(base_argv(actor_dir) + ["--use_kl_loss", "--init_kl_coef=0.01", "--advantage_estimator", "rloo"],
                 wrapper=True)
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("error: --use_kl_loss was renamed --algo.kl.use_loss, --init_kl_coef was renamed "
                         "--algo.kl.init_coef, --advantage_estimator was renamed --algo.advantage.estimator in "
                         "OpenRLHF 0.10.2 (dotted flags; this OpenRLHF refuses the old names)")
