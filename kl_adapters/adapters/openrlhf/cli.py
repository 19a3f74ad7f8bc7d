"""OpenRLHF's PPO launcher with kl-adapters' flag: ``python -m kl_adapters.adapters.openrlhf_cli ARGS``.

    python -m kl_adapters.adapters.openrlhf_cli --algo.kl.preset sequence --algo.kl.use_loss ...  (train_ppo_ray args)

OpenRLHF's argparse rejects unknown flags, so this wrapper takes ``--algo.kl.preset <preset>[:is_clip=<c>]`` off the
command line (same value syntax as KL_ADAPTERS; "none" switches kl-adapters off even if KL_ADAPTERS is set), and
``--algo.kl.seq_target <nats>``, a KL budget (kl_adapters.budget: beta, starting at --algo.kl.init_coef, follows so that
KL(pi || pi_ref) per sequence tracks it; the same as the preset value's ``kl_target=``; OpenRLHF's own
``--algo.kl.target`` targets a per-token KL), switches kl-adapters on with them, and runs ``openrlhf.cli.train_ppo_ray``
as ``__main__`` with every other argument unchanged.
OpenRLHF's own argument parsing then yields ``args.algo.kl.preset`` (see `kl_adapters.adapters.openrlhf.PresetFlag`),
which reaches every Ray actor with OpenRLHF's args. Refused before OpenRLHF runs, with argparse's usage and one line
(exit status 2): what `kl_adapters.activation.validate` refuses on every path, a refused KL_ADAPTERS in the launcher's
environment, and the flags OpenRLHF renamed (`renamed.RENAMED`: the new name). Pinned by
tests/openrlhf/test_cli.py and tests/openrlhf/test_activation.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys

from ... import activation
from .flags import FLAG, TARGET_FLAG
from .renamed import renamed_hint


TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"


HELP = (f"{FLAG} PRESET[:is_clip=C]  kl-adapters KL configuration for OpenRLHF's KL loss (--algo.kl.use_loss: any "
        "preset, e.g. sequence) or KL reward (preset reward); 'none' disables. See `kl-adapters presets`.\n"
        f"{TARGET_FLAG} NATS  kl-adapters KL budget: beta starts at --algo.kl.init_coef and follows so that "
        "KL(pi || pi_ref) per sequence tracks NATS (--algo.kl.target is OpenRLHF's per-token controller).")


def main(argv: list[str] | None = None) -> None:
    """Strip and apply ``--algo.kl.preset`` and ``--algo.kl.seq_target``, then run OpenRLHF's train_ppo_ray with the
    remaining arguments."""
    parser = argparse.ArgumentParser(prog="python -m kl_adapters.adapters.openrlhf_cli", add_help=False,
                                     allow_abbrev=False)
    parser.add_argument(FLAG, dest="preset", metavar="PRESET[:is_clip=C]")
    parser.add_argument(TARGET_FLAG, dest="seq_target", type=float, metavar="NATS")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    hint = renamed_hint(rest)
    if hint:
        parser.error(hint)
    try:  # a budget for the flag's preset, or for KL_ADAPTERS' without the flag
        activation.check_environment()
        settings = activation.parse(known.preset, setting=FLAG)
        settings = with_target(settings if known.preset is not None else activation.active(), known.seq_target)
    except ValueError as err:
        parser.error(str(err))
    if settings is not None:
        activation.enable(settings.preset, is_clip=settings.is_clip, kl_target=settings.kl_target)
    elif known.preset is not None:
        activation.disable()
    if "-h" in rest or "--help" in rest:
        print(HELP, end="\n\n")
    sys.argv = [TRAIN_MODULE, *rest]
    runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)


def with_target(settings: activation.Settings | None, seq_target: float | None) -> activation.Settings | None:
    """The preset's settings with --algo.kl.seq_target as their kl_target; ValueError (one line) for a target without a
    preset (no KL term to adjust) or two different targets."""
    if seq_target is None:
        return settings
    if settings is None:
        raise ValueError(f"{TARGET_FLAG} {seq_target} needs {FLAG} (a KL preset whose beta it adjusts, e.g. sequence)")
    if settings.kl_target is not None and settings.kl_target != seq_target:
        raise ValueError(f"two KL budgets: {FLAG} {settings} and {TARGET_FLAG} {seq_target}; give one")
    return activation.checked(dataclasses.replace(settings, kl_target=seq_target),
                              f"{FLAG} {settings} {TARGET_FLAG} {seq_target:g}")


if __name__ == "__main__":
    main()
