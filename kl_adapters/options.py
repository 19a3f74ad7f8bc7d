"""The per-batch options of the KL functions as one object (`KLOptions`): what kl_term, kl_surrogate, kl_coefficients,
kl_statistics (surrogate.py) and the full-vocabulary functions (full_vocab.py) take beside the [B, T] tensors, the
preset and beta. The public functions keep their keyword arguments; each gathers them here once, at the call, and
passes this object down. Imports nothing at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from .reductions import EndOfSequence, KLStatistics, TaskAdvantages


@dataclass(frozen=True)
class KLOptions:
    """The keyword arguments shared by the public KL functions (their docstrings state each one's meaning).

    old_logp    [B, T] log mu(y_t | y_<t) of the behaviour policy; None = on-policy
    is_clip     cap on the importance weights (lower variance, biased); None = exact
    statistics  leave-one-out statistics of a larger batch, sliced to these rows; None = fitted on this batch
    group       [B] integer ids restricting the leave-one-out to each group
    task        the trainer's task advantages the statistics are fitted with
    eos         the end-of-sequence probabilities of the termination control variate
    discount    gamma of the future-KL return (1 = the exact sequence-level KL gradient)
    """

    old_logp: Tensor | None = None
    is_clip: float | None = None
    statistics: KLStatistics | None = None
    group: Tensor | None = None
    task: TaskAdvantages | None = None
    eos: EndOfSequence | None = None
    discount: float = 1.0
