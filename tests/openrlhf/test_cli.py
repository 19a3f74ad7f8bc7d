"""The flag: ``python -m kl_adapters.adapters.openrlhf_cli ... --algo.kl.preset P`` through OpenRLHF's real argument
parsing (train_ppo_ray run as __main__, stopped before Ray starts), KL_ADAPTERS with OpenRLHF's own CLI, and the
settings that are refused before any Ray actor starts."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings

import pytest

import kl_adapters
from kl_adapters import activation
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters._guard import UnsupportedFrameworkError
from openrlhf_harness import HAS_LOSS_AGG_MODE, HAS_UNBIASED_GRADIENT, base_argv, cli_args


def reward_argv(model_dir: str) -> list[str]:
    argv = [a for a in base_argv(model_dir) if a != "--algo.kl.use_loss"]
    argv[argv.index("--algo.kl.estimator") + 1] = "k1"
    return argv


@pytest.mark.parametrize("flag, expected", [(["--algo.kl.preset", "sequence"], "sequence"),
                                            (["--algo.kl.preset=sequence:is_clip=2"], "sequence:is_clip=2.0")])
def test_wrapper_flag_lands_in_args_and_activates(actor_dir, flag, expected):
    """The wrapper strips the flag before OpenRLHF's argparse (which rejects unknown flags), switches kl-adapters on,
    and OpenRLHF's own parsing yields args.algo.kl.preset: a PresetFlag, which survives pickling (as Ray ships args)."""
    args = cli_args(base_argv(actor_dir) + flag, wrapper=True)
    assert isinstance(args.algo.kl.preset, adapter.PresetFlag) and args.algo.kl.preset == expected
    assert str(activation.active()) == expected == os.environ["KL_ADAPTERS"]
    assert {"ActorPPOTrainer.training_step", "openrlhf.trainer.ray.ppo_actor.compute_approx_kl"} <= set(
        adapter.patched())
    clone = pickle.loads(pickle.dumps(args))
    assert isinstance(clone.algo.kl.preset, adapter.PresetFlag) and clone.algo.kl.preset == expected


def test_wrapper_without_flag_is_openrlhf(actor_dir):
    args = cli_args(base_argv(actor_dir), wrapper=True)
    assert not hasattr(args.algo.kl, "preset") and activation.active() is None and adapter.patched() == []


def test_kl_adapters_env_with_openrlhf_cli(actor_dir):
    """KL_ADAPTERS (here: enable(), which sets it) with OpenRLHF's own CLI: the same args.algo.kl.preset."""
    kl_adapters.enable("reward")
    args = cli_args(reward_argv(actor_dir))
    assert isinstance(args.algo.kl.preset, adapter.PresetFlag) and args.algo.kl.preset == "reward"


def test_flag_none_overrides_kl_adapters(actor_dir):
    kl_adapters.enable("sequence")
    args = cli_args(base_argv(actor_dir) + ["--algo.kl.preset", "none"], wrapper=True)
    assert activation.active() is None and "KL_ADAPTERS" not in os.environ and not hasattr(args.algo.kl, "preset")


def test_unknown_preset_names_the_valid_ones(actor_dir, capsys):
    with pytest.raises(SystemExit):
        cli_args(base_argv(actor_dir) + ["--algo.kl.preset", "sequense"], wrapper=True)
    assert "unknown KL preset 'sequense' (did you mean 'sequence'?); valid presets: sequence, reward" in capsys.readouterr().err


@pytest.mark.parametrize("extra, preset, message", [
    pytest.param(["--algo.kl.unbiased_gradient"], "sequence", "both choose the KL gradient",
                 marks=pytest.mark.skipif(not HAS_UNBIASED_GRADIENT, reason="the flag arrived in OpenRLHF 0.11.1")),
    (["--algo.kl.init_coef", "0"], "sequence", "silent no-op"),
    (["--algo.kl.use_loss"], "full", "needs the full next-token distributions"),
])
def test_loss_path_conflicts(actor_dir, extra, preset, message):
    with pytest.raises(ValueError, match=message):
        cli_args(base_argv(actor_dir) + extra + ["--algo.kl.preset", preset], wrapper=True)


@pytest.mark.parametrize("extra, preset, message", [
    ([], "sequence", "only presets 'reward' / 'reward-plain' apply"),
    ([], "reward:is_clip=2", "is_clip would be a silent no-op"),
    (["--algo.kl.estimator", "k3"], "reward", "estimator k3 would be silently ignored"),
    (["--algo.advantage.estimator", "reinforce", "--algo.advantage.gamma", "0.99"], "reward", "discounted"),
    pytest.param(["--actor.loss_agg_mode", "seq-mean-token-mean"], "reward", "length-normalized",
                 marks=pytest.mark.skipif(not HAS_LOSS_AGG_MODE, reason="the flag arrived in OpenRLHF 0.11.2")),
    (["--actor.policy_loss_type", "gspo"], "reward", "length-normalized"),
])
def test_reward_path_conflicts(actor_dir, extra, preset, message):
    with pytest.raises(ValueError, match=message):
        cli_args(reward_argv(actor_dir) + extra + ["--algo.kl.preset", preset], wrapper=True)


def test_untested_code_path_is_refused(actor_dir, monkeypatch):
    """DeepSpeed tensor parallelism needs several GPUs, so the CPU tests cannot run it: refused unless
    KL_ADAPTERS_ALLOW_UNTESTED=1; ring attention is accepted with no warning (test_ring_attention.py runs it)."""
    argv = base_argv(actor_dir) + ["--ds.tensor_parallel_size", "2", "--vllm.num_engines", "1",
                                   "--algo.kl.preset", "sequence"]
    monkeypatch.delenv("KL_ADAPTERS_ALLOW_UNTESTED", raising=False)  # scripts/compat.sh sets it for the whole suite
    with pytest.raises(UnsupportedFrameworkError, match="tensor_parallel_size"):
        cli_args(argv, wrapper=True)
    kl_adapters.disable()
    monkeypatch.setenv("KL_ADAPTERS_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="tensor_parallel_size"):
        cli_args(argv, wrapper=True)
    kl_adapters.disable()
    monkeypatch.delenv("KL_ADAPTERS_ALLOW_UNTESTED")
    ring = base_argv(actor_dir) + ["--ds.packing_samples", "--ds.ring_attn_size", "2", "--vllm.num_engines", "1",
                                   "--algo.kl.preset", "sequence"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cli_args(ring, wrapper=True)


def test_startup_hook_stays_light():
    """KL_ADAPTERS set: interpreter start (the .pth hook) imports no torch, and a vLLM worker's OpenRLHF import
    (openrlhf.trainer.ray -> vllm_engine) imports neither the adapter nor deepspeed."""
    code = ("import sys; light = 'torch' not in sys.modules and 'kl_adapters.activation' in sys.modules; "
            "import openrlhf.trainer.ray; "
            "print(light, 'kl_adapters.adapters.openrlhf' in sys.modules, 'deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KL_ADAPTERS": "sequence"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-3:] == ["True", "False", "False"]


@pytest.mark.parametrize("mode, preset", [("loss", "sequence"), ("reward", "reward")])
def test_example_arguments_parse(actor_dir, mode, preset):
    """examples/openrlhf_ppo.sh's arguments pass OpenRLHF's parser and validation, and kl-adapters' checks."""
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "openrlhf_ppo.sh")
    out = subprocess.run(["bash", example], env={**os.environ, "DRY_RUN": "1", "MODE": mode, "MODEL": actor_dir},
                         capture_output=True, text=True, check=True).stdout
    args = cli_args(out.split("\n")[:-1], wrapper=True)
    assert args.algo.kl.preset == preset and args.algo.kl.use_loss == (mode == "loss")
