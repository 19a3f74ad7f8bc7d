"""How the adapter gets into a verl process, and its guards: the `verl.plugins` entry point (every process that imports
verl), the KL_ADAPTERS .pth hook, `external_lib` (late import: name-import sites rebound), the version and
code-path guards; the activation table on every verl path, and a refused KL_ADAPTERS stopping verl's import."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kl_adapters import activation
from kl_adapters.adapters import _guard, loader, verl_plugin
from kl_adapters.adapters import verl as verl_adapter
from kl_adapters.adapters._guard import UnsupportedFrameworkError
from kl_adapters.adapters.versions import supported_range
from verl_cases import LOADS_ENTRY_POINTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from activation_table import cases, check_refusal  # noqa: E402

PROBE = textwrap.dedent("""
    import json, sys
    import verl.workers.utils.losses as losses
    import verl.workers.engine_workers as engine_workers
    from kl_adapters import activation

    def state():
        ours = lambda fn: hasattr(fn, "__kl_adapters_original__")
        return {"kl_penalty": ours(losses.kl_penalty), "engine_ppo_loss": ours(engine_workers.ppo_loss),
                "active": str(activation.active())}

    out = {"start": state()}
    if "--external-lib" in sys.argv:  # what actor_rollout_ref.model.external_lib=... does, after verl is loaded
        import kl_adapters.adapters.verl_plugin
        out["after_external_lib"] = state()
    print("PROBE" + json.dumps(out))
""")


CASES = {  # name -> (environment, arguments) of one fresh interpreter importing verl
    "entry_point": ({}, ()),
    "external_lib": ({"VERL_USE_EXTERNAL_PLUGINS": "none"}, ("--external-lib",)),
    "pth_hook": ({"VERL_USE_EXTERNAL_PLUGINS": "none", activation.ENV_VAR: "sequence"}, ()),
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    """Run every probe interpreter concurrently (each imports verl: seconds apiece)."""
    tmp = tmp_path_factory.mktemp("probe")
    script = tmp / "probe.py"
    script.write_text(PROBE)
    base = {k: v for k, v in os.environ.items() if k not in (activation.ENV_VAR, "VERL_USE_EXTERNAL_PLUGINS")}
    running = {name: subprocess.Popen([sys.executable, str(script), *args], env={**base, **env}, cwd=tmp,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (env, args) in CASES.items()}
    results = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results[name] = json.loads(next(line for line in out.splitlines() if line.startswith("PROBE"))[5:])
    return results


def test_triggers_are_the_patched_modules():
    assert set(loader.ADAPTERS["verl"][1]) == set(verl_adapter.SITES)


def test_entry_point_is_registered_for_verl():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.name == "kl_adapters"]
    assert ep.value == "kl_adapters.adapters.verl_plugin"


def test_entry_point_patches_inertly(probes):
    """No flag: every process importing verl is patched by the entry point, nothing is active (bit-identity of the
    inert wrappers: test_loss_path / test_reward_path ::test_flag_off_is_bit_identical_to_upstream). verl 0.8.0 loads
    no entry points: nothing is patched there."""
    assert probes["entry_point"]["start"] == {"kl_penalty": LOADS_ENTRY_POINTS, "engine_ppo_loss": LOADS_ENTRY_POINTS,
                                              "active": "None"}


def test_external_lib_import_patches_late_and_rebinds_name_imports(probes):
    out = probes["external_lib"]
    assert out["start"] == {"kl_penalty": False, "engine_ppo_loss": False, "active": "None"}
    assert out["after_external_lib"] == {"kl_penalty": True, "engine_ppo_loss": True, "active": "None"}


def test_environment_variable_alone_activates_through_the_pth_hook(probes):
    out = probes["pth_hook"]
    assert out["start"] == {"kl_penalty": True, "engine_ppo_loss": True, "active": "sequence"}


@pytest.fixture()
def verl_version(monkeypatch):
    real = importlib.metadata.version

    def fake(version):
        monkeypatch.setattr(_guard.importlib.metadata, "version",
                            lambda dist: version if dist == "verl" else real(dist))

    return fake


def test_untested_verl_version_is_refused(verl_version, monkeypatch):
    monkeypatch.delenv(_guard.ALLOW_UNTESTED_ENV, raising=False)  # scripts/compat.sh sets it for the whole suite
    verl_adapter.unpatch()
    verl_version("0.9.2")
    expected = re.escape(supported_range("verl")) + r" .* found verl==0\.9\.2"
    with pytest.raises(UnsupportedFrameworkError, match=expected):
        verl_adapter.patch("verl.workers.utils.losses")
    with pytest.raises(UnsupportedFrameworkError):
        activation.enable("sequence")  # an explicit activation fails loudly
    activation.disable()
    monkeypatch.setenv(_guard.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="found verl==0.9.2"):
        verl_adapter.patch("verl.workers.utils.losses")
    monkeypatch.undo()  # before the autouse fixture re-patches


def test_plugin_leaves_an_untested_verl_unpatched_with_a_warning(verl_version, caplog, monkeypatch):
    monkeypatch.delenv(_guard.ALLOW_UNTESTED_ENV, raising=False)  # scripts/compat.sh sets it for the whole suite
    verl_version("0.10.0")
    armed = set(loader._armed)
    loader._armed.clear()
    try:
        verl_plugin.install()
        assert "verl" not in loader._armed  # nothing will patch verl as it is imported
        assert "verl adapter inactive" in caplog.text and "verl==0.10.0" in caplog.text
    finally:
        loader._armed |= armed
        monkeypatch.undo()  # before the autouse fixture re-patches


def test_changed_verl_function_is_refused(monkeypatch):
    from verl.workers.utils import losses

    verl_adapter.unpatch()
    monkeypatch.setattr(losses, "kl_penalty", lambda logprob, ref_logprob: logprob - ref_logprob)
    with pytest.raises(UnsupportedFrameworkError, match="kl_penalty.*not the function kl-adapters was tested with"):
        verl_adapter.patch("verl.workers.utils.losses")
    monkeypatch.undo()  # before the autouse fixture re-patches


# ---- the activation table (tests/activation_table.py) on every verl path -------------------------------------------

#: verl's KL loss on, and the micro-batch sizes verl's own validate_config wants (those of examples/verl_grpo.sh)
LOSS_ON = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"]
#: path -> (its Hydra overrides for a value, the setting its refusal names)
VERL_PATHS = {
    "kl_loss_type": (lambda value: [f"actor_rollout_ref.actor.kl_loss_type='kl_adapters:{value}'"],
                     lambda value: f"actor_rollout_ref.actor.kl_loss_type='kl_adapters:{value}'"),
    "runtime_env": (lambda value: [f"+ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS='{value}'"],
                    lambda value: f"ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS={value!r}"),
    "KL_ADAPTERS": (lambda value: [], lambda value: f"KL_ADAPTERS={value!r}"),
}


@pytest.mark.parametrize("path", list(VERL_PATHS))
@pytest.mark.parametrize(("value", "refused"), cases("verl"))
def test_table_on_every_verl_path(path, value, refused, monkeypatch, caplog):
    """The Hydra value, the Ray job's runtime_env and KL_ADAPTERS (read at interpreter start, as the .pth hook reads
    it) accept and refuse the same values, in verl's own validate_config in the driver before Ray starts; accepted,
    the driver logs the activation line."""
    from test_config import compose
    from verl.trainer import main_ppo

    overrides, setting = VERL_PATHS[path]
    if path == "KL_ADAPTERS":
        monkeypatch.setenv(activation.ENV_VAR, value)
        activation.activate_from_env(defer=True)
    monkeypatch.setattr(activation, "_announced", set())
    config = compose(LOSS_ON + overrides(value))
    if refused is None:
        main_ppo.validate_config(config, use_reference_policy=True, use_critic=False)
        assert f"kl-adapters: preset {activation.parse(value).preset} active in verl" in caplog.text
        return
    with pytest.raises(ValueError) as error:
        main_ppo.validate_config(config, use_reference_policy=True, use_critic=False)
    check_refusal(str(error.value), refused, setting(value))


def test_refused_environment_variable_stops_verls_import(tmp_path):
    """KL_ADAPTERS refused in a fresh interpreter: verl's first patched module stops the run with one line, exit 1
    (a .pth error would have been swallowed, and the plugin loader swallows plugin errors)."""
    base = {k: v for k, v in os.environ.items() if k != activation.ENV_VAR}
    for value, refused in (("sequnce", "unknown KL preset 'sequnce'"), ("sequence:kl_target=-1", "kl_target must")):
        proc = subprocess.run([sys.executable, "-c", "import verl.trainer.ppo.ray_trainer; print('IMPORTED')"],
                              env={**base, activation.ENV_VAR: value}, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1 and "IMPORTED" not in proc.stdout, proc.stderr[-3000:]
        (line,) = proc.stderr.strip().splitlines()
        check_refusal(line, refused, f"KL_ADAPTERS={value!r}")
