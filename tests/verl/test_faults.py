"""What the verl adapter does with what real runs produce (issue 25), through verl's real ppo_loss and real Ray workers:

- an empty micro-batch (B = 0): verl's own ppo_loss refuses it (its no_padding_2_padding indexes the last sequence
  offset) with the flag on as off -- the same error, so no empty micro-batch reaches a KL term;
- an all-masked micro-batch (response_mask zero, e.g. every response token a tool observation): loss and gradient
  finite, kl_adapters/* metrics finite (no 0/0), as verl's own loss;
- non-finite numbers: a -inf reference log-prob or a NaN policy log-prob at a real token is refused with a one-line
  ValueError naming the tensor, before any backward pass (verl's low_var_kl clamps the first to +-10 and lets the
  second through as a NaN loss, whose update its engine skips on a non-finite grad norm); importance weights that
  would overflow after off-policy steps are capped by the core (finite loss, gradient, metrics);
- a Ray worker restarted by Ray (max_restarts=1, its process killed with os._exit) comes back with the adapter active
  and the same preset, by KL_ADAPTERS in its runtime_env and by a kl_adapters: name in the config;
- a worker process whose installed verl reports an untested version refuses at the first verl import that would patch
  (UnsupportedFrameworkError naming the tested releases); no verl function is left wrapped there.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from verl_cases import P, Case, actor_config, flat_grad, flat_log_probs, padded, ppo_data

from kl_adapters.adapters._guard import ALLOW_UNTESTED_ENV

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent))
from fault_checks import import_as_release, once_restarted  # noqa: E402


@pytest.fixture(scope="module")
def case():
    return Case(seed=0)


def values(metrics: dict) -> dict[str, float]:
    """The kl_adapters/* and kl_loss metrics of a ppo_loss call as numbers."""
    return {k: float(m.aggregate() if hasattr(m, "aggregate") else m) for k, m in metrics.items()
            if k.startswith("kl_adapters/") or k == "kl_loss"}


def ppo(case: Case, kl_loss_type: str, **data):
    from verl.workers.utils import losses

    log_probs = data.pop("log_probs", None)
    log_probs = case.log_probs() if log_probs is None else log_probs
    loss, metrics = losses.ppo_loss(actor_config(kl_loss_type=kl_loss_type), {"log_probs": log_probs},
                                    case.data(**data))
    return loss, flat_grad(loss, case.model), values(metrics)


@pytest.mark.parametrize("kl_loss_type", ["low_var_kl", "kl_adapters:sequence"])
def test_empty_micro_batch_is_refused_by_verl_itself(kl_loss_type):
    from verl.workers.utils import losses

    empty = Case(seed=0)
    tokens = {k: v[:0] for k, v in empty.tokens.items()}
    data = ppo_data(tokens, old_log_probs=empty.old[:0], ref_log_prob=empty.ref[:0], advantages=empty.advantages[:0])
    with pytest.raises(IndexError, match="out of bounds"):
        losses.ppo_loss(actor_config(kl_loss_type=kl_loss_type), {"log_probs": torch.zeros(0)}, data)


@pytest.mark.parametrize("kl_loss_type", ["low_var_kl", "kl_adapters:sequence", "kl_adapters:token"])
def test_all_masked_micro_batch(case, kl_loss_type, monkeypatch):
    """batch_num_tokens counts the mini-batch's other micro-batches' tokens (at 0, verl's own token-mean is 0/0)."""
    monkeypatch.setitem(case.tokens, "response_mask", torch.zeros_like(case.tokens["response_mask"]))
    loss, grad, metrics = ppo(case, kl_loss_type, batch_num_tokens=20)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()) and "kl_loss" in metrics
    if kl_loss_type.startswith("kl_adapters:"):
        assert metrics["kl_adapters/seq_kl"] == 0.0 and metrics["kl_adapters/is_ess"] == 1.0


def test_minus_infinity_reference_log_prob_is_refused(case, monkeypatch):
    ref = case.ref.clone()
    ref[0, 0] = -math.inf  # a response token the reference forbids: KL(pi || pi_ref) is infinite
    monkeypatch.setattr(case, "ref", ref)
    native, grad, _ = ppo(case, "low_var_kl")
    assert torch.isfinite(native) and torch.isfinite(grad).all()  # verl clamps low_var_kl to [-10, 10]
    with pytest.raises(ValueError, match="ref_logp has non-finite values"):
        ppo(case, "kl_adapters:sequence")


def test_nan_log_prob_is_refused(case):
    log_probs = case.log_probs()  # flattened, row 0 first: position P - 1 predicts its first response token
    log_probs = torch.where(torch.arange(log_probs.shape[0]) == P - 1, math.nan, log_probs)
    from verl.workers.utils import losses

    native, _ = losses.ppo_loss(actor_config(), {"log_probs": log_probs}, case.data())
    assert torch.isnan(native)  # verl's engine then skips the update on its non-finite grad norm
    with pytest.raises(ValueError, match="logp has non-finite values"):
        ppo(case, "kl_adapters:sequence", log_probs=log_probs)


@pytest.mark.parametrize("preset", ["sequence", "reward", "token"])
def test_overflowing_importance_weights_stay_finite(case, preset, monkeypatch):
    """old_log_probs 20 nats per token below the policy's: w_{1:t} up to e^120, past float32's range."""
    with torch.no_grad():
        monkeypatch.setattr(case, "old", padded(flat_log_probs(case.model, case.tokens), case.tokens) - 20.0)
    loss, grad, metrics = ppo(case, f"kl_adapters:{preset}")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()) and 0.0 < metrics["kl_adapters/is_ess"] <= 1.0


class RestartingWorker:
    """Body of a Ray actor: what is active in this worker process, its ppo_loss's KL error (verl_cases.LossWorker)."""

    def pid(self) -> int:
        return os.getpid()

    def crash(self) -> None:
        os._exit(1)

    def run(self, kl_loss_type: str, preset: str) -> dict:
        from verl_cases import LossWorker

        return LossWorker().run(kl_loss_type, preset)

    def import_with_version(self, reported: str) -> dict:
        """Import verl's loss module with importlib.metadata reporting verl==`reported` in this process; the error
        and the verl functions left wrapped."""
        import sys

        from kl_adapters.adapters.patching import is_ours

        error = import_as_release("verl.workers.utils.losses", "verl", reported)
        wrapped = [f"{name}.{attr}" for name, module in list(sys.modules.items()) if name.startswith("verl")
                   and module is not None for attr, value in list(vars(module).items()) if is_ours(value)]
        return {"error": error, "wrapped": wrapped}


@pytest.mark.ray
def test_restarted_worker_keeps_the_preset_and_a_foreign_version_refuses():
    import ray

    from kl_adapters import activation

    pythonpath = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath, activation.ENV_VAR: "sequence"}})
    try:
        worker = ray.remote(num_cpus=1, max_restarts=1)(RestartingWorker).remote()
        # started alongside; scripts/compat.sh runs the suites with KL_ADAPTERS_ALLOW_UNTESTED=1, this worker without
        foreign = ray.remote(num_cpus=1)(RestartingWorker).options(
            runtime_env={"env_vars": {ALLOW_UNTESTED_ENV: "0"}}).remote()
        refusal = foreign.import_with_version.remote("0.8.5")
        before = ray.get(worker.pid.remote(), timeout=120)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.crash.remote(), timeout=120)
        after = once_restarted(ray, worker.pid.remote)
        by_env = ray.get(worker.run.remote("low_var_kl", "sequence"), timeout=300)
        by_name = ray.get(worker.run.remote("kl_adapters:reward", "reward"), timeout=300)
        refused = ray.get(refusal, timeout=120)
    finally:
        ray.shutdown()
    assert after == by_env["pid"] != before and by_env["pid"] != os.getpid()
    assert by_env["active"] == "sequence" and by_env["patched"] and by_env["kl_error"] < 1e-4
    assert by_name["patched"] and by_name["kl_error"] < 1e-4
    assert refused["error"].startswith("UnsupportedFrameworkError: kl-adapters supports verl 0.9.0 or 0.9.1")
    assert "found verl==0.8.5" in refused["error"] and refused["wrapped"] == []
