"""verl's plugin entry point for kl-adapters (``[project.entry-points."verl.plugins"]``).

``verl/__init__`` imports this module in every process that imports verl -- the Hydra driver, the TaskRunner, every
actor/ref/critic worker, on every node where kl-adapters is installed -- unless VERL_USE_EXTERNAL_PLUGINS excludes it
(then ``actor_rollout_ref.model.external_lib=kl_adapters.adapters.verl_plugin`` imports it in the TaskRunner and the
workers instead). Importing it:
  1. activates KL_ADAPTERS from the environment, as importing kl_adapters does (read again here: a driver may set it
     after importing kl_adapters); a refused value then stops the first import of a patched verl module with its one
     line (`kl_adapters.activation`), since verl's plugin loader would swallow an error raised here;
  2. patches verl's KL modules (the "verl" triggers of `kl_adapters.adapters.loader.ADAPTERS`) when they are imported, or at
     once if they already are, so that a verl config naming ``kl_adapters:<preset>`` works without the environment
     variable. The wrappers run verl's own functions unchanged unless a flag selects a preset
     (tests/verl/test_activation.py::test_entry_point_patches_inertly).
verl swallows plugin errors at DEBUG level, so problems are logged here as warnings; an unsupported verl version then
stays unpatched (a kl_adapters: name is still refused by verl itself, and an explicit KL_ADAPTERS activation raises
through `kl_adapters.activation`). Imports neither torch nor verl.
"""

from __future__ import annotations

import logging

from .. import activation
from . import loader
from ._guard import require_version

_log = logging.getLogger("kl_adapters")


def install() -> None:
    """Activate from KL_ADAPTERS and arm the patching of verl's trigger modules (idempotent)."""
    activation.activate_from_env(defer=True)
    try:
        require_version("verl")
    except Exception as exc:  # noqa: BLE001 - UnsupportedFrameworkError, or verl metadata missing
        _log.warning("kl-adapters: verl adapter inactive: %s", exc)
        return
    loader.arm("verl")


install()
