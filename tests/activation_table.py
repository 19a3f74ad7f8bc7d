"""The activation table (issue 37): values in the KL_ADAPTERS syntax, and whether kl-adapters accepts them.

One table, run on every activation path each suite's environment offers, so that every path accepts and refuses the
same values (a refusal: one line naming the setting, its value and what is valid, before training starts):
    core      `activation.parse`; KL_ADAPTERS through the installed .pth hook, a stand-in framework imported
              (tests/core/test_activation.py)
    trl       KLGRPOConfig(kl_preset=...); TrlParser's --kl_preset; KL_ADAPTERS through the .pth hook into GRPOTrainer
              (tests/trl/test_activation.py)
    verl      actor_rollout_ref.actor.kl_loss_type=kl_adapters:<value> and KL_ADAPTERS, through verl's validate_config
              (tests/verl/test_activation.py)
    openrlhf  the launcher's --algo.kl.preset; KL_ADAPTERS through the .pth hook into train_ppo_ray's argument parsing
              (tests/openrlhf/test_activation.py)
The verl and OpenRLHF paths use their KL loss (use_kl_loss / --algo.kl.use_loss), where every preset but `full` runs.

KL_ADAPTERS is read at interpreter start, so its path is also run in fresh interpreters: every value in the core
suite (a stand-in framework: no torch to import, fast); in the framework suites, which import the real framework in
each (seconds apiece), one value of each outcome a fresh interpreter can have (`FRESH`), every value running in the
suite's own process through the same `activation.activate_from_env(defer=True)` the .pth hook makes.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from kl_adapters import activation


class Row(NamedTuple):
    value: str
    #: a fragment of the refusal's one line; None: accepted
    refused: str | None
    #: framework -> its own refusal, where that framework cannot run the preset at all
    framework_refusal: dict[str, str] | None = None


_NO_FULL_LOGITS = "full next-token distributions"  # verl and OpenRLHF never hand the loss both models' logits

TABLE = (
    Row("sequence", None),
    Row("reward", None),
    Row("sequence:is_clip=2", None),
    Row("sequence:kl_target=0.5", None),
    Row("full", None, {"verl": _NO_FULL_LOGITS, "openrlhf": _NO_FULL_LOGITS}),
    Row("sequnce", "unknown KL preset 'sequnce' (did you mean 'sequence'?); valid presets: sequence, reward"),
    Row("sequence:foo=1", "unknown option 'foo'; valid options: is_clip, kl_target"),
    Row("sequence:is_clip=abc", "option is_clip needs a number"),
    Row("sequence:is_clip=0.5", "is_clip must be finite and >= 1"),
    Row("sequence:kl_target=-1", "kl_target must be a finite number > 0"),
    Row("full:is_clip=5", "is_clip does not apply to preset 'full'"),
    Row("k3-loss:is_clip=2", "preset 'k3-loss' applies no importance weights"),
    Row("k3-loss:kl_target=0.5", "preset 'k3-loss' does not follow its gradient"),
    Row("sequence:is_clip=2,kl_target=0.5", "capped importance weights"),
)


#: outcome -> one value that has it in a fresh interpreter with KL_ADAPTERS set
FRESH = {
    "accepted": "sequence:is_clip=2",  # patched at the framework's import, the activation line naming its option
    "refused at start": "sequence:foo=1",  # refused without torch by the .pth hook, raised at the framework's import
    "refused at import": "sequnce",  # kept unchecked at start (no torch), refused by the preset registry's checks
    "refused by the framework": "full",  # accepted by kl-adapters, refused by an adapter that cannot run it
}


def expected(row: Row, framework: str | None = None) -> str | None:
    """The refusal fragment of `row` in `framework` (None: accepted)."""
    return (row.framework_refusal or {}).get(framework, row.refused)


def cases(framework: str | None = None, values: tuple[str, ...] | None = None) -> list:
    """pytest parameters (value, refusal fragment or None), one per row (of `values` only, when given), with the value
    as id."""
    return [pytest.param(row.value, expected(row, framework), id=row.value) for row in TABLE
            if values is None or row.value in values]


def check_refusal(message: str, fragment: str, setting: str) -> None:
    """A refusal is one line that names the setting and holds the row's fragment."""
    assert "\n" not in message.strip(), message
    assert setting in message and fragment in message, message


def check_refused_environment(value: str, fragment: str) -> None:
    """KL_ADAPTERS=`value`, read in this process as the .pth hook reads it, is refused: every use raises its one line,
    and the import hook would stop a framework's import with that line (SystemExit, exit status 1)."""
    from kl_adapters import activation
    from kl_adapters.adapters import loader

    with pytest.raises(activation.SettingError) as error:
        activation.active()
    check_refusal(str(error.value), fragment, f"KL_ADAPTERS={value!r}")
    with pytest.raises(SystemExit, match=f"^kl-adapters: KL_ADAPTERS={value!r}"):
        loader._exit_if_refused()


def run_each(command: list[str], cwd: Path, values: tuple[str, ...] | None = None,
             at_once: int = 4) -> dict[str, tuple[int, str, str]]:
    """value -> (exit status, stdout, stderr) of `command` in a fresh interpreter per table value (of `values` only,
    when given), with KL_ADAPTERS set to it (the installed kl_adapters_autoload.pth line reads it at interpreter
    start); `at_once` at a time."""
    base = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    values, results = [row.value for row in TABLE if values is None or row.value in values], {}
    for start in range(0, len(values), at_once):
        running = {value: subprocess.Popen(command, cwd=cwd, env={**base, "KL_ADAPTERS": value}, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for value in values[start:start + at_once]}
        results.update({value: (proc.wait(timeout=600), *proc.communicate()) for value, proc in running.items()})
    return results


def activate_as_the_hook(value: str, monkeypatch, caplog) -> None:
    """KL_ADAPTERS=`value` read in this process as the .pth hook reads it (`activation.activate_from_env(defer=True)`),
    with the activation lines already announced forgotten and kl_adapters' warnings captured; undo with
    `activation.disable()`."""
    monkeypatch.setenv(activation.ENV_VAR, value)
    monkeypatch.setattr(activation, "_announced", set())
    caplog.set_level(logging.WARNING, logger="kl_adapters")
    activation.activate_from_env(defer=True)


def activation_lines(caplog) -> list[str]:
    """The "kl-adapters: preset ... active" lines logged so far."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("kl-adapters: preset")]
