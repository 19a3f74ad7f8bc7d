"""Activate kl-adapters from the KL_ADAPTERS environment variable, without importing torch or any framework.

Imported at interpreter start by the `kl_adapters_autoload.pth` line that the wheel installs (only when KL_ADAPTERS is
set). With KL_ADAPTERS unset it does nothing. (verl's plugin loader imports `kl_adapters.adapters.verl_plugin`.)
"""

from .activation import activate_from_env

activate_from_env()
