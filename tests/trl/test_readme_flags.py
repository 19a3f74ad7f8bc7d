"""README.md's "Turn it on" row for TRL runs as written: each of its three forms, read from the table (not copied
here), trains a tiny random Llama for one GRPOTrainer step with the preset active.

The row's code spans, in order: the KLGRPOConfig call (its `...` filled with the suite's tiny-run arguments, the
README's own keywords kept), the TrlParser flags (parsed into KLGRPOConfig after the tiny-run arguments as flags) and
`KL_ADAPTERS=<value>` with its beta condition (TRL's GRPOConfig with the tiny run's beta, which must satisfy it; the
variable read as the .pth hook reads it). Each run: the trainer's settings are the form's preset, its beta is the
form's, and the adapter's KL term ran (kl_adapters/seq_kl logged once).
"""

import ast
import re
import shlex
from pathlib import Path

import pytest
from conftest import grpo_args, logged, make_trainer

from kl_adapters import activation
from kl_adapters.adapters import trl as adapter
from kl_adapters.adapters.metrics import SEQ_KL

README = Path(__file__).resolve().parents[2] / "README.md"


def trl_row_spans() -> list[str]:
    """The code spans of the "the change" cell of the TRL row in README.md's "## Turn it on" table."""
    section = README.read_text().split("## Turn it on", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0]]
    (row,) = [cells for cells in rows if cells[0].strip() == "TRL"]
    return re.findall(r"`([^`]+)`", row[header.index("the change")])


def span(prefix: str) -> str:
    (match,) = [s for s in trl_row_spans() if s.startswith(prefix)]
    return match


def tiny_run(**overrides) -> dict:
    """The suite's tiny-run GRPOConfig arguments (conftest.grpo_args), one optimizer step."""
    return grpo_args(lambda **kwargs: kwargs, max_steps=1, **overrides)


def config_form():
    """KLGRPOConfig as the README calls it, `...` the tiny run less the keywords the README sets; (args, no
    environment, the README's kl_preset and beta)."""
    call = span("KLGRPOConfig(")
    given = {k.arg: ast.literal_eval(k.value) for k in ast.parse(call, mode="eval").body.keywords}
    small = {k: v for k, v in tiny_run().items() if k not in given}
    args = eval(call.replace("...", "**small"), {"KLGRPOConfig": adapter.KLGRPOConfig, "small": small})
    return args, {}, given["kl_preset"], given["beta"]


def flags_form():
    """KLGRPOConfig from TrlParser: the tiny run as flags, then the README's flags; (args, no environment, the
    flags' kl_preset and beta)."""
    from trl import TrlParser

    flags = shlex.split(span("--"))
    given = dict(zip((f[2:] for f in flags[::2]), flags[1::2]))
    argv = [arg for k, v in tiny_run().items() if k not in given for arg in (f"--{k}", str(v))]
    (args,) = TrlParser((adapter.KLGRPOConfig,)).parse_args_into_dataclasses(argv + flags)
    return args, {}, given["kl_preset"], float(given["beta"])


def environment_form():
    """TRL's own GRPOConfig with the tiny run's beta, which must meet the README's condition, and the README's
    KL_ADAPTERS=<value>; (args, that environment, the value, the tiny run's beta)."""
    from trl import GRPOConfig

    name, value = span(f"{activation.ENV_VAR}=").split("=", 1)
    condition = next(s for s in trl_row_spans() if s.startswith("beta "))
    args = GRPOConfig(**tiny_run())
    assert eval(condition, {"beta": args.beta}), condition
    return args, {name: value}, value, args.beta


@pytest.mark.parametrize("form", [config_form, flags_form, environment_form], ids=["config", "flags", "environment"])
def test_readme_trl_row_runs_as_written(form, model_dir, dataset, monkeypatch):
    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    args, environment, preset, beta = form()
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    try:
        if environment:
            activation.activate_from_env(defer=True)  # as the installed .pth hook reads it
        trainer = make_trainer(model_dir, dataset, args=args)
        trainer.train()
        assert adapter.settings_for(trainer) == activation.parse(preset)
        assert trainer.beta == beta
        assert len(logged(trainer, SEQ_KL)) == 1
    finally:
        activation.disable()
