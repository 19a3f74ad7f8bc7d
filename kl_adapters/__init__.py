"""kl-adapters: exact-gradient KL regularization for LLM RL trainers (TRL, verl, OpenRLHF).

Public API (stable names):
    kl_surrogate(logp, ref_logp, mask, *, preset="sequence", beta=1.0, old_logp=None, is_clip=None) -> 0-dim tensor
    kl_statistics(logp, ref_logp, mask, *, old_logp=None, group=None, task=None, eos=None) -> KLStatistics
                                                                   leave-one-out batch statistics
    TaskAdvantages(advantages, beta, normalized), EndOfSequence(prob, is_eos, horizon)   what the statistics fit to
    kl_term(...) -> KLTerm                                         one validated pass: loss term, weights, metrics
    kl_reward, kl_coefficients, sequence_kl, per_sequence_beta    KL reward tensor, gradient weights, diagnostics
    PRESETS, SAMPLED_TOKEN_PRESETS, RECOMMENDED, get_preset, Preset   the preset registry (every preset, `full` too)
    full_kl_surrogate, full_kl_surrogate_from_hidden, full_statistics   preset `full`: exact KL over the vocabulary
    enable(preset), disable(), active()                           switch the framework adapters on/off (or KL_ADAPTERS=)

Importing kl_adapters attaches the adapters' loader to the switch (`activation.attach_loader`: the loader patches
each framework as it is imported) and activates KL_ADAPTERS when it is set (`activation.activate_from_env(defer=True)`:
a refused value is recorded, and a framework import then stops the run with its one-line error). The installed
kl_adapters_autoload.pth line imports it at interpreter start when KL_ADAPTERS is set, so that no code change is
needed; names are resolved lazily so that this costs no torch import in processes that never train. This module is
the top of the package's import graph (tests/core/test_imports.py): the only module that imports both the switch and
the loader; no module of the package imports it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "kl_surrogate": "surrogate",
    "kl_reward": "surrogate",
    "kl_coefficients": "surrogate",
    "kl_term": "surrogate",
    "kl_statistics": "surrogate",
    "KLStatistics": "reductions",
    "TaskAdvantages": "reductions",
    "EndOfSequence": "reductions",
    "KLTerm": "surrogate",
    "sequence_kl": "surrogate",
    "per_sequence_beta": "surrogate",
    "PRESETS": "presets",
    "SAMPLED_TOKEN_PRESETS": "presets",
    "full_kl_surrogate": "full_vocab",
    "full_kl_surrogate_from_hidden": "full_vocab",
    "full_statistics": "full_vocab",
    "RECOMMENDED": "presets",
    "Preset": "presets",
    "get_preset": "presets",
    "enable": "activation",
    "disable": "activation",
    "active": "activation",
}
__all__ = sorted(_EXPORTS)

_activation, _loader = import_module(".activation", __name__), import_module(".adapters.loader", __name__)
_activation.attach_loader(_loader.switched_on, _loader.switched_off)
_activation.activate_from_env(defer=True)

if TYPE_CHECKING:  # pragma: no cover
    from .activation import active, disable, enable
    from .full_vocab import full_kl_surrogate, full_kl_surrogate_from_hidden, full_statistics
    from .presets import PRESETS, RECOMMENDED, SAMPLED_TOKEN_PRESETS, Preset, get_preset
    from .reductions import EndOfSequence, KLStatistics, TaskAdvantages
    from .surrogate import (KLTerm, kl_coefficients, kl_reward, kl_statistics, kl_surrogate, kl_term,
                            per_sequence_beta, sequence_kl)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'kl_adapters' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
