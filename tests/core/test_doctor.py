"""kl-adapters doctor, framework-free parts: the native-setting table, launch-script parsing, the verdict and exit
codes, the JSON document against its schema, and a clear exit 2 when the framework is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from kl_adapters import native
from kl_adapters.activation import parse
from kl_adapters.cli import main
from kl_adapters.doctor.report import (EXIT_CODES, OFF, ON, SCHEMA, AUDIT_ARGS, UNREADABLE, Fix, KLPath, Refused,
                                       Report, audit_numbers, format_report, refusals)
from kl_adapters.doctor.shell import UNRESOLVED, find_commands
from kl_adapters.presets import PRESETS

ALL_NATIVE = [
    native.trl_grpo_loss(True), native.trl_grpo_loss(False), native.trl_grpo_loss(True, "sequence"),
    native.trl_rloo_reward(),
    *(native.verl_loss(n) for n in ("kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs", "k3+", "low_var_kl+",
                                    "kl+", "full", "nope")),
    *(native.verl_reward(n, to_go=g) for n in ("kl", "k3", "low_var_kl+", "mse") for g in (True, False)),
    *(native.openrlhf_loss(e, u) for e in ("k1", "k2", "k3") for u in (False, True)),
    *(native.openrlhf_reward(e) for e in ("k1", "k2", "k3")),
]


def test_native_presets_exist():
    """Every mapping names a registered preset (or None), a reason and the framework source it was read from."""
    for kl in ALL_NATIVE:
        assert kl.preset is None or kl.preset in PRESETS
        assert kl.reason and ":" in kl.source


@pytest.mark.parametrize("call, preset", [
    (lambda: native.trl_grpo_loss(True), "token"), (lambda: native.trl_grpo_loss(False), "k3-loss"),
    (lambda: native.trl_grpo_loss(True, "sequence"), None), (native.trl_rloo_reward, "reward-sum"),
    (lambda: native.verl_loss("low_var_kl"), "k3-loss"), (lambda: native.verl_loss("k3+"), "k2-loss"),
    (lambda: native.verl_loss("kl"), "k1-loss"), (lambda: native.verl_loss("abs"), None),
    (lambda: native.verl_reward("kl", to_go=False), "reward-sum"),
    (lambda: native.verl_reward("kl", to_go=True), "reward-plain"),
    (lambda: native.verl_reward("low_var_kl", to_go=False), "k3-reward"),
    (lambda: native.openrlhf_loss("k3", True), "token"), (lambda: native.openrlhf_reward("k1"), "reward-plain"),
    (lambda: native.openrlhf_reward("k2"), None),
])
def test_native_mapping(call, preset):
    """The theory rows: k3 in the loss is the partial forward KL, rho * k3 (TRL) / unbiased_gradient (OpenRLHF) the
    per-token reverse KL, verl's "+" k2's gradient, k1 in the reward the (sequence-sum or to-go) exact estimator."""
    assert call().preset == preset


SCRIPT = r"""#!/bin/bash
set -x
export MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}  # a comment
BETA=0.001
LOSS=(actor_rollout_ref.actor.use_kl_loss=True
      "actor_rollout_ref.actor.kl_loss_coef=$BETA")  # trailing comment
case "$MODE" in
  reward) EXTRA=(algorithm.use_kl_in_reward=True) ;;
  *) EXTRA=(algorithm.use_kl_in_reward=False) ;;
esac
KL_ADAPTERS=sequence python3 -m verl.trainer.main_ppo \
    actor_rollout_ref.model.path=$MODEL \
    "${LOSS[@]}" "${EXTRA[@]}" \
    trainer.default_local_dir=$CKPT/run \
    trainer.experiment_name=$(date +%s) $@
"""


def test_shell_continuations_variables_arrays_case():
    (command,) = find_commands(SCRIPT, ("verl.trainer.main_ppo",), {})
    assert command.line == 11 and command.variables["KL_ADAPTERS"] == "sequence"
    assert command.args[:4] == ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B", "actor_rollout_ref.actor.use_kl_loss"
                                "=True", "actor_rollout_ref.actor.kl_loss_coef=0.001", "algorithm.use_kl_in_reward=False"]
    (reward,) = find_commands(SCRIPT, ("verl.trainer.main_ppo",), {"MODE": "reward", "MODEL": "m"})
    assert reward.args[0] == "actor_rollout_ref.model.path=m" and "algorithm.use_kl_in_reward=True" in reward.args


def test_shell_reports_what_it_cannot_resolve():
    (command,) = find_commands(SCRIPT, ("verl.trainer.main_ppo",), {})
    assert command.args[-2] == f"trainer.default_local_dir={UNRESOLVED}CKPT/run"
    assert command.args[-1].startswith(f"trainer.experiment_name={UNRESOLVED}")
    assert "$CKPT" in command.unresolved and f"{UNRESOLVED}date_s" in command.unresolved
    assert any(u.startswith("$@") for u in command.unresolved)


def test_shell_module_as_path_and_no_command():
    text = "ray job submit -- python3 /opt/openrlhf/cli/train_ppo_ray.py --algo.kl.use_loss\n"
    (command,) = find_commands(text, ("openrlhf.cli.train_ppo_ray",), {})
    assert command.args == ["--algo.kl.use_loss"]
    assert find_commands("echo hello\n", ("openrlhf.cli.train_ppo_ray",), {}) == []


def _report(*paths: tuple[str, str | None], regimes=(ON,), hazards=()) -> Report:
    report = Report("verl", "0.9.1", "constructed", regimes=regimes)
    for where, preset in paths:
        report.paths.append(KLPath(where, f"{where} setting", 0.1, native.NativeKL(preset, "why", "file.py:1")))
    for severity in hazards:
        report.add("constructed", severity, "a hazard")
    return report


@pytest.mark.parametrize("report, verdict", [
    (_report(), "no-kl"),
    (_report(("loss", "sequence")), "unbiased"),
    (_report(("loss", "sequence"), regimes=(ON, OFF)), "unbiased"),
    (_report(("reward", "reward-sum")), "unbiased"),
    (_report(("reward", "reward-sum"), regimes=(ON, OFF)), "biased"),  # unbiased on-policy only
    (_report(("loss", "k3-loss")), "biased"),
    (_report(("loss", None)), "biased"),  # no preset has this gradient
    (_report(("loss", "sequence"), hazards=("bias",)), "biased"),
    (_report(("loss", "sequence"), hazards=("warning",)), "unbiased"),
    (_report(("loss", "k3-loss"), hazards=("no-op",)), "no-op"),
    (_report(hazards=("no-op",)), "no-op"),
    (_report(("loss", "k3-loss"), hazards=("no-op", "refused")), "refused"),
    (_report(hazards=("refused",)), "refused"),
])
def test_verdict_and_exit_code(report, verdict):
    """The documented exit codes (docs/doctor.md): 0 unbiased / no KL, 1 biased / no-op, 3 refused (2: unreadable)."""
    assert report.verdict == verdict and report.exit_code == EXIT_CODES[verdict]
    assert report.exit_code == {"unbiased": 0, "no-kl": 0, "biased": 1, "no-op": 1, "refused": 3}[verdict] != UNREADABLE


def test_a_refusal_ends_the_analysis_as_the_verdict_refused():
    report = Report("verl", "0.9.1", "constructed")
    with refusals(report):
        raise Refused("kl-adapters refuses it: why; the fix")
    with refusals(report):
        parse("sequnce", setting="kl_preset")
    assert report.verdict == "refused" and report.exit_code == 3
    assert [h.message for h in report.hazards] == ["kl-adapters refuses it: why; the fix", "kl_preset='sequnce': "
                                                   "unknown KL preset 'sequnce' (did you mean 'sequence'?); valid "
                                                   "presets: " + ", ".join(PRESETS)]
    assert "KL: none configured" not in format_report(report)  # a refusal is not "no KL" (issue 49)


def test_a_biased_verdict_says_what_it_does_not_tell_and_how_to_find_out():
    """The verdict is about the estimator; whether it matters for a run is what `kl-adapters measure` measures."""
    biased = format_report(_report(("loss", "k3-loss")))
    assert "what this does not tell" in biased and "kl-adapters measure" in biased and "--launch verl" in biased
    assert "what this does not tell" not in format_report(_report(("loss", "sequence")))
    assert "KL: none configured" in format_report(_report())


def test_untested_version_is_a_warning():
    report = Report("trl", "0.0.1", "constructed")
    report.check_version()
    assert [(h.code, h.severity) for h in report.hazards] == [("untested-version", "warning")]
    assert not report.tested and report.verdict == "no-kl"


def test_audit_numbers_are_the_audit_rows():
    """The report's bias and cosine are the exact audit's rows for that preset (AUDIT_PROBLEM)."""
    from kl_adapters.audit import audit

    rows = {r.regime: r for r in audit(*AUDIT_ARGS, presets=("k3-loss",), is_clip=None)}
    numbers = audit_numbers("k3-loss")
    for regime in (ON, OFF):
        assert numbers[regime]["relative_bias"] == round(rows[regime].relative_bias, 4)
        assert numbers[regime]["cosine"] == round(rows[regime].cosine, 4)
    assert audit_numbers("sequence")[ON]["relative_bias"] < 1e-6


def _check(value, schema: dict, where: str = "$") -> None:
    """The subset of JSON Schema that SCHEMA uses (the core environment has no jsonschema; the verl and OpenRLHF
    suites validate the same documents with jsonschema itself)."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
             "number": (int, float)}
    if "const" in schema:
        assert value == schema["const"], where
    if "enum" in schema:
        assert value in schema["enum"], where
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(isinstance(value, kinds[t]) and not (t == "number" and isinstance(value, bool)) for t in types), where
    if isinstance(value, dict):
        assert set(schema.get("required", ())) <= set(value), where
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (where, set(value) - set(props))
        for key, item in value.items():
            sub = props.get(key, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                _check(item, sub, f"{where}.{key}")
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), where
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{where}[{i}]")


def test_json_schema():
    report = _report(("loss", "k3-loss"), ("reward", None), regimes=(ON, OFF), hazards=("bias", "warning"))
    report.fix = Fix("sequence", ("a=b",), "beta text")
    report.unresolved.append("$HOME")
    _check(report.as_dict(), SCHEMA)
    _check(_report().as_dict(), SCHEMA)
    _check(_report(("loss", "full"), hazards=("refused",)).as_dict(), SCHEMA)  # full: no audit row (audit null)
    with pytest.raises(AssertionError):
        _check({**report.as_dict(), "verdict": "fine"}, SCHEMA)


def test_table_has_colours_only_when_asked():
    report = _report(("loss", "k3-loss"), hazards=("bias",))
    plain, coloured = format_report(report), format_report(report, colour=True)
    assert "\033[" not in plain and "\033[31m" in coloured
    assert "verdict: BIASED (exit 1)" in plain and "k3-loss" in plain and "0.544" in plain


@pytest.mark.parametrize("framework", ["trl", "verl", "openrlhf"])
def test_missing_framework_exits_2(framework, capsys):
    if importlib.util.find_spec(framework) is not None:
        pytest.skip(f"{framework} is installed in this environment")
    assert main(["doctor", framework, "--json"]) == UNREADABLE == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{framework} is not installed in this Python" in line and f'pip install ".[{framework}]"' in line


def test_shell_arithmetic_word_splitting_and_pipes():
    text = ("N=4\nMAX=$(((N + 2) * 1024))\nEXTRA=\"a=1 b=2\"\n"
            "python3 -m verl.trainer.main_ppo x=$((N * 64)) y=$MAX z=$((N * M)) $EXTRA 2>&1 | tee log.txt\n")
    (command,) = find_commands(text, ("verl.trainer.main_ppo",), {})
    assert command.args == ["x=256", "y=6144", f"z={UNRESOLVED}N_M", "a=1", "b=2"]


def _exceptions() -> list[Exception]:
    """An instance of every built-in exception type that takes a message (a multi-line one), and DoctorError."""
    import builtins

    from kl_adapters.doctor import DoctorError

    made = [DoctorError("first line\nsecond line")]
    for kind in vars(builtins).values():
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                made.append(kind("first line\nsecond line"))
            except TypeError:  # e.g. UnicodeDecodeError's five arguments
                continue
    return made


@pytest.mark.parametrize("framework", ["trl", "verl", "openrlhf"])
def test_no_exception_type_escapes_as_a_traceback(framework, monkeypatch, capsys):
    """Whatever a reader raises, `kl-adapters doctor` exits 2 with one line on stderr naming the framework."""
    reader = importlib.import_module(f"kl_adapters.doctor.{framework}")
    for error in _exceptions():
        def read(argv, **options):
            raise error

        monkeypatch.setattr(reader, "read", read)
        assert main(["doctor", framework, "--some", "args"]) == 2, type(error)
        captured = capsys.readouterr()
        (line,) = captured.err.splitlines()
        assert line.startswith(f"kl-adapters doctor: cannot read this {framework} configuration: ") and not captured.out
        assert "first line" in line, line


def test_shell_array_append_in_case_branches():
    """``args+=( ... )``, as the project's own examples/openrlhf_ppo.sh builds its arguments per MODE."""
    text = ("MODE=${MODE:-loss}\nargs=(\n  --a 1\n)\ncase \"$MODE\" in\n  loss)   # the loss path\n"
            "    args+=(--algo.kl.use_loss)\n    args+=(--algo.kl.preset sequence) ;;   # kl-adapters\n"
            "  reward) args+=(--algo.kl.preset reward) ;;\nesac\nexec python -m openrlhf.cli.train_ppo_ray \"${args[@]}\"\n")
    (loss,) = find_commands(text, ("openrlhf.cli.train_ppo_ray",), {})
    assert loss.args == ["--a", "1", "--algo.kl.use_loss", "--algo.kl.preset", "sequence"]
    (reward,) = find_commands(text, ("openrlhf.cli.train_ppo_ray",), {"MODE": "reward"})
    assert reward.args == ["--a", "1", "--algo.kl.preset", "reward"]
