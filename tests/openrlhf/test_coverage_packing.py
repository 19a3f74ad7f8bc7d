"""--ds.packing_samples (the OpenRLHF example scripts' setting; docs/coverage.md): OpenRLHF's replay buffer and
Actor.forward pack each micro-batch's rows into one row (padding removed, position ids restarting per sequence), and
the adapter reads pi(EOS | y_<t) from that packed forward and pads it back with OpenRLHF's own indices. Identity pinned:
with the flag on (``sequence``, a preset with batch statistics and the termination control variate), every optimizer
step's gradient and kl-adapters' metrics are those of the same rows unpacked (test_loss_path.py's setup: 8 ragged rows,
micro-batches of 2, 2 epochs, off-policy). CPU: flash-attn's padding helpers are the index operations of
cpu_stubs/flash_attn/bert_padding.py and transformers' eager attention masks each packed sequence by its positions."""

from __future__ import annotations

import copy

import openrlhf_cpu_shim
import pytest
import torch
from openrlhf_harness import base_argv, batch_statistics, cli_args, loss_path_batch, ppo_train_on

import kl_adapters
from kl_adapters.adapters import openrlhf as adapter

LOAD_ACTOR = openrlhf_cpu_shim.load_actor


@pytest.fixture(scope="module")
def args(actor_dir):
    return cli_args(base_argv(actor_dir))


@pytest.fixture(scope="module")
def batch(actor_dir, ref_dir):
    return loss_path_batch(actor_dir, ref_dir)


def run(args, actor_dir, batch, packed: bool, monkeypatch):
    """ppo_train_on with --ds.packing_samples set as OpenRLHF sets it (replay buffer and Actor); the leading size of
    every input the model sees."""
    args = copy.deepcopy(args)
    args.ds.packing_samples = packed
    rows = []

    def load_actor(path, dtype=torch.float32):
        actor = LOAD_ACTOR(path, dtype)
        actor.packing_samples = packed
        actor.model.register_forward_pre_hook(lambda m, a, kw: rows.append(int((a or [kw["input_ids"]])[0].shape[0])),
                                              with_kwargs=True)
        return actor

    monkeypatch.setattr(openrlhf_cpu_shim, "load_actor", load_actor)
    trainer, steps, _ = ppo_train_on(args, actor_dir, batch, statistics=batch_statistics(batch))
    return trainer, steps, rows


def test_packed_rows_give_the_unpacked_gradient_and_statistics(args, actor_dir, batch, cpu_cuda, monkeypatch):
    kl_adapters.enable("sequence")
    plain, plain_steps, plain_rows = run(args, actor_dir, batch, False, monkeypatch)
    packed, packed_steps, packed_rows = run(args, actor_dir, batch, True, monkeypatch)
    assert set(plain_rows) == {2} and set(packed_rows) == {1}  # micro-batches of 2 rows; packed into one
    grads = plain.strategy.grad_log, packed.strategy.grad_log
    assert len(grads[0]) == len(grads[1]) == 4
    for k, (a, b) in enumerate(zip(*grads)):
        assert (a - b).norm() < 1e-5 * a.norm(), f"step {k}"
    for (exp_a, _), (exp_b, _) in zip(plain_steps, packed_steps):
        for key in (adapter.SEQ_KL, adapter.IS_ESS, adapter.GRAD_WEIGHT_GAP):
            torch.testing.assert_close(exp_b.info[key], exp_a.info[key], rtol=1e-5, atol=1e-7)


def test_packed_rollout_forward_carries_the_unpacked_eos_probabilities(actor_dir):
    """PolicyModelActor.forward at rollout time (attention mask passed by position, no gradient): the packed forward's
    log-probs and the pi(EOS | y_<t) they carry to the experience maker equal the unpacked forward's."""
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401  (a PolicyModelActor's process: kl-adapters patches the Actor)

    from kl_adapters.adapters.openrlhf.eos_payload import split_eos

    sequences, attention_mask, action_mask = openrlhf_cpu_shim.random_batch(4, 4, [5, 3, 5, 4], seed=0)
    kl_adapters.enable("sequence")
    outputs = []
    for packed in (False, True):
        actor = LOAD_ACTOR(actor_dir)
        actor.packing_samples = packed
        with torch.no_grad():
            outputs.append(split_eos(actor(sequences, action_mask, attention_mask)))
    (plain, plain_eos), (packed, packed_eos) = outputs
    assert plain_eos is not None and packed_eos is not None
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_eos.prob, plain_eos.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(packed_eos.is_eos, plain_eos.is_eos)
