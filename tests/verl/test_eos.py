"""pi(EOS | y_<t) for the termination control variate, from the logits verl's FSDP engine already makes: the adapter's
`end_of_sequence_probabilities` reads two gathers per token beside verl's own logprobs_from_logits (no second pass over
the vocabulary, no second forward); the end-of-sequence ids come from the engine's model config. Through the real
engine (compute_log_prob's forward and the training forward) against a separate forward: tests/verl/test_engine.py.
"""

import types

import pytest
import torch

from kl_adapters.adapters import verl as verl_adapter
from kl_adapters.adapters.verl import eos as verl_eos
from kl_adapters.adapters.verl.state import EOS_REQUEST, EosRequest


def verl_log_probs(logits, labels):
    """verl's own logprobs_from_logits (the FSDP engine's binding, unwrapped)."""
    from verl.workers.engine.fsdp import transformer_impl

    return transformer_impl.logprobs_from_logits.__kl_adapters_original__(logits, labels)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("eos_ids", [(2,), (0, 5)])
def test_eos_probabilities_are_the_softmax(dtype, rtol, eos_ids):
    """= softmax(logits)[eos_ids].sum(-1) of the same logits (the rollout temperature is already in them), to the
    rounding of verl's log-probs, which they inherit: float32, or without flash-attn's cross entropy on bf16 logits
    verl's bf16 log_softmax (2^-8 relative on log-probs ~ -5 here: a few % on the probability); is_eos = labels in
    eos_ids."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(40, 97, generator=gen)).to(dtype)
    labels = torch.randint(0, 97, (40,), generator=gen)
    labels[::7] = eos_ids[-1]
    prob, is_eos = verl_adapter.end_of_sequence_probabilities(logits, labels, verl_log_probs(logits, labels), eos_ids)
    expected = logits.double().softmax(-1)[:, list(eos_ids)].sum(-1)
    torch.testing.assert_close(prob.double(), expected, rtol=rtol, atol=1e-7)
    assert prob.dtype == torch.float32 and not prob.requires_grad
    assert torch.equal(is_eos, torch.isin(labels, torch.tensor(eos_ids))) and is_eos.sum() >= 6


def test_the_wrapped_log_probs_are_verls():
    """Under a reduced preset's forward, verl's logprobs_from_logits result is returned untouched (and its gradient)."""
    from verl.workers.engine.fsdp import transformer_impl

    logits = torch.randn(12, 31, generator=torch.Generator().manual_seed(1), requires_grad=True)
    labels = torch.arange(12) % 31
    with EOS_REQUEST.bound(EosRequest((3,))) as request:
        ours = transformer_impl.logprobs_from_logits(logits, labels)
    record = request.record
    theirs = verl_log_probs(logits, labels)
    assert torch.equal(ours, theirs) and record is not None
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), logits)
    assert torch.equal(g_ours, g_theirs)


@pytest.mark.parametrize("generation, tokenizer, expected", [
    (2, 2, (2,)), ([2, 7], 2, (2, 7)), (None, 5, (5,)), ([], None, ()), (None, None, ())])
def test_eos_ids_are_the_generation_config_and_tokenizer_ones(generation, tokenizer, expected):
    """The ids verl's rollout stops at: HFModelConfig.generation_config.eos_token_id (one id or a list, e.g. Llama 3's
    end-of-turn ids) and the tokenizer's eos_token_id."""
    config = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=generation),
                                   tokenizer=types.SimpleNamespace(eos_token_id=tokenizer))
    assert verl_adapter.eos_token_ids(config) == expected
    assert verl_adapter.eos_token_ids(types.SimpleNamespace(generation_config=None, tokenizer=None)) == ()


def test_only_a_reduced_preset_asks_for_them():
    """The engine adds nothing to model_output unless the actor's loss selects a preset with batch statistics."""
    import functools

    from verl_cases import actor_config
    from verl.workers.utils import losses

    def wants(**config):
        return verl_eos._wants_eos(functools.partial(losses.ppo_loss, config=actor_config(**config)))

    assert wants(kl_loss_type="kl_adapters:sequence") and wants(kl_loss_type="kl_adapters:reward")
    assert not wants(kl_loss_type="kl_adapters:sequence-plain") and not wants(kl_loss_type="low_var_kl")
    assert not wants(kl_loss_type="kl_adapters:sequence", use_kl_loss=False)
    assert not verl_eos._wants_eos(None) and not verl_eos._wants_eos(lambda **kw: None)
