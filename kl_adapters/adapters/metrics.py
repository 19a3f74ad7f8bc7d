"""The metric names the adapters log beside each framework's own (TRL's ``kl``, verl's ``actor/kl_loss``, OpenRLHF's
``kl`` keep their names and meanings). Users' dashboards read these strings: their values never change.

What each one measures is stated where it is computed (the adapters' metric functions; the gap's formula is the core's,
`surrogate.weight_gap`); the budget's two names are defined by `kl_adapters.budget` (its `KLBudget.metrics` emits them)
and re-exported here. Imports nothing beyond `kl_adapters.budget` (pure Python).
"""

from __future__ import annotations

from ..budget import BETA_METRIC, TARGET_METRIC

#: mean per-sequence KL estimate sum_t w_{1:t} k3_t (`KLTerm.sequence_kl`); the KL budget's observation
SEQ_KL = "kl_adapters/seq_kl"
#: effective sample size of the importance weights (`KLTerm.is_ess`: 1 on-policy)
IS_ESS = "kl_adapters/is_ess"
#: sum |c_native - c_preset| / sum |c_preset|: how far the framework's own KL gradient is from the preset's (0: none);
#: computed by the core's one formula, `surrogate.weight_gap` (`KLTerm.grad_weight_gap`), in all three adapters
GRAD_WEIGHT_GAP = "kl_adapters/grad_weight_gap"
#: the KL budget's current beta and its target (`KLBudget.metrics`)
BETA, KL_TARGET = BETA_METRIC, TARGET_METRIC
