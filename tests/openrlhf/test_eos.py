"""pi(EOS | y_<t) from the policy's own forward (adapters/openrlhf/eos.py: Actor.forward and its log_probs_from_logits),
and the tensor that carries it from the rollout forward to make_experience (eos_payload.LogProbsWithEos)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import kl_adapters
from kl_adapters.adapters.openrlhf.eos_payload import EosPayload, LogProbsWithEos, split_eos, with_eos
from openrlhf_cpu_shim import EOS, load_actor, random_batch
from openrlhf_harness import softmax_eos


@pytest.fixture(autouse=True)
def _policy_process():
    """A PolicyModelActor's process: it imports ppo_actor, which is when kl-adapters patches the Actor."""
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401


@pytest.fixture(scope="module")
def batch():
    """Four ragged responses; three end with EOS, one is cut at the longest length."""
    sequences, attention_mask, action_mask = random_batch(4, 4, [5, 3, 5, 4], seed=0)
    for b, n in enumerate([5, 3, 5, 4]):
        if b:
            sequences[b, 4 + n - 1] = EOS
    return sequences, attention_mask, action_mask


def rollout_forward(actor, batch):
    """What PolicyModelActor.forward runs at rollout time: the actor in eval mode, without gradient."""
    sequences, attention_mask, action_mask = batch
    with torch.no_grad():
        return actor(sequences, action_mask, attention_mask)


@pytest.mark.compat
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_eos_probabilities_are_a_separate_forwards_softmax(actor_dir, batch, temperature):
    """Under a reduced preset the rollout forward returns OpenRLHF's log-probs bit for bit, carrying pi(EOS | y_<t) =
    softmax(logits / temperature)[EOS] of a separate forward at every action position (float32 rounding) and
    y_t == EOS; the logits are OpenRLHF's own (0.10.4 / 0.11.0 scale them inside log_probs_from_logits, later releases
    before it)."""
    actor = load_actor(actor_dir)
    actor.temperature = temperature
    native = rollout_forward(actor, batch)
    kl_adapters.enable("sequence")
    ours = rollout_forward(actor, batch)
    assert type(native) is torch.Tensor and isinstance(ours, LogProbsWithEos)
    log_probs, eos = split_eos(ours)
    assert type(log_probs) is torch.Tensor and torch.equal(log_probs, native)
    expected = softmax_eos(actor, *batch)
    torch.testing.assert_close(eos.prob, expected.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(eos.is_eos, expected.is_eos) and eos.is_eos.sum() == 3


@pytest.mark.parametrize("preset", [None, "none", "sequence-plain", "reward-plain", "k3-loss"])
def test_no_payload_without_a_reduced_preset(actor_dir, batch, preset):
    """kl-adapters off, or a preset without batch statistics: the forward returns OpenRLHF's plain tensor."""
    actor = load_actor(actor_dir)
    native = rollout_forward(actor, batch)
    if preset not in (None, "none"):
        kl_adapters.enable(preset)
    ours = rollout_forward(actor, batch)
    assert type(ours) is torch.Tensor and torch.equal(ours, native)


def test_payload_survives_to_and_pickling():
    """The payload rides on `.to` (PolicyModelActor.forward's ``.to("cpu")``), pickling (Ray's transport of a tensor
    subclass) and deepcopy; every other operation gives OpenRLHF a plain tensor."""
    gen = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(2, 3, generator=gen)
    payload = EosPayload(torch.rand(2, 3, generator=gen), torch.rand(2, 3, generator=gen) > 0.5)
    carried = with_eos(log_probs, payload)
    for moved in (carried.to("cpu"), carried.to(torch.float32), pickle.loads(pickle.dumps(carried.to("cpu"))),
                  copy.deepcopy(carried)):
        plain, eos = split_eos(moved)
        assert type(plain) is torch.Tensor and torch.equal(plain, log_probs)
        assert torch.equal(eos.prob, payload.prob) and torch.equal(eos.is_eos, payload.is_eos)
    for result in (carried * 2, carried[:, 1:], carried - log_probs, carried.sum(-1), torch.cat([carried, carried])):
        assert type(result) is torch.Tensor
    assert split_eos(log_probs) == (log_probs, None)
