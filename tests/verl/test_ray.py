"""A real local Ray cluster: worker processes run the patched verl loss when activated only through the documented
flags -- KL_ADAPTERS forwarded by the driver into the job's runtime_env (as verl's main_ppo does; the raylet itself
never sees the variable, as on another node), or a kl_adapters: estimator name in the config alone."""

import os
from pathlib import Path

import pytest

from kl_adapters import activation

TESTS = str(Path(__file__).resolve().parent)
KL_ADAPTERS = str(Path(activation.__file__).resolve().parent)  # the package under test


@pytest.mark.ray
def test_ray_workers_run_the_patched_loss(monkeypatch):
    import ray
    import verl_cases
    from verl.trainer import main_ppo

    activation.enable("sequence")  # the driver's `export KL_ADAPTERS=sequence`
    runtime_env = main_ppo.get_ppo_ray_runtime_env()  # verl's job runtime_env, kl-adapters' addition included
    activation.disable()  # the cluster starts without it: workers can only get it through the runtime_env
    assert activation.ENV_VAR not in os.environ and runtime_env["env_vars"][activation.ENV_VAR] == "sequence"
    # workers import verl_cases (and the kl_adapters on this process's PYTHONPATH, if any: a source tree under test)
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, runtime_env=runtime_env, include_dashboard=False, logging_level="ERROR")
    try:
        worker = ray.remote(num_cpus=1)(verl_cases.LossWorker)
        # actor-level env_vars, as verl's RayWorkerGroup gives each worker; Ray merges them with the job's
        by_env = worker.options(runtime_env={"env_vars": {"WG_RANK": "0"}}).remote()
        # a worker where the environment route is off: only the config's kl_adapters: name selects the preset
        # (verl 0.8.0 loads no entry points: the name needs model.external_lib there)
        by_name = worker.options(runtime_env={"env_vars": {activation.ENV_VAR: "off"}}).remote()
        env_result, name_result = ray.get([
            by_env.run.remote("low_var_kl", "sequence"),
            by_name.run.remote("kl_adapters:reward", "reward", external_lib=not verl_cases.LOADS_ENTRY_POINTS)],
            timeout=300)
    finally:
        ray.shutdown()
    assert env_result["active"] == "sequence" and name_result["active"] == "None"
    for result in (env_result, name_result):
        assert result["pid"] != os.getpid() and result["patched"]
        assert result["kl_error"] < 1e-4 and result["kl_adapters"] == KL_ADAPTERS
        assert result["metrics"] == ["kl_adapters/grad_weight_gap", "kl_adapters/is_ess", "kl_adapters/seq_kl"]
