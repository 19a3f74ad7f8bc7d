"""TRL adapter, what is patched (`SITES`, installed through the adapters' shared `patching`) and `patch` / `unpatch`."""

from __future__ import annotations

import sys

from ... import activation
from .._guard import require_version
from ..patching import Site, install, uninstall
from .eos import _record_forwards
from .loss import _kl_compute_loss
from .rollout import _kl_generate
from .trainer_init import _check_rloo, _checked_init


_GRPO_MODULE = "trl.trainer.grpo_trainer"
_RLOO_MODULE = "trl.trainer.rloo_trainer"


#: module -> the TRL methods patched (every release of versions.TESTED["trl"] has these leading parameters)
SITES: dict[str, tuple[Site, ...]] = {
    _GRPO_MODULE: (
        Site("compute_loss", ("self", "model", "inputs", "return_outputs", "num_items_in_batch"), _kl_compute_loss,
             owner="GRPOTrainer"),
        Site("_generate_and_score_completions", ("self", "inputs"), _kl_generate, owner="GRPOTrainer"),
        Site("__init__", ("self", "model", "reward_funcs", "args"), _checked_init, owner="GRPOTrainer"),
        # 1.14.x: (self, model, *args, batch_size=None, compute_aux_loss=False, **kwargs), which TRL calls with the same
        # leading positional arguments (model, input_ids, attention_mask, logits_to_keep) as 1.15.0 / 1.16.0
        Site("_get_per_token_logps_and_entropies", ("self", "model", "input_ids", "attention_mask", "logits_to_keep"),
             _record_forwards, owner="GRPOTrainer",
             params_in=dict.fromkeys(("1.14.0", "1.14.1", "1.14.2"), ("self", "model", "args"))),
    ),
    _RLOO_MODULE: (Site("__init__", ("self", "model", "reward_funcs", "args"), _check_rloo, owner="RLOOTrainer"),),
}


def patch(trigger: str) -> None:
    """Install the wrappers (idempotent); they fall through to TRL's code while no preset is set.

    Refuses trl versions outside versions.TESTED, methods whose signature is not the tested one
    (`patching.install`), and a refused KL_ADAPTERS (`activation.check_environment`). `trigger` is the TRL module just
    imported (see loader.ADAPTERS); GRPOTrainer is patched whichever it is, RLOOTrainer once its module is loaded.
    """
    activation.check_environment()
    version = require_version("trl")
    install("trl", version, _GRPO_MODULE, SITES[_GRPO_MODULE])
    rloo = sys.modules.get(_RLOO_MODULE)
    if rloo is not None and hasattr(rloo, "RLOOTrainer"):
        install("trl", version, _RLOO_MODULE, SITES[_RLOO_MODULE])


def unpatch() -> None:
    """Restore TRL's original methods."""
    uninstall("trl")
