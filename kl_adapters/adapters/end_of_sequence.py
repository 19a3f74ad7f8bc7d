"""One end-of-sequence reader for the adapters: which token ids end a response, and pi(EOS | y_<t) from the logits a
framework's own forward already made (the reduced presets' termination control variate, `reductions.EndOfSequence`).

Each adapter knows where its framework keeps the ids (TRL's trainer, verl's HFModelConfig, OpenRLHF's Actor) and
hands those objects to `eos_token_ids`; verl and OpenRLHF hand the logits and log-probs of their log-prob function to
`eos_probabilities` (TRL reads pi(EOS) from the hidden state instead: adapters/trl/eos.py, `_eos_gap`). Any fixed set of ids
keeps the control variate exact (it is zero-mean for the event "y_t is one of these ids"); the ids the framework stops
at make it effective.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def token_ids(*values: int | Iterable[int] | None) -> tuple[int, ...]:
    """The sorted union of ids given in transformers' forms of ``eos_token_id``: an id, a list of ids, or None."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def eos_token_ids(*sources: object) -> tuple[int, ...]:
    """The sorted union of the ``eos_token_id`` of each source (a generation config, a tokenizer, a model config; a
    source that is None or has none adds nothing). () when none is set."""
    return token_ids(*(getattr(source, "eos_token_id", None) for source in sources))


def eos_probabilities(logits: Tensor, labels: Tensor, log_probs: Tensor, eos_ids: Tensor | Sequence[int]) -> Tensor:
    """pi(EOS | prefix) [...] summed over `eos_ids`, at every position of `logits` [..., V], given log_probs =
    log softmax(logits) at `labels` [...], which the framework's own log-prob function has just computed from these
    logits (at its temperature): the log-normaliser is z_label - log_probs, so log pi(EOS) = logsumexp(z_EOS) -
    (z_label - log_probs), two gathers per token and no second pass over the vocabulary. Float32, detached, in [0, 1];
    as precise as the framework's log-probs (bf16 where it computes bf16 log-softmax). Pinned by
    tests/verl/test_eos.py::test_eos_probabilities_are_the_softmax and
    tests/openrlhf/test_eos.py::test_eos_probabilities_are_a_separate_forwards_softmax."""
    with torch.no_grad():
        z, ids = logits.detach(), torch.as_tensor(eos_ids, device=logits.device)
        log_norm = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float() - log_probs.detach().float()
        return torch.exp(torch.logsumexp(z.index_select(-1, ids).float(), -1) - log_norm).clamp(0.0, 1.0)
