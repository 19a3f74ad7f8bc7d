"""TRL adapter: GRPOTrainer (and GMPOTrainer) get an exact-gradient KL term; RLOOTrainer is checked, not patched.

Flag (TRL's idiom, a config field): ``KLGRPOConfig(kl_preset="sequence", beta=0.04, ...)`` in place of ``GRPOConfig``
(``--kl_preset sequence`` with ``TrlParser``), or, with no code change, ``KL_ADAPTERS=sequence`` /
``kl_adapters.enable("sequence")``; the config field wins. Unset: TRL runs its own code, unchanged (the wrappers fall
through to TRL's methods).

Modules (the sections of the former adapters/trl.py; names with a leading underscore are the package's own):
    flags         the settings a trainer runs with (`settings_of`, `field_settings`) and their refusals
    config        `KLGRPOConfig`, the flag as GRPOConfig fields
    trainer_init  GRPOTrainer.__init__ under the settings (budget, refusals, the activation line); RLOOTrainer's check
    loss          the loss: TRL's KL term replaced by the preset's, and the metrics beside TRL's
    aggregation   TRL's per-token normaliser D, which the KL term shares, and the code paths refused
    inputs        what the adapter reads of TRL's batch dict (mask, behaviour log-probs, stored statistics)
    statistics    the reduced presets' batch statistics and what they are fitted with (task, groups, pi(EOS))
    rollout       generation: each row's prompt group and the rollout statistics stored in the batch
    eos           pi(EOS | y_<t) from the policy forward TRL already runs (`eos.RECORDING`)
    data_parallel the loss-time statistics over every process's rows
    full          preset ``full``: the exact KL over the vocabulary from both models' hidden states
    budget        the KL budget (`KLBudgetCallback`)
    sites         what is patched (`SITES`) and `patch` / `unpatch`, through the adapters' shared `patching`

What is patched (`SITES`): ``GRPOTrainer.compute_loss`` (`loss._compute_loss_with_kl`: TRL's policy loss with
``beta = 0`` for the call, then the preset's ``kl_term`` on the log-probs of the same forward, its surrogate added),
``GRPOTrainer._generate_and_score_completions`` (`rollout`), ``GRPOTrainer._get_per_token_logps_and_entropies``
(`eos._record_forwards`: records the forwards the two wrappers above ask for, inside their call only),
``GRPOTrainer.__init__`` and ``RLOOTrainer.__init__`` (`trainer_init`). Three hops from the flag to the KL: the
settings (`flags.settings_for`) -> compute_loss's wrapper -> ``kl_term``. TRL's ``beta`` is the one attribute the
adapter changes for the extent of a call (`patching.overriding`): TRL's _compute_loss reads it to decide whether to add
its own KL term, and no narrower patch point than that attribute exists short of copying _compute_loss.

Pinned by tests/trl/test_grpo_gradients.py, test_statistics.py, test_task_and_eos.py, test_data_parallel.py,
test_full.py, test_budget.py, test_long_horizon.py, test_activation.py, test_rloo.py and test_guards.py.
"""

from __future__ import annotations

import logging

from ..metrics import SEQ_KL
from .aggregation import per_token_normaliser
from .budget import KLBudgetCallback, budget_of, check_budget, observe_budget
from .config import KLGRPOConfig
from .eos import end_of_sequence, eos_token_ids
from .flags import BUDGET_START_BETA, discount_of, field_settings, settings_for, settings_of, start_budget
from .inputs import GROUP_KEY, ROLLOUT_STATISTICS_KEYS, behaviour_logps, rollout_logps, statistics_of
from .sites import SITES, patch, unpatch
from .statistics import advantages_normalized, group_ids, rollout_statistics, statistics_inputs, task_advantages

__all__ = ["BUDGET_START_BETA", "GROUP_KEY", "KLBudgetCallback", "KLGRPOConfig", "ROLLOUT_STATISTICS_KEYS", "SEQ_KL",
           "SITES", "advantages_normalized", "behaviour_logps", "budget_of", "check_budget", "discount_of",
           "end_of_sequence", "eos_token_ids", "field_settings", "group_ids", "observe_budget", "patch",
           "per_token_normaliser", "rollout_logps", "rollout_statistics", "settings_for", "settings_of",
           "start_budget", "statistics_inputs", "statistics_of", "task_advantages", "unpatch"]

#: the package's logger (its modules log through children of it)
logger = logging.getLogger(__name__)
