"""GRPOTrainer with use_liger_kernel=True (support.py's Liger row): the loss still goes through the code path the
adapter wraps.

What the flag does in the tested releases (installed sources read): transformers' Trainer.train() swaps the model's
layer kernels (`transformers.integrations.liger.apply_liger_kernel`: RMSNorm, RoPE, SwiGLU; trl >= 1.15 turns
fused_linear_cross_entropy off); trl 1.14.x also computes the policy's log-probs with its own chunked torch path
(`GRPOTrainer._chunked_logps`, the backbone then `_ChunkedLogProbFunction` on lm_head.weight). No tested release has a
fused Liger GRPO loss. Liger itself needs Triton on a GPU and is not installed here, so on CPU the layer-kernel step
is `liger_layer_kernels_stub` (and trl 1.14.x's availability check at construction is stubbed to True); the chunked
path of trl 1.14.x is TRL's real one. On a GPU with liger-kernel: tests/trl/test_gpu.py::test_liger_kernels_on_cuda.

Pinned:
1. one train() step with the flag: the layer-kernel step ran on the policy, the loss was TRL's own
   GRPOTrainer._compute_loss with the policy log-probs from _get_per_token_logps_and_entropies (trl 1.14.x: through
   _chunked_logps), and the adapter's KL term ran (kl_adapters/seq_kl logged);
2. the gradient identity of tests/trl/test_grpo_gradients.py with the flag on (trainer gradient = TRL's task gradient
   + grad kl_surrogate, pi(EOS) by hand from a separate full-logits forward), also run against trl 1.14.0 (compat);
3. a loss that bypasses TRL's log-prob method (what a fused Liger loss would do) stops the step with one line naming
   the release and use_liger_kernel.
"""

import importlib.metadata
import importlib.util

import pytest
from conftest import logged, make_trainer, one_batch, perturb
from test_grpo_gradients import assert_close, expected_grad, trainer_grad

from kl_adapters.adapters._guard import UnsupportedFrameworkError
from kl_adapters.adapters.metrics import SEQ_KL

LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


@pytest.fixture
def liger_layer_kernels_stub(monkeypatch):
    """Without liger-kernel, a test stub for the layer-kernel step transformers' Trainer.train() takes (it records the
    model and config it was given), and trl 1.14.x's construction-time availability check says True. With
    liger-kernel installed nothing is stubbed (and nothing is recorded)."""
    calls = []
    if not LIGER_INSTALLED:
        from trl.trainer import grpo_trainer

        monkeypatch.setattr("transformers.trainer.apply_liger_kernel",
                            lambda model, config: calls.append((model, config)))
        if hasattr(grpo_trainer, "is_liger_kernel_available"):  # trl 1.14.x checks at construction
            monkeypatch.setattr(grpo_trainer, "is_liger_kernel_available", lambda: True)
    return calls


def spy(trainer, name: str) -> list:
    """Record every call of the trainer's method `name` (an instance attribute over the class's, which TRL's own
    `self.<name>(...)` calls reach; the adapter's class-level wrappers still run inside)."""
    calls, method = [], getattr(trainer, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return method(*args, **kwargs)

    setattr(trainer, name, recorded)
    return calls


def test_one_step_goes_through_trls_loss(model_dir, dataset, liger_layer_kernels_stub):
    trainer = make_trainer(model_dir, dataset, use_liger_kernel=True, max_steps=1)
    losses = spy(trainer, "_compute_loss")
    logps = spy(trainer, "_get_per_token_logps_and_entropies")
    chunked = spy(trainer, "_chunked_logps") if hasattr(trainer, "_chunked_logps") else None
    trainer.train()
    if not LIGER_INSTALLED:
        ((model, config),) = liger_layer_kernels_stub
        assert model is trainer.model
        if chunked is None:  # trl >= 1.15 keeps Liger's fused cross-entropy off (it would replace the fused head)
            assert config["fused_linear_cross_entropy"] is False
    assert len(losses) == 1 and losses[0][0] is trainer.model
    assert any(call[0] is trainer.model for call in logps)  # the policy's forward, inside the loss
    assert chunked is None or chunked  # trl 1.14.x: the log-probs come from TRL's chunked path
    assert len(logged(trainer, SEQ_KL)) == 1


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "reward"])
def test_gradient_identity_with_liger_flag(model_dir, dataset, liger_layer_kernels_stub, preset):
    trainer = make_trainer(model_dir, dataset, use_liger_kernel=True, loss_type="dapo")
    perturb(trainer.model, seed=41)
    batch = one_batch(trainer)
    assert_close(trainer_grad(trainer, batch, preset), expected_grad(trainer, batch, preset))


def test_a_loss_bypassing_trls_logps_is_refused(model_dir, dataset, liger_layer_kernels_stub):
    trainer = make_trainer(model_dir, dataset, use_liger_kernel=True)
    batch = one_batch(trainer)

    def fused_loss_stand_in(model, inputs):
        """What a fused loss gives TRL's compute_loss: a loss, with no call of _get_per_token_logps_and_entropies."""
        return sum(p.sum() for p in model.parameters()) * 0.0

    trainer._compute_loss = fused_loss_stand_in
    with pytest.raises(UnsupportedFrameworkError) as error:
        trainer.compute_loss(trainer.model, batch)
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"trl {importlib.metadata.version('trl')}: ")
    assert "use_liger_kernel=True: a fused Liger loss bypasses it" in line
