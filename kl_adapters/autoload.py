"""Activate kl-adapters from the KL_ADAPTERS environment variable, without importing torch or any framework.

Imported at interpreter start by the `kl_adapters_autoload.pth` line that the wheel installs (only when KL_ADAPTERS is
set), and by verl's plugin loader through the `verl.plugins` entry point. With KL_ADAPTERS unset it does nothing.
"""

from .activation import activate_from_env

activate_from_env()
