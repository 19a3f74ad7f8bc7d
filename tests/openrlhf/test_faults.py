"""What the OpenRLHF adapter does with what real runs produce (issue 25), through OpenRLHF's real
ActorPPOTrainer.training_step (loss path, CPU strategy shim) and real Ray actors:

- an empty micro-batch (B = 0): OpenRLHF's own training_step refuses it with the flag on as off -- the same error from
  its own code, so no empty micro-batch reaches a KL term (its replay buffer never makes one);
- an all-masked micro-batch inside a window with tokens: finite gradient and step, the kl_adapters/* metrics finite
  (no 0/0), as OpenRLHF's own loss;
- non-finite numbers: a -inf reference log-prob or a NaN in the policy's log-probs at a real token is refused with a
  one-line ValueError naming the tensor, before the backward pass and the optimizer step (OpenRLHF's k3 clamps the
  first, and steps with the second: NaN in every weight); importance weights that would overflow after off-policy
  steps are capped by the core (finite gradient and metrics);
- a PolicyModelActor restarted by Ray (max_restarts=1, its process killed with os._exit) comes back with the adapter
  active and the same preset (KL_ADAPTERS in its runtime_env; the --algo.kl.preset route re-activates when the
  restarted actor is given its args again, which unpickling them does: tests/openrlhf/test_ray.py);
- a worker process whose installed OpenRLHF reports an untested version refuses at the import that would patch
  (UnsupportedFrameworkError naming the tested releases), leaving OpenRLHF unpatched there.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from openrlhf_cpu_shim import load_actor
from openrlhf_harness import BETA, base_argv, build_trainer, cli_args, experience_fields, loss_path_batch, probe

import kl_adapters
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters._guard import ALLOW_UNTESTED_ENV

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from fault_checks import import_as_release, once_restarted  # noqa: E402

METRICS = (adapter.SEQ_KL, adapter.IS_ESS, adapter.GRAD_WEIGHT_GAP, "kl")


@pytest.fixture(scope="module")
def args(actor_dir):
    return cli_args(base_argv(actor_dir))  # --algo.kl.use_loss --algo.kl.estimator k3


@pytest.fixture(scope="module")
def batch(actor_dir, ref_dir):
    return loss_path_batch(actor_dir, ref_dir)


def train_step(args, actor_dir, fields: dict, rows, *, batch_num_tokens=None, global_batch_size=None,
               nan_logit: bool = False):
    """One training_step (one optimizer step) of OpenRLHF's ActorPPOTrainer on the batch's `rows`: (the actor after
    it, the gradient it applied, the step's metrics as floats). The window's token / sequence counts default to the
    micro-batch's own (OpenRLHF's get_loss_batch_info). nan_logit: one output-embedding row NaN (every logit NaN)."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.utils.loss_utils import get_loss_batch_info

    actor = load_actor(actor_dir)
    if nan_logit:
        with torch.no_grad():
            actor.model.get_output_embeddings().weight[5] = math.nan
    trainer = build_trainer(args, actor, micro_batch=2, gas=1)
    picked = {k: v[rows].clone() for k, v in experience_fields(fields).items()}
    experience = Experience(**picked, total_length=picked["attention_mask"].sum(-1),
                            index=list(range(picked["sequences"].shape[0])), info={})
    info = get_loss_batch_info(trainer.strategy, experience.action_mask, batch_num_tokens=batch_num_tokens,
                               global_batch_size=global_batch_size)
    status = trainer.training_step(experience, BETA, 0, info)
    metrics = {k: float(v.float().mean()) for k, v in status["metrics"].items() if k in METRICS}
    return actor, trainer.strategy.grad_log[-1], metrics


@pytest.mark.parametrize("preset", [None, "sequence"])
def test_empty_micro_batch_is_refused_by_openrlhf_itself(args, actor_dir, batch, cpu_cuda, preset):
    if preset:
        kl_adapters.enable(preset)
    with pytest.raises(RuntimeError, match="0 elements"):
        train_step(args, actor_dir, batch, slice(0, 0))


@pytest.mark.parametrize("preset", [None, "sequence", "token"])
def test_all_masked_micro_batch(args, actor_dir, batch, cpu_cuda, preset):
    """The micro-batch's action_mask all zero, the window's counts those of the whole batch (other micro-batches')."""
    if preset:
        kl_adapters.enable(preset)
    masked = {**batch, "action_mask": torch.zeros_like(batch["action_mask"])}
    actor, grad, metrics = train_step(args, actor_dir, masked, slice(0, 2),
                                      batch_num_tokens=int(batch["action_mask"].sum()), global_batch_size=8)
    assert torch.isfinite(grad).all() and all(torch.isfinite(p).all() for p in actor.parameters())
    assert all(math.isfinite(v) for v in metrics.values()) and "kl" in metrics
    if preset:
        assert metrics[adapter.SEQ_KL] == 0.0 and metrics[adapter.IS_ESS] == 1.0


def test_minus_infinity_reference_log_prob_is_refused(args, actor_dir, batch, cpu_cuda):
    base = batch["base_action_log_probs"].clone()
    base[0, 0] = -math.inf  # row 0's first response token, forbidden by the reference
    bad = {**batch, "base_action_log_probs": base}
    _, grad, _ = train_step(args, actor_dir, bad, slice(0, 2))
    assert torch.isfinite(grad).all()  # OpenRLHF's k3 bounds the log-ratio before exp and clamps the value
    kl_adapters.enable("sequence")
    with pytest.raises(ValueError, match="ref_logp has non-finite values"):
        train_step(args, actor_dir, bad, slice(0, 2))


def test_nan_logit_is_refused_before_the_step(args, actor_dir, batch, cpu_cuda):
    """A NaN in the policy's logits (a corrupted weight, an overflowing activation): OpenRLHF's own loss steps and
    writes NaN into the weights; with the flag the step raises first."""
    actor, grad, _ = train_step(args, actor_dir, batch, slice(0, 2), nan_logit=True)
    assert torch.isnan(grad).any() and not all(torch.isfinite(p).all() for p in actor.parameters())
    kl_adapters.enable("sequence")
    with pytest.raises(ValueError, match="logp has non-finite values"):
        train_step(args, actor_dir, batch, slice(0, 2), nan_logit=True)


@pytest.mark.parametrize("preset", ["sequence", "reward", "token"])
def test_overflowing_importance_weights_stay_finite(args, actor_dir, batch, cpu_cuda, preset):
    """Behaviour log-probs 20 nats per token below the policy's: w_{1:t} up to e^120, past float32's range."""
    kl_adapters.enable(preset)
    actor = load_actor(actor_dir)
    with torch.no_grad():
        current = actor(batch["sequences"], batch["action_mask"], attention_mask=batch["attention_mask"])
    stale = {**batch, "action_log_probs": current - 20.0 * batch["action_mask"]}
    _, grad, metrics = train_step(args, actor_dir, stale, slice(0, 4))
    assert torch.isfinite(grad).all() and all(math.isfinite(v) for v in metrics.values())
    assert 0.0 < metrics[adapter.IS_ESS] <= 1.0


class VersionProbe:
    """Body of a plain Ray actor: import OpenRLHF's actor module with importlib.metadata reporting openrlhf==`reported`
    in this worker process, and report the error and what the adapter patched there."""

    def run(self, reported: str) -> dict:
        import sys

        error = import_as_release("openrlhf.trainer.ray.ppo_actor", "openrlhf", reported)
        patched = sys.modules.get("kl_adapters.adapters.openrlhf")
        return {"error": error, "patched": patched.patched() if patched else []}


@pytest.mark.ray
def test_restarted_actor_keeps_the_preset_and_a_foreign_version_refuses(ray_cluster):
    ray = ray_cluster
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    env = {"KL_ADAPTERS": "sequence", "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ["PYTHONPATH"]])}
    handle = PolicyModelActor.options(num_gpus=0.2, max_restarts=1, runtime_env={"env_vars": env}).remote(1, 0, None,
                                                                                                         None)
    # scripts/compat.sh runs the suites with KL_ADAPTERS_ALLOW_UNTESTED=1; this worker runs without it
    foreign = ray.remote(num_cpus=0)(VersionProbe).options(
        runtime_env={"env_vars": {**env, ALLOW_UNTESTED_ENV: "0"}}).remote()
    try:
        refusal = foreign.run.remote("0.9.0")
        before = ray.get(handle.__ray_call__.remote(probe))
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.__ray_call__.remote(lambda actor: os._exit(1)))
        after = once_restarted(ray, lambda: handle.__ray_call__.remote(probe))
        refused = ray.get(refusal)
    finally:
        for actor in (handle, foreign):
            ray.kill(actor)
    assert before["active"] == after["active"] == "sequence" and after["pid"] != before["pid"]
    assert "ActorPPOTrainer.training_step" in after["patched"]
    assert refused["error"].startswith("UnsupportedFrameworkError: kl-adapters supports openrlhf 0.10.4")
    assert "found openrlhf==0.9.0" in refused["error"] and refused["patched"] == []
