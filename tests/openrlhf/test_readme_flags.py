"""README.md's "Turn it on" table, OpenRLHF row, runs as written: its command is read from the README (nothing
hard-coded here), its flags appended to a small train_ppo_ray argument list and parsed by the launcher it names,
through OpenRLHF's real argument parsing (`openrlhf_harness.cli_args`, as test_cli.py does); the preset it names is
what gets activated, on the KL-loss path."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kl_adapters import activation
from kl_adapters.adapters import openrlhf as adapter
from openrlhf_harness import base_argv, cli_args

README = Path(__file__).resolve().parents[2] / "README.md"
LAUNCHER = "python -m kl_adapters.adapters.openrlhf_cli"
PLACEHOLDER = "<your train_ppo_ray arguments>"


def readme_command() -> str:
    """The first code span of the OpenRLHF row of README.md's "## Turn it on" table."""
    section = README.read_text().split("## Turn it on", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if line.startswith("| OpenRLHF |")]
    return re.search(r"`([^`]+)`", row).group(1)


def readme_flags() -> list[str]:
    """The flags the OpenRLHF row adds after the user's own train_ppo_ray arguments."""
    command = readme_command()
    assert command.startswith(f"{LAUNCHER} {PLACEHOLDER}"), command
    return shlex.split(command.removeprefix(f"{LAUNCHER} {PLACEHOLDER}"))


def test_readme_openrlhf_row_activates_its_preset(actor_dir):
    flags = readme_flags()
    preset = flags[flags.index(adapter.FLAG) + 1]
    user_args = [a for a in base_argv(actor_dir) if a not in flags]  # the user's own arguments, the row's flags apart
    args = cli_args(user_args + flags, wrapper=True)
    assert isinstance(args.algo.kl.preset, adapter.PresetFlag) and args.algo.kl.preset == preset
    assert str(activation.active()) == preset
    assert args.algo.kl.use_loss == ("--algo.kl.use_loss" in flags)
    assert "ActorPPOTrainer.training_step" in adapter.patched()
