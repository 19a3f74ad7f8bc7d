"""TRL adapter, generation: ``GRPOTrainer._generate_and_score_completions`` with each row's prompt group and, where TRL
has the generation batch's log-probs, its rollout statistics (`statistics.rollout_statistics`) stored in the batch."""

from __future__ import annotations

import functools

from ..patching import overriding
from .budget import _apply_budget
from .eos import RECORDING, Recording, rollout_end_of_sequence
from .flags import settings_for
from .inputs import GROUP_KEY, ROLLOUT_STATISTICS_KEYS
from .statistics import group_ids, rollout_statistics


def _generate_with_statistics(original, self, generation_batch):
    """GRPOTrainer._generate_and_score_completions, plus, when a preset with batch statistics is active, each row's
    prompt group (GROUP_KEY) and the rollout statistics in its output (`statistics.rollout_statistics`, from the
    forwards `eos.RECORDING` saw); unchanged otherwise."""
    settings = settings_for(self)
    _apply_budget(self)
    if self.beta == 0.0 or settings is None or not settings.spec.uses_batch_statistics:
        return original(self, generation_batch)
    if settings.spec.needs_full_logits:
        with overriding(self, "beta", 0.0):  # TRL skips its reference pass: `full` runs the reference at loss time
            batch = original(self, generation_batch)
    else:
        with RECORDING.bound(Recording(self)) as recorded:
            batch = original(self, generation_batch)
        eos = rollout_end_of_sequence(self, batch, recorded.seen)
        statistics = rollout_statistics(self, batch, settings.spec, eos)
        if statistics is not None:
            for field, key in ROLLOUT_STATISTICS_KEYS.items():
                batch[key] = getattr(statistics, field)
    rows = batch["completion_ids"]
    batch[GROUP_KEY] = group_ids(self, rows.shape[0]).to(rows.device)
    return batch


def _kl_generate(original):
    @functools.wraps(original)
    def generate_and_score_completions(self, generation_batch):
        return _generate_with_statistics(original, self, generation_batch)

    return generate_and_score_completions
