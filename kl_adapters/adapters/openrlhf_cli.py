"""OpenRLHF's PPO launcher with kl-adapters' flag: ``python -m kl_adapters.adapters.openrlhf_cli ARGS``.

    python -m kl_adapters.adapters.openrlhf_cli --algo.kl.preset sequence --algo.kl.use_loss ...  (train_ppo_ray args)

OpenRLHF's argparse rejects unknown flags, so this wrapper takes ``--algo.kl.preset <preset>[:is_clip=<c>]`` off the
command line (same value syntax as KL_ADAPTERS; "none" switches kl-adapters off even if KL_ADAPTERS is set), switches
kl-adapters on with it, and runs ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with every other argument unchanged.
OpenRLHF's own argument parsing then yields ``args.algo.kl.preset`` (see `kl_adapters.adapters.openrlhf.PresetFlag`),
which reaches every Ray actor with OpenRLHF's args. Pinned by tests/openrlhf/test_cli.py.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from .. import activation

TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"
FLAG = "--algo.kl.preset"
HELP = (f"{FLAG} PRESET[:is_clip=C]  kl-adapters KL configuration for OpenRLHF's KL loss (--algo.kl.use_loss: any "
        "preset, e.g. sequence) or KL reward (preset reward); 'none' disables. See `kl-adapters presets`.")


def main(argv: list[str] | None = None) -> None:
    """Strip and apply ``--algo.kl.preset``, then run OpenRLHF's train_ppo_ray with the remaining arguments."""
    parser = argparse.ArgumentParser(prog="python -m kl_adapters.adapters.openrlhf_cli", add_help=False,
                                     allow_abbrev=False)
    parser.add_argument(FLAG, dest="preset", metavar="PRESET[:is_clip=C]")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = activation.parse(known.preset)
    except ValueError as err:
        parser.error(f"{FLAG}: {err}")
    if settings is not None:
        activation.enable(settings.preset, is_clip=settings.is_clip)
    elif known.preset is not None:
        activation.disable()
    if "-h" in rest or "--help" in rest:
        print(HELP, end="\n\n")
    sys.argv = [TRAIN_MODULE, *rest]
    runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
