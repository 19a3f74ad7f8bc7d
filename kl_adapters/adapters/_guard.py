"""Version guard shared by the adapters: refuse to patch a framework version the tests have not run against."""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from .versions import TESTED, supported_range

#: set to 1 to patch an untested framework version anyway (a warning is emitted instead of the error)
ALLOW_UNTESTED_ENV = "KL_ADAPTERS_ALLOW_UNTESTED"


class UnsupportedFrameworkError(RuntimeError):
    """The installed framework version, or a code path it was asked to run, is not one kl-adapters is tested with."""


def require_version(distribution: str) -> str:
    """Return the installed version of `distribution` if it is one of `versions.TESTED[distribution]`, else raise.

    The error names the tested releases. With KL_ADAPTERS_ALLOW_UNTESTED=1 an untested version only warns.
    """
    version = importlib.metadata.version(distribution)
    if version in TESTED[distribution]:
        return version
    message = (f"kl-adapters supports {supported_range(distribution)} (the releases its tests run against); found "
               f"{distribution}=={version}. Install a supported version, or set {ALLOW_UNTESTED_ENV}=1 to patch an "
               "untested version at your own risk.")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return version
    raise UnsupportedFrameworkError(message)


def refuse_untested_path(message: str) -> None:
    """UnsupportedFrameworkError(`message`) for a framework code path the CPU tests cannot run; with
    KL_ADAPTERS_ALLOW_UNTESTED=1 a RuntimeWarning instead (the run goes on)."""
    message = f"{message}; set {ALLOW_UNTESTED_ENV}=1 to run it anyway"
    if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedFrameworkError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
