"""Loss path (--algo.kl.use_loss): OpenRLHF's own ActorPPOTrainer.ppo_train on a tiny random Llama, CPU strategy shim.

Setup: 8 sequences of ragged length, micro-batches of 2, gradient accumulation 2 (so an optimizer step sees 4
sequences in 2 micro-batches), 2 epochs (4 optimizer steps, parameters moving between them), PPO advantages != 0,
and behaviour log-probs from a perturbed policy (off-policy from the first step on).
"""

from __future__ import annotations

import copy
import re
import importlib.metadata

import pytest
import torch

import kl_adapters
from kl_adapters import activation, kl_coefficients, kl_term
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters._guard import UnsupportedFrameworkError
from kl_adapters.adapters.openrlhf.statistics import KEYS
from kl_adapters.presets import get_preset
from openrlhf_harness import (
    BETA,
    GAS,
    HAS_LOSS_AGG_MODE,
    HAS_UNBIASED_GRADIENT,
    MAX_NEW_TOKENS,
    align_row,
    base_argv,
    batch_statistics,
    cli_args,
    load_params,
    loss_path_batch,
    ppo_train_on,
    reference_grad,
    rows_statistics,
    softmax_eos,
)


@pytest.fixture(scope="module")
def args(actor_dir):
    return cli_args(base_argv(actor_dir))  # --algo.kl.use_loss --algo.kl.estimator k3 --train.max_epochs 2


@pytest.fixture(scope="module")
def batch(actor_dir, ref_dir):
    return loss_path_batch(actor_dir, ref_dir)


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


SEQ_MEAN = pytest.mark.skipif(not HAS_LOSS_AGG_MODE, reason="--actor.loss_agg_mode arrived in OpenRLHF 0.11.2")


@pytest.mark.compat
@pytest.mark.parametrize("device, preset, agg", [
    ("cpu", "sequence", "token-mean"), ("cpu", "sequence:is_clip=1.5", "token-mean"), ("cpu", "reward", "token-mean"),
    ("cpu", "sequence-plain", "token-mean"), ("cpu", "k3-loss", "token-mean"),
    pytest.param("cpu", "sequence", "seq-mean-token-mean", marks=SEQ_MEAN),
    pytest.param("cpu", "sequence-plain", "seq-mean-token-mean", marks=SEQ_MEAN),
    pytest.param("cuda", "sequence", "token-mean", marks=ON_GPU)])
def test_gradient_is_task_plus_kl_surrogate(args, actor_dir, batch, cpu_cuda, device, preset, agg):
    """Every optimizer step's gradient = grad(OpenRLHF's task loss) + beta * grad[(1/D) sum_b kl_surrogate_b], D the
    policy loss's normaliser: the step's token count N_tok (token-mean), N_seq x the horizon (seq-mean-token-mean).

    kl_surrogate_b's gradient is the preset's sum_t c_t grad log pi_t with the behaviour log-probs as old_logp
    (for "sequence": the unbiased off-policy estimate of grad KL_seq); exact to float32 rounding on all 4 steps.
    Reduced presets: the batch carries its rollout-wide statistics (as the experience maker attaches them: fitted with
    the advantages, GRPO groups of 4 and the behaviour policy's EOS probabilities) through OpenRLHF's replay buffer
    (split, shuffled, re-batched), and kl_surrogate_b gets row b's own statistics and the EndOfSequence of the current
    parameters (softmax of a separate forward), from its response's start: so every micro-batch row received its row's
    statistics, and the adapter read pi(EOS) of the policy the loss is taken at. The cuda case (skipped without CUDA)
    runs on the GPU."""
    settings = activation.parse(preset)
    kl_adapters.enable(settings.preset, is_clip=settings.is_clip)
    stats = batch_statistics(batch) if get_preset(settings.preset).uses_batch_statistics else None
    if agg != "token-mean":
        args = copy.deepcopy(args)
        args.actor.loss_agg_mode = agg
    trainer, steps, _ = ppo_train_on(args, actor_dir, batch, device=device, statistics=stats)
    log = trainer.strategy
    own = None if stats is None else (batch, stats)
    assert len(log.grad_log) == len(steps) // GAS == 4
    for k, grad in enumerate(log.grad_log):
        window = steps[GAS * k:GAS * (k + 1)]
        model = load_params(actor_dir, log.params_log[k])
        expected = reference_grad(model, window, trainer, settings, BETA, statistics=own, divisor=agg)
        task_only = reference_grad(model, window, trainer, settings, 0.0, statistics=own)
        kl_part = (expected - task_only).norm()
        assert kl_part > 0.1 * expected.norm(), "the KL term must matter in this test"
        assert (grad - expected).norm() < 1e-4 * kl_part, f"step {k}"

    # step 0's metrics: OpenRLHF's `kl` keeps its value (k3, token mean); ours are added beside it
    from openrlhf.models import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    exp, info = steps[0]
    with torch.no_grad():
        logp = load_params(actor_dir, log.params_log[0])(exp.sequences, exp.action_mask,
                                                         attention_mask=exp.attention_mask)
        native_kl = aggregate_loss(compute_approx_kl(logp, exp.base_action_log_probs, kl_estimator="k3"),
                                   exp.action_mask, **info)  # (log_probs_old only matters with unbiased_gradient)
    torch.testing.assert_close(exp.info["kl"], native_kl, rtol=1e-6, atol=0)
    m = exp.action_mask
    a = lambda x: align_row(x, m)  # noqa: E731  (the adapter's positions: each row from its response's start)
    extra = {}
    if stats is not None:
        eos = softmax_eos(load_params(actor_dir, log.params_log[0]), exp.sequences, exp.attention_mask, m)
        extra = dict(statistics=rows_statistics(batch, stats, exp),
                     eos=kl_adapters.EndOfSequence(a(eos.prob), a(eos.is_eos), max(MAX_NEW_TOKENS, m.shape[1])))
    term = kl_term(a(logp), a(exp.base_action_log_probs), a(m), preset=settings.preset,
                   old_logp=a(exp.action_log_probs), is_clip=settings.is_clip, **extra)
    torch.testing.assert_close(exp.info[adapter.SEQ_KL], term.sequence_kl, rtol=1e-5, atol=0)
    torch.testing.assert_close(exp.info[adapter.IS_ESS], term.is_ess)  # 0-dim, < 1: off-policy from the start
    assert exp.info[adapter.IS_ESS].dim() == 0 and 0 < exp.info[adapter.IS_ESS] < 1
    assert not any(key in exp.info for key in KEYS), "statistics must not reach OpenRLHF's metrics"
    weights = [kl_coefficients(a(logp), a(exp.base_action_log_probs), a(m), preset="k3-loss",
                               old_logp=a(exp.action_log_probs)), term.coefficients]
    gap = exp.info[adapter.GRAD_WEIGHT_GAP]  # sum |c_native - c_preset| / sum |c_preset|, native = OpenRLHF's k3 loss
    torch.testing.assert_close(gap, (weights[0] - weights[1]).abs().sum() / weights[1].abs().sum())
    assert gap.dim() == 0 and (gap == 0) == (preset == "k3-loss")


@pytest.mark.skipif(not HAS_UNBIASED_GRADIENT, reason="--algo.kl.unbiased_gradient arrived in OpenRLHF 0.11.1")
def test_token_preset_is_openrlhfs_unbiased_gradient(args, actor_dir, batch, cpu_cuda):
    """--algo.kl.init_coef keeps OpenRLHF's strength: under preset token:is_clip=10 every optimizer step's gradient
    (4 steps, gradient accumulation 2, off-policy) is the one OpenRLHF's own --algo.kl.unbiased_gradient loss gives
    with the same init_coef (per token w_t k1_t grad log pi_t, w_t = pi/pi_old clamped at 10, over the step's token
    count N_tok, the policy loss's divisor)."""
    native = copy.deepcopy(args)
    native.algo.kl.unbiased_gradient = True
    reference, _, _ = ppo_train_on(native, actor_dir, batch)
    kl_adapters.enable("token", is_clip=10.0)
    trainer, steps, _ = ppo_train_on(args, actor_dir, batch)
    log = trainer.strategy
    assert len(log.grad_log) == len(reference.strategy.grad_log) == 4
    for k, (grad, expected) in enumerate(zip(log.grad_log, reference.strategy.grad_log)):
        model = load_params(actor_dir, log.params_log[k])
        task_only = reference_grad(model, steps[GAS * k:GAS * (k + 1)], trainer, activation.parse("token"), 0.0)
        assert (expected - task_only).norm() > 0.1 * expected.norm(), "the KL term must matter in this test"
        assert (grad - expected).norm() < 1e-4 * (expected - task_only).norm(), f"step {k}"


@pytest.mark.compat
def test_flag_off_is_bit_identical(args, actor_dir, batch, cpu_cuda):
    """Patched but switched off by the flag (--algo.kl.preset none): gradients and metrics bit-identical to OpenRLHF
    never patched; disable() restores OpenRLHF's own functions."""
    import openrlhf.models.utils as model_utils
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    original = ppo_actor.ActorPPOTrainer.training_step
    pristine, _, pristine_status = ppo_train_on(args, actor_dir, batch)
    kl_adapters.enable("sequence")
    assert ppo_actor.ActorPPOTrainer.training_step is not original
    off = copy.deepcopy(args)
    off.algo.kl.preset = "none"
    patched, _, patched_status = ppo_train_on(off, actor_dir, batch)
    kl_adapters.disable()
    assert ppo_actor.ActorPPOTrainer.training_step is original
    assert ppo_actor.compute_approx_kl is model_utils.compute_approx_kl
    assert len(pristine.strategy.grad_log) == len(patched.strategy.grad_log) == 4
    for a, b in zip(pristine.strategy.grad_log, patched.strategy.grad_log):
        assert torch.equal(a, b)
    assert patched_status == pristine_status


def test_conflict_is_refused_inside_the_trainer(args, actor_dir, batch, cpu_cuda):
    """Activated without the CLI (KL_ADAPTERS / enable), the checks run where the KL is computed."""
    kl_adapters.enable("sequence")
    bad = copy.deepcopy(args)
    bad.algo.kl.unbiased_gradient = True
    with pytest.raises(ValueError, match="unbiased_gradient"):
        ppo_train_on(bad, actor_dir, batch)


def _pretend_version(monkeypatch, release: str) -> None:
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: release if d == "openrlhf" else version(d))


def test_version_guard(monkeypatch):
    """An untested OpenRLHF version is refused with the supported range; KL_ADAPTERS_ALLOW_UNTESTED=1 only warns."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    _pretend_version(monkeypatch, "0.11.3")
    monkeypatch.delenv("KL_ADAPTERS_ALLOW_UNTESTED", raising=False)  # scripts/compat.sh sets it for the whole suite
    original = ppo_actor.ActorPPOTrainer.training_step
    with pytest.raises(UnsupportedFrameworkError, match=r"supports openrlhf 0\.10\.4, .*found openrlhf==0\.11\.3"):
        kl_adapters.enable("sequence")
    assert ppo_actor.ActorPPOTrainer.training_step is original
    kl_adapters.disable()
    monkeypatch.setenv("KL_ADAPTERS_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="0.11.3"):
        kl_adapters.enable("sequence")
    assert "ActorPPOTrainer.training_step" in adapter.patched()


def test_changed_openrlhf_method_is_refused_and_unpatch_gives_back_openrlhfs_own(monkeypatch):
    """patching.install checks each method's leading parameters against the ones the adapter was written for and
    refuses, naming the release, before it replaces any; unpatch sets back OpenRLHF's very objects."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    kl_adapters.disable()
    trainer, step = ppo_actor.ActorPPOTrainer, ppo_actor.ActorPPOTrainer.training_step
    kl_adapters.enable("sequence")
    assert trainer.training_step is not step
    kl_adapters.disable()
    assert vars(trainer)["training_step"] is step and adapter.patched() == []
    kl_for_loss = ppo_actor.compute_approx_kl
    monkeypatch.setattr(trainer, "training_step", lambda self, experience: None)
    release = importlib.metadata.version("openrlhf")
    with pytest.raises(UnsupportedFrameworkError, match=re.escape(
            f"openrlhf {release}: openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer.training_step('self', 'experience') "
            "is not the function kl-adapters was tested with")):
        adapter.patch("openrlhf.trainer.ray.ppo_actor")
    assert ppo_actor.compute_approx_kl is kl_for_loss and adapter.patched() == []


def test_releases_before_0_10_4_are_refused_even_when_overridden(monkeypatch):
    """0.10.3's training_step normalises per micro-batch (no loss_batch_info): refused with the reason, always."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    _pretend_version(monkeypatch, "0.10.3")
    monkeypatch.setenv("KL_ADAPTERS_ALLOW_UNTESTED", "1")
    original = ppo_actor.ActorPPOTrainer.training_step
    with pytest.warns(RuntimeWarning), pytest.raises(UnsupportedFrameworkError, match="before 0.10.4.*loss_batch_info"):
        kl_adapters.enable("sequence")
    assert ppo_actor.ActorPPOTrainer.training_step is original


@pytest.fixture
def process_group():
    """A one-process gloo group and a CPU "dp" device mesh: what dynamic batching queries (replay_buffer.py:95)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def test_dynamic_batching_gradient(args, actor_dir, batch, cpu_cuda, process_group):
    """--train.dynamic_batch_enable: micro-batches of uneven size (token budget 24) and OpenRLHF's per-step normalisers
    from the replay buffer; the same identity holds per optimizer step, each row with its rollout-wide statistics.
    (OpenRLHF's CLI also turns on packing, which needs flash-attn and is refused as untested; here it stays off.)"""
    from openrlhf.utils.loss_utils import get_loss_batch_info

    kl_adapters.enable("sequence")
    dynamic = copy.deepcopy(args)
    dynamic.train.dynamic_batch_enable, dynamic.train.max_tokens_per_gpu = True, 24
    stats = batch_statistics(batch)
    trainer, steps, _ = ppo_train_on(dynamic, actor_dir, batch, mesh=process_group, statistics=stats)
    buffer, log = trainer.replay_buffer, trainer.strategy
    ends = [i + 1 for i, last in enumerate(buffer.dynamic_optimizer_step * dynamic.train.max_epochs) if last]
    assert len(log.grad_log) == len(ends) == 4 and len(steps) > len(ends)  # uneven micro-batches per step
    for k, (start, end) in enumerate(zip([0, *ends], ends)):
        window = [(exp, get_loss_batch_info(log, exp.action_mask, replay_buffer=buffer, step=i % len(buffer),
                                            dynamic_batch=True)) for i, (exp, _) in enumerate(steps[start:end], start)]
        model = load_params(actor_dir, log.params_log[k])
        expected = reference_grad(model, window, trainer, activation.parse("sequence"), BETA, gas=1,
                                  statistics=(batch, stats))
        task_only = reference_grad(model, window, trainer, activation.parse("sequence"), 0.0, gas=1,
                                   statistics=(batch, stats))
        assert (log.grad_log[k] - expected).norm() < 1e-4 * (expected - task_only).norm(), f"step {k}"
