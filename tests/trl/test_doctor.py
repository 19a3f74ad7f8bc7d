"""kl-adapters doctor on TRL 1.16: the ``trl grpo`` / ``trl rloo`` parser path (arguments, YAML via --config, an
example script), every TRL hazard on a constructed config, the fix re-read, the JSON schema, the exit codes, and
agreement with the adapter (its native preset, KLGRPOConfig's and RLOOTrainer's refusals)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kl_adapters.adapters import trl as adapter
from kl_adapters.adapters.trl import loss as trl_loss
from kl_adapters.cli import main
from kl_adapters.doctor import SCHEMA, DoctorError, diagnose

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support_verdicts import check_verdict_printed  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "doctor" / "trl"


def doctor(*argv: str, trainer: str = "grpo"):
    return diagnose("trl", list(argv), trainer=trainer)


def codes(report) -> dict[str, str]:
    return {h.code: h.severity for h in report.hazards}


def test_defaults_have_no_kl():
    report = doctor()
    assert report.verdict == "no-kl" and report.exit_code == 0 and report.version == "1.16.0" and report.tested


@pytest.mark.parametrize("bias_correction, preset", [("true", "token"), ("false", "k3-loss")])
def test_grpo_kl_loss_and_adapter_agree(bias_correction, preset):
    """The doctor's preset is the adapter's native preset (its grad_weight_gap reference), which
    tests/trl/test_grpo_gradients.py::test_token_preset_is_native_trl pins to TRL's own gradient."""
    report = doctor("--beta", "0.04", "--use_bias_correction_kl", bias_correction)
    (path,) = report.paths
    assert path.path == "loss" and path.native.preset == preset and report.verdict == "biased"
    trainer = SimpleNamespace(args=SimpleNamespace(use_bias_correction_kl=bias_correction == "true"))
    assert trl_loss._native_preset(trainer) == preset


@pytest.mark.parametrize("argv, trainer, code, severity", [
    (["--kl_preset", "sequence"], "grpo", "refused", "refused"),
    (["--beta", "0.04", "--loss_type", "grpo"], "grpo", "length-normalized", "bias"),
    (["--beta", "0.04", "--loss_type", "sapo"], "grpo", "length-normalized", "bias"),
    (["--beta", "0.04", "--importance_sampling_level", "sequence"], "grpo", "sequence-is", "bias"),
    (["--beta", "0.04", "--use_vllm", "true", "--vllm_importance_sampling_correction", "true"], "grpo", "vllm-is",
     "warning"),
    (["--beta", "0.05", "--normalize_advantages", "true"], "rloo", "std-normalized-reward", "bias"),
    (["--beta", "0.05", "--num_iterations", "2"], "rloo", "stale-kl-reward", "bias"),
])
def test_hazard(argv, trainer, code, severity):
    report = doctor(*argv, trainer=trainer)
    assert codes(report).get(code) == severity, report.hazards
    assert report.exit_code == {"refused": 3, "warning": report.exit_code}.get(severity, 1)


def test_kl_preset_with_beta_zero_is_what_klgrpoconfig_refuses():
    with pytest.raises(ValueError, match="silent no-op"):
        adapter.KLGRPOConfig(kl_preset="sequence", beta=0.0, use_cpu=True)
    report = doctor("--kl_preset", "sequence")
    assert report.verdict == "refused" and "silent no-op" in report.hazards[0].message


def test_kl_budget_is_noted_and_a_fixed_beta_is_told_how_to_state_one():
    report = doctor("--kl_preset", "sequence", "--beta", "0.04", "--kl_target", "0.5")
    assert report.verdict == "unbiased" and report.paths[0].setting.startswith("kl_preset=sequence:kl_target=0.5")
    assert any(n.startswith("KL budget: 0.5 nats of KL(pi || pi_ref) per sequence; beta=0.04 is the controller's "
                            "starting value and follows once per optimizer step") for n in report.notes)
    fixed = doctor("--kl_preset", "sequence", "--beta", "0.04")
    assert any("set --kl_target=<the run's logged kl_adapters/seq_kl" in n for n in fixed.notes)


@pytest.mark.parametrize("argv, message", [
    (["--kl_target", "-1"], "kl_target must be a finite number > 0"),
    (["--kl_target", "nan"], "kl_target must be a finite number > 0"),
    (["--kl_preset", "token"], "does not follow its gradient"),
    (["--kl_preset", "reward", "--num_iterations", "2"], "off-policy"),
    (["--kl_is_clip", "2"], "capped importance weights"),
])
def test_budgets_klgrpoconfig_refuses_are_reported_refused(argv, message):
    """The doctor's refusal is KLGRPOConfig's own (same message): the verdict refused, exit 3."""
    argv = ["--kl_preset", "sequence", "--beta", "0.04", "--kl_target", "0.5", *argv]
    report = doctor(*argv)
    (refused,) = [h for h in report.hazards if h.code == "refused"]
    assert refused.severity == "refused" and message in refused.message and report.exit_code == 3
    fields = dict(zip(argv[::2], argv[1::2]))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        adapter.KLGRPOConfig(kl_preset=fields["--kl_preset"], beta=0.04, kl_target=float(fields["--kl_target"]),
                             kl_is_clip=float(fields["--kl_is_clip"]) if "--kl_is_clip" in fields else None,
                             num_iterations=int(fields.get("--num_iterations", 1)), use_cpu=True)


def test_off_policy_regimes():
    assert doctor("--beta", "0.04").regimes == ("on-policy",)
    report = doctor("--beta", "0.04", "--num_iterations", "2")
    assert report.regimes == ("on-policy", "off-policy") and "num_iterations=2" in report.off_policy_reason
    assert doctor("--beta", "0.04", "--gradient_accumulation_steps", "2", "--steps_per_generation", "4").regimes == (
        "on-policy", "off-policy")


def test_fix_makes_grpo_unbiased():
    report = doctor("--beta", "0.04", "--loss_type", "grpo", "--num_iterations", "2")
    assert report.fix.preset == "sequence" and any("--kl_preset sequence" in line for line in report.fix.lines)
    fixed = doctor("--beta", "0.04", "--loss_type", "grpo", "--num_iterations", "2", "--kl_preset", "sequence")
    assert fixed.verdict == "unbiased" and fixed.paths[0].native.preset == "sequence" and fixed.exit_code == 0
    assert fixed.regimes == ("on-policy", "off-policy")


def test_rloo_on_policy_is_unbiased_and_off_policy_refused_by_the_adapter():
    """RLOO's k1-in-reward is exact on-policy (reward-sum); the settings the doctor calls biased are those
    RLOOTrainer refuses under KL_ADAPTERS (adapters/trl/trainer_init.py::_check_rloo)."""
    report = doctor("--beta", "0.05", trainer="rloo")
    assert [p.native.preset for p in report.paths] == ["reward-sum"] and report.verdict == "unbiased"
    for argv in (["--normalize_advantages", "true"], ["--num_iterations", "2"]):
        assert doctor("--beta", "0.05", *argv, trainer="rloo").verdict == "biased"
    assert doctor("--beta", "0", trainer="rloo").verdict == "no-kl"


def test_world_size_only_matters_to_trls_batch_checks():
    """GRPOConfig checks generation_batch_size against the world size: 16 generations need 2 processes of 8."""
    argv = ["--beta", "0.04", "--num_generations", "16", "--per_device_train_batch_size", "8"]
    refused = r"\(1 process\(es\); --num_processes N sets it\).*divisible by num_generations \(16\)"
    with pytest.raises(DoctorError, match=refused):
        doctor(*argv)
    assert doctor(*argv, "--num_processes", "2").paths[0].native.preset == "token"


def test_yaml_config(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text("beta: 0.04\nloss_type: dr_grpo\nkl_preset: sequence\n")
    report = diagnose("trl", [str(config)])
    assert report.paths[0].native.preset == "sequence" and report.verdict == "unbiased"
    config.write_text("beta: 0.04\nloss_type: grpo\n")
    assert codes(diagnose("trl", [str(config)])) == {"length-normalized": "bias"}


def test_example_script():
    """TRL's examples/scripts/rloo.py (vendored, tests/fixtures/doctor/MANIFEST): RLOOConfig(...) literals with
    gradient_accumulation_steps=2, steps_per_generation=8, i.e. one rollout for 4 optimizer steps."""
    report = diagnose("trl", [str(FIXTURES / "rloo.py")])
    assert [p.native.preset for p in report.paths] == ["reward-sum"] and report.paths[0].beta == 0.05
    assert report.regimes == ("on-policy", "off-policy") and report.verdict == "biased"


@pytest.mark.parametrize("argv, code", [
    ([], 0), (["--beta", "0.04"], 1), (["--beta", "0.04", "--kl_preset", "sequence"], 0),
    (["--beta", "0.04", "--kl_preset", "full"], 0), (["--kl_preset", "sequence", "--kl_target", "0.5"], 0),
    (["--kl_preset", "sequence"], 3), (["--beta", "0.04", "--no_such_flag", "1"], 2),
    (["--beta", "0.04", "--kl_preset", "nope"], 3), (["--beta", "0.04", "--kl_preset", "full", "--kl_is_clip", "2"], 3),
    (["--beta", "0.04", "--kl_preset", "sequence", "--kl_target", "-1"], 3), (["--trainer", "ppo"], 2),
])
def test_exit_codes_and_json(argv, code, capsys):
    assert main(["doctor", "trl", "--json", *argv]) == code
    out = capsys.readouterr().out
    if code != 2:
        doc = json.loads(out)
        assert doc["exit_code"] == code and set(doc) == set(SCHEMA["required"])


#: partial command lines, as a user asks "is my KL setting right?": no model, dataset or output folder
PARTIAL = [
    (["--beta", "0.04"], "token"),
    (["--beta", "0.04", "--loss_type", "dr_grpo"], "token"),
    (["--beta", "0.1", "--use_bias_correction_kl", "false"], "k3-loss"),
    (["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--beta", "0.1"], "token"),
    (["--dataset_name", "trl-lib/tldr", "--beta", "0.1", "--num_generations", "4"], "token"),
    (["--beta", "0.1", "--bf16", "true"], "token"),
    (["--beta", "0.1", "--kl_preset", "sequence"], "sequence"),
]


@pytest.mark.parametrize("argv, preset", PARTIAL)
def test_partial_command_lines(argv, preset):
    assert [p.native.preset for p in doctor(*argv).paths] == [preset]


@pytest.mark.parametrize("argv, message", [
    (["--beta"], "TRL's parser refused the arguments: argument --beta: expected one argument"),
    (["--beta", "abc"], "argument --beta: invalid float value: 'abc'"),
    (["--beta", "0.1", "--per_device_train_batch_size", "3"], "generation_batch_size (3) must be divisible by "
                                                             "num_generations (8)"),
    (["--beta", "0.1", "--bogus", "1"], "arguments TRL's grpo parser does not know: --bogus 1"),
    (["no_such_config.yaml"], "cannot read no_such_config.yaml: No such file or directory"),
    (["no_such_script.py"], "cannot read no_such_script.py"),
    (["--trainer"], "--trainer must be one of grpo, rloo, got ''"),
    (["--num_processes", "two", "--beta", "0.1"], "--num_processes needs an integer"),
])
def test_unreadable_command_lines_get_one_plain_line(argv, message, capsys):
    """Exit 2 and one line on stderr naming the problem: no traceback, no argparse usage, no library warnings."""
    assert main(["doctor", "trl", *argv]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("kl-adapters doctor: cannot read this trl configuration: ") and message in line
    assert captured.out == ""


def test_no_library_warnings_on_a_readable_command_line(capsys):
    assert main(["doctor", "trl", "--beta", "0.04"]) == 1
    assert capsys.readouterr().err == ""


#: GRPO with `sequence`, on-policy, one process: no setting of the support matrix on
SUPPORT_BASE = ["--beta", "0.04", "--kl_preset", "sequence"]


def test_full_under_sharding_is_refused(tmp_path):
    """kl_preset='full' under FSDP is refused with the line GRPOTrainer's construction raises
    (trainer_init.sharded_head_refusal), `sequence` there is not; DeepSpeed's ZeRO stage is read from the `deepspeed`
    config, a dict or a JSON file (TrainingArguments needs deepspeed installed to parse one, which this environment has
    not)."""
    from kl_adapters.doctor.trl import _zero_stage

    fsdp = ["--fsdp", "full_shard auto_wrap"]
    report = doctor("--beta", "0.04", "--kl_preset", "full", *fsdp)
    assert report.verdict == "refused"
    assert [h.message for h in report.hazards if h.code == "refused"][0].startswith(
        "kl_preset='full' is refused under FSDP: ")
    assert doctor("--beta", "0.04", "--kl_preset", "sequence", *fsdp).verdict != "refused"
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3}}')
    assert _zero_stage(str(config)) == 3 and _zero_stage({"zero_optimization": {"stage": 2}}) == 2
    assert _zero_stage(None) is None and _zero_stage({"zero_optimization": {"stage": "auto"}}) is None


@pytest.mark.parametrize("key, extra", [
    ("lora", ["--use_peft"]), ("vllm", ["--use_vllm", "true"]), ("sharding", ["--fsdp", "full_shard auto_wrap"]),
    ("data-parallel", ["--num_processes", "2"]),
    ("vision-language", ["--model_name_or_path", "Qwen/Qwen2.5-VL-3B-Instruct"]),
    ("vision-language-other", ["--model_name_or_path", "openbmb/MiniCPM-o-2_6"]),
    ("liger", ["--use_liger_kernel", "true"]), ("off-policy", ["--num_iterations", "2"]),
])
def test_support_settings_print_their_verdict(key, extra):
    """Each setting of the support matrix the doctor reads prints the matrix's verdict (kl_adapters.support): a note
    when tested, a warning when accepted untested or refused."""
    check_verdict_printed("trl", key, doctor(*SUPPORT_BASE, *extra), doctor(*SUPPORT_BASE))
