"""Version guard shared by the adapters: refuse to patch a framework version the tests have not run against."""

from __future__ import annotations

import importlib.metadata
import os
import warnings

#: set to 1 to patch an untested framework version anyway (a warning is emitted instead of the error)
ALLOW_UNTESTED_ENV = "KL_ADAPTERS_ALLOW_UNTESTED"


class UnsupportedFrameworkError(RuntimeError):
    """The installed framework version, or a code path it was asked to run, is not one kl-adapters is tested with."""


def require_version(distribution: str, supported: str) -> str:
    """Return the installed version of `distribution` if it satisfies the PEP 440 specifier `supported`, else raise.

    The error names the supported range. With KL_ADAPTERS_ALLOW_UNTESTED=1 an untested version only warns.
    """
    from packaging.specifiers import SpecifierSet  # every supported framework depends on `packaging`

    version = importlib.metadata.version(distribution)
    if version in SpecifierSet(supported):
        return version
    message = (f"kl-adapters supports {distribution}{supported} (the versions its tests run against); found "
               f"{distribution}=={version}. Install a supported version, or set {ALLOW_UNTESTED_ENV}=1 to patch an "
               "untested version at your own risk.")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return version
    raise UnsupportedFrameworkError(message)
