"""Every way to switch kl-adapters on in TRL accepts and refuses the same values (tests/activation_table.py):
KLGRPOConfig(kl_preset=...), TrlParser's --kl_preset, and KL_ADAPTERS into a real GRPOTrainer (every value in this
process as the .pth hook reads it; one value of each outcome through the installed .pth hook in a fresh interpreter);
a refused KL_ADAPTERS stops the script at `from trl import GRPOTrainer` (exit 1, one line), never training with TRL's
own KL; one activation line per process."""

import logging
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import grpo_args, make_trainer

from kl_adapters import activation
from kl_adapters.activation import SettingError
from kl_adapters.adapters import trl as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from activation_table import (FRESH, activate_as_the_hook, activation_lines, cases, check_refusal,  # noqa: E402
                              check_refused_environment, run_each)

#: the outcomes a fresh interpreter can have in TRL (every preset runs in TRL: none is refused by the framework)
FRESH_TRL = tuple(value for outcome, value in FRESH.items() if outcome != "refused by the framework")


@pytest.mark.parametrize(("value", "refused"), cases("trl"))
def test_table_on_the_config_field(value, refused, monkeypatch):
    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    if refused is None:
        assert adapter.settings_of(grpo_args(kl_preset=value)) == activation.parse(value)
        return
    with pytest.raises(SettingError) as error:
        grpo_args(kl_preset=value)
    check_refusal(str(error.value), refused, f"kl_preset={value!r}")


@pytest.mark.parametrize(("value", "refused"), cases("trl"))
def test_table_on_the_trl_parser_flag(value, refused, monkeypatch):
    from trl import TrlParser

    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    argv = ["--output_dir", tempfile.mkdtemp(), "--kl_preset", value, "--beta", "0.1", "--use_cpu", "true",
            "--report_to", "none"]
    if refused is None:
        (args,) = TrlParser((adapter.KLGRPOConfig,)).parse_args_into_dataclasses(argv)
        assert adapter.settings_of(args) == activation.parse(value)
        return
    with pytest.raises(SettingError) as error:
        TrlParser((adapter.KLGRPOConfig,)).parse_args_into_dataclasses(argv)
    check_refusal(str(error.value), refused, f"kl_preset={value!r}")


SCRIPT = textwrap.dedent("""
    import sys, tempfile, warnings
    warnings.filterwarnings("ignore")
    from trl import GRPOConfig, GRPOTrainer  # a refused KL_ADAPTERS stops the script here
    from datasets import Dataset
    import kl_adapters
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, beta=0.1, max_steps=1, report_to="none",
                      save_strategy="no", gradient_checkpointing=False)
    ds = Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(8)]})
    trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=lambda completions, **k: [0.0] * len(completions),
                          args=args, train_dataset=ds)
    print("CONSTRUCTED", kl_adapters.active())
""")


def activation_line(value: str) -> str:
    """The one line a GRPOTrainer (beta 0.1) logs when KL_ADAPTERS=`value` applies."""
    settings = activation.parse(value)
    return (f"kl-adapters: preset {settings.preset} active in trl 1.16.0 (KL path: loss"
            + "".join(f"; {key} {getattr(settings, key):g}" for key in activation.OPTIONS
                      if getattr(settings, key) is not None) + "; beta 0.1)")


@pytest.mark.parametrize(("value", "refused"), cases("trl"))
def test_table_on_kl_adapters(value, refused, model_dir, dataset, monkeypatch, caplog):
    """KL_ADAPTERS read as the .pth hook reads it (`activate_from_env(defer=True)`), in this process: accepted, a
    GRPOTrainer is built with the preset active and logs one activation line; refused, every use raises the one line
    naming KL_ADAPTERS, and the import hook would stop TRL's import with it (SystemExit)."""
    from trl import GRPOConfig

    activate_as_the_hook(value, monkeypatch, caplog)
    try:
        if refused is None:
            make_trainer(model_dir, dataset, args=grpo_args(GRPOConfig, max_completion_length=6, max_steps=1))
            assert activation.active() == activation.parse(value)
            assert activation_lines(caplog) == [activation_line(value)]
            return
        check_refused_environment(value, refused)
    finally:
        activation.disable()


@pytest.fixture(scope="module")
def environment_runs(model_dir, tmp_path_factory) -> dict:
    """A fresh interpreter per outcome (`FRESH_TRL`) with KL_ADAPTERS set, importing TRL and building a GRPOTrainer,
    all at once (each imports TRL: seconds apiece)."""
    tmp = tmp_path_factory.mktemp("env")
    (tmp / "train.py").write_text(SCRIPT)  # HF_HUB_OFFLINE: conftest
    return run_each([sys.executable, "train.py", model_dir], tmp, FRESH_TRL, at_once=len(FRESH_TRL))


@pytest.mark.parametrize(("value", "refused"), cases("trl", FRESH_TRL))
def test_table_through_kl_adapters_and_the_pth_hook(environment_runs, value, refused):
    """The zero-code path: KL_ADAPTERS on a script that never imports kl-adapters before TRL. Accepted: the trainer
    is built with the preset active and one activation line. Refused: exit 1 at the import of GRPOTrainer with one
    line (Python's site module would have swallowed a .pth error and let TRL train with its own KL)."""
    returncode, out, err = environment_runs[value]
    if refused is None:
        settings = activation.parse(value)
        assert returncode == 0 and f"CONSTRUCTED {settings}" in out, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("kl-adapters: preset")]
        assert lines == [activation_line(value)], err[-3000:]
        return
    assert returncode == 1 and "CONSTRUCTED" not in out, (out, err[-3000:])
    (line,) = err.strip().splitlines()
    assert line.startswith("kl-adapters: ")
    check_refusal(line, refused, f"KL_ADAPTERS={value!r}")


def test_one_activation_line_per_process_not_per_step(model_dir, dataset, monkeypatch, caplog):
    monkeypatch.setattr(activation, "_announced", set())
    caplog.set_level(logging.WARNING, logger="kl_adapters")
    make_trainer(model_dir, dataset, kl_preset="sequence", max_steps=3).train()
    make_trainer(model_dir, dataset, kl_preset="sequence", max_steps=1)  # a second trainer, the same setting
    assert activation_lines(caplog) == ["kl-adapters: preset sequence active in trl 1.16.0 (KL path: loss; beta 0.1)"]


@pytest.mark.parametrize("route", ["kl_preset", "KL_ADAPTERS"])
def test_a_preset_with_beta_zero_is_refused_on_every_path(model_dir, dataset, monkeypatch, route):
    """TRL builds no reference model with beta 0: a preset there would be a silent no-op (without a kl_target, which
    starts beta instead: tests/trl/test_budget.py)."""
    from trl import GRPOConfig

    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    if route == "kl_preset":
        with pytest.raises(SettingError, match="kl_preset='sequence' with beta=0.0 would be a silent no-op"):
            grpo_args(beta=0.0)
        return
    activation.enable("sequence")
    try:
        with pytest.raises(SettingError, match="KL_ADAPTERS='sequence' with beta=0.0 would be a silent no-op"):
            make_trainer(model_dir, dataset, args=grpo_args(GRPOConfig, beta=0.0))
    finally:
        activation.disable()
