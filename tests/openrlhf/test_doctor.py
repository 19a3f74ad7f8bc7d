"""kl-adapters doctor on OpenRLHF 0.11.2: its own train_ppo_ray parser (the same args as running the module, without
Ray or vLLM), launch scripts (a vendored OpenRLHF example, tests/fixtures/doctor/MANIFEST), every OpenRLHF hazard on
a constructed config, the fix re-read, the JSON schema, the exit codes, and agreement of the mapping with OpenRLHF's
compute_approx_kl gradient and with the adapter's native preset and refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from kl_adapters import native
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.cli import main
from kl_adapters.doctor import SCHEMA, DoctorError, diagnose
from kl_adapters.doctor.openrlhf import parse
from kl_adapters.surrogate import kl_term
from openrlhf_harness import HAS_LOSS_AGG_MODE, HAS_UNBIASED_GRADIENT, base_argv, cli_args, lacking, param_for_release

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support_verdicts import check_verdict_printed  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "doctor" / "openrlhf"
BASE = ["--actor.model_name_or_path", "m", "--reward.remote_url", "http://127.0.0.1:1",
        "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "32", "--train.batch_size", "128"]
LOSS = BASE + ["--algo.advantage.estimator", "group_norm", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]


def doctor(*argv: str):
    return diagnose("openrlhf", list(argv), env={})


def codes(report) -> dict[str, str]:
    return {h.code: h.severity for h in report.hazards}


def test_parser_is_openrlhfs():
    """The doctor's args equal those of train_ppo_ray run as __main__ (the suite's harness, with its CPU stubs)."""
    argv = base_argv("unused")
    ours, theirs = parse(argv)[0], cli_args(argv)
    for group in ("kl", "advantage"):
        assert vars(getattr(ours.algo, group)) == vars(getattr(theirs.algo, group))
    assert vars(ours.train) == vars(theirs.train) and vars(ours.rollout) == vars(theirs.rollout)


@pytest.mark.parametrize("estimator, unbiased", [
    ("k1", False), ("k2", False), ("k3", False),
    pytest.param("k3", True, marks=pytest.mark.skipif(not HAS_UNBIASED_GRADIENT,
                                                      reason="unbiased_gradient arrived in OpenRLHF 0.11.1"))])
def test_mapping_is_openrlhfs_own_gradient(estimator, unbiased):
    """d compute_approx_kl / d log_probs (OpenRLHF's code; a stale policy for unbiased_gradient) equals the per-token
    weight of the preset the doctor names (token with is_clip=10 for unbiased_gradient), and the adapter's."""
    from openrlhf.models.utils import compute_approx_kl

    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2 - 0.5).requires_grad_(True)
    ref = logp.detach() + 0.5 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64) if unbiased else None
    stale = {"log_probs_old": old, "unbiased_gradient": True} if unbiased else {}  # before 0.11.1: no such arguments
    kl = compute_approx_kl(logp, ref, kl_estimator=estimator, **stale)
    (weight,) = torch.autograd.grad(kl.sum(), logp)
    preset = native.openrlhf_loss(estimator, unbiased).preset
    clip = native.OPENRLHF_IS_WEIGHT_CLIP if unbiased else None
    expected = kl_term(logp.detach(), ref, torch.ones(3, 5, dtype=torch.bool), preset=preset, old_logp=old,
                       is_clip=clip).coefficients
    torch.testing.assert_close(weight, expected.to(weight.dtype), rtol=1e-5, atol=1e-6)  # OpenRLHF works in float32


def test_default_is_k1_reward_to_go():
    report = doctor(*BASE, "--rollout.batch_size", "32", "--train.batch_size", "128")
    (path,) = report.paths
    assert (path.path, path.native.preset, report.regimes) == ("reward", "reward-plain", ("on-policy",))
    assert report.verdict == "unbiased" and {"clamp", "std-normalized-reward"} == set(codes(report))


def test_off_policy_regimes():
    report = doctor(*BASE, "--train.batch_size", "64")
    assert report.regimes == ("on-policy", "off-policy") and "64 < 128 samples" in report.off_policy_reason
    assert report.verdict == "biased"  # reward-plain has a per-token ratio only
    assert doctor(*BASE, "--train.max_epochs", "2").regimes == ("on-policy", "off-policy")


HAZARDS = [
    (LOSS + ["--algo.kl.init_coef", "0"], "zero-coefficient", "no-op"),
    (LOSS, "clamp", "warning"),
    (LOSS, "token-mean", "warning"),
    (BASE + ["--algo.kl.target", "0.1"], "adaptive-controller", "warning"),
    (BASE + ["--algo.advantage.estimator", "reinforce", "--algo.advantage.gamma", "0.99"], "discounted", "bias"),
    (BASE + ["--algo.advantage.lambd", "0.95", "--critic.model_name_or_path", "m"], "gae-lambda", "bias"),
    (BASE + ["--actor.loss_agg_mode", "seq-mean-token-mean"], "length-normalized", "bias"),
    (BASE + ["--actor.policy_loss_type", "gspo"], "length-normalized", "bias"),
    (BASE + ["--algo.kl.estimator", "k2"], "unsupported-estimator", "bias"),
    (LOSS + ["--algo.kl.preset", "sequence", "--algo.kl.unbiased_gradient"], "refused", "refused"),
    (LOSS + ["--algo.kl.preset", "sequence", "--algo.kl.init_coef", "0"], "refused", "refused"),
    (BASE + ["--algo.kl.preset", "sequence"], "refused", "refused"),
    (BASE + ["--algo.kl.preset", "reward", "--algo.kl.estimator", "k3"], "refused", "refused"),
    (LOSS + ["--algo.kl.preset", "sequence", "--algo.kl.seq_target", "0.5", "--algo.kl.target", "0.01"], "refused",
     "refused"),
    (LOSS + ["--algo.kl.preset", "reward", "--algo.kl.seq_target", "0.5", "--train.max_epochs", "2"], "refused",
     "refused"),
    (LOSS + ["--algo.kl.preset", "full"], "refused", "refused"),
]


@pytest.mark.parametrize("argv, code, severity", [param_for_release(*hazard) for hazard in HAZARDS])
def test_hazard(argv, code, severity):
    report = doctor(*argv)
    assert codes(report).get(code) == severity, report.hazards
    assert report.exit_code == {"refused": 3, "warning": report.exit_code}.get(severity, 1)


#: a flag of another release that the installed one refuses: 0.11.0's is_correction_enable (gone in 0.11.2), or for
#: releases before 0.11.2 that release's loss_agg_mode
FOREIGN = ["--algo.advantage.is_correction_enable"] if HAS_LOSS_AGG_MODE else ["--actor.loss_agg_mode", "token-mean"]


def test_arguments_of_another_release():
    """Strict (the CLI): OpenRLHF refuses a flag of another release's examples, so the doctor cannot read it (exit 2);
    strict=False (the examples table) reads past it and says so."""
    argv = BASE + FOREIGN
    with pytest.raises(DoctorError, match=f"unrecognized arguments: {FOREIGN[0]}"):
        doctor(*argv)
    report = diagnose("openrlhf", argv, env={}, strict=False)
    assert codes(report)["unknown-arguments"] == "warning" and report.paths[0].native.preset == "reward-plain"


def test_k3_in_the_reward_is_k3_reward():
    report = doctor(*BASE, "--algo.kl.estimator", "k3")
    assert report.paths[0].native.preset == "k3-reward" and report.verdict == "biased"


def test_adapter_refusals_agree():
    """The configurations check_args refuses are exactly those reported as 'refused'."""
    from kl_adapters.activation import parse as parse_settings
    from kl_adapters.adapters.openrlhf.cli import with_target
    from kl_adapters.doctor.openrlhf import _strip_flag

    for argv, _, _ in HAZARDS:
        if lacking(argv):  # a flag of a later OpenRLHF release (test_hazard reports it skipped)
            continue
        flag, seq_target, rest = _strip_flag(argv)
        if flag is None:
            assert "refused" not in codes(doctor(*argv))
            continue
        try:
            adapter.check_args(parse(rest)[0], with_target(parse_settings(flag), seq_target and float(seq_target)))
            refused = False
        except ValueError:
            refused = True
        assert refused == ("refused" in codes(doctor(*argv))), argv


def test_kl_budget_is_noted_and_a_fixed_beta_is_told_how_to_state_one():
    for flags in (["--algo.kl.seq_target", "0.5"], ["--algo.kl.preset", "sequence:kl_target=0.5"]):
        report = doctor(*LOSS, "--algo.kl.init_coef", "0.01", "--algo.kl.preset", "sequence", *flags)
        assert report.verdict == "unbiased"
        assert any(n.startswith("KL budget: 0.5 nats of KL(pi || pi_ref) per sequence; --algo.kl.init_coef 0.01 is "
                                "the controller's starting value and follows once per rollout") for n in report.notes)
    fixed = doctor(*LOSS, "--algo.kl.init_coef", "0.01", "--algo.kl.preset", "sequence")
    assert any("set --algo.kl.seq_target=<the run's logged kl_adapters/seq_kl" in n for n in fixed.notes)


def test_adaptive_controller_warning_gives_the_per_sequence_budget():
    report = doctor(*BASE, "--algo.kl.target", "0.01", "--rollout.max_new_tokens", "100")
    (warning,) = [h for h in report.hazards if h.code == "adaptive-controller"]
    assert "about 0.01 x the mean response length; at most 1 nats at the maximum length 100" in warning.message
    assert "--algo.kl.seq_target <that> targets KL_seq itself" in warning.message


def _apply(argv: list[str], fix_lines: tuple[str, ...]) -> list[str]:
    """The fix's flags applied to an argument list (the first line names the launcher and the preset flag)."""
    extra = ["--algo.kl.preset", fix_lines[0].rsplit(" ", 1)[1]]
    for line in fix_lines[1:]:
        if line.startswith("(drop "):
            argv = [a for a in argv if a != line[6:-1]]
        else:
            extra += line.split()
    drop = {a for a in extra if a.startswith("--")}
    kept, skip = [], False
    for a in argv:  # a flag the fix sets replaces the user's (with its value)
        if skip and not a.startswith("--"):
            continue
        skip = a in drop
        if not skip:
            kept.append(a)
    return kept + extra


@pytest.mark.parametrize("argv", [param_for_release(argv) for argv in (
    LOSS, LOSS + ["--algo.kl.unbiased_gradient"], LOSS + ["--algo.kl.init_coef", "0"],
    BASE + ["--train.max_epochs", "2"], BASE + ["--algo.kl.estimator", "k3"])])
def test_fix_makes_it_unbiased(argv):
    report = doctor(*argv)
    assert report.verdict in ("biased", "no-op")
    fixed = doctor(*_apply(argv, report.fix.lines))
    assert fixed.verdict == "unbiased", (report.fix.lines, fixed.hazards)


def test_vendored_example_script():
    """OpenRLHF's examples/scripts/train_ppo_with_reward_fn.sh (0.11.0 repository): gae with a critic, k1 reward;
    128 of 1024 samples per optimizer step, so off-policy, where reward-plain is biased."""
    report = diagnose("openrlhf", [str(FIXTURES / "train_ppo_with_reward_fn.sh")], env={})
    assert [p.native.preset for p in report.paths] == ["reward-plain"]
    assert report.regimes == ("on-policy", "off-policy") and report.verdict == "biased"


@pytest.mark.parametrize("argv, code", [
    (BASE, 0), (LOSS, 1), (LOSS + ["--algo.kl.preset", "sequence"], 0), (LOSS + ["--algo.kl.init_coef", "0"], 1),
    (BASE + ["--no_such_flag"], 2), (["--actor.model_name_or_path", "m", "--rollout.n_samples_per_prompt", "1",
                                      "--algo.advantage.estimator", "rloo"], 2),
    (LOSS + ["--algo.kl.preset", "full"], 3), (LOSS + ["--algo.kl.preset", "nope"], 3),
])
def test_exit_codes_and_json(argv, code, capsys):
    assert main(["doctor", "openrlhf", "--json", *argv]) == code
    captured = capsys.readouterr()
    if code == 2:
        assert "cannot read this openrlhf configuration" in captured.err
        return
    doc = json.loads(captured.out)
    jsonschema.validate(doc, SCHEMA)
    assert doc["exit_code"] == code


#: partial command lines, as a user asks "is my KL setting right?": no model, data or reward source
PARTIAL = [
    (["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", "0.01"], "loss", "k3-loss"),
    (["--algo.kl.use_loss", "--algo.kl.estimator", "k2"], "loss", "k2-loss"),
    (["--algo.kl.init_coef", "0.01"], "reward", "reward-plain"),
    ([], "reward", "reward-plain"),
    (["--algo.kl.use_loss", "--algo.kl.init_coef", "2e-6", "--algo.kl.preset", "sequence"], "loss", "sequence"),
    (["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8", "--algo.kl.use_loss",
      "--algo.kl.estimator", "k3"], "loss", "k3-loss"),
    (["--algo.dynamic_filtering_enable", "--rollout.n_samples_per_prompt", "8", "--algo.advantage.estimator",
      "group_norm"], "reward", "reward-plain"),
    (["--eval.dataset", "data/eval.jsonl", "--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt",
      "4"], "reward", "reward-plain"),
]


@pytest.mark.parametrize("argv, path, preset", PARTIAL)
def test_partial_command_lines(argv, path, preset):
    """Arguments the KL analysis does not read are not needed: a neutral reward source is filled in (and said so)
    where OpenRLHF's validation wants one (the default gae estimator derives the critic from it)."""
    report = doctor(*argv)
    assert [(p.path, p.native.preset) for p in report.paths] == [(path, preset)]
    assert any("placeholder for --reward.remote_url" in n for n in report.notes)


def test_placeholder_only_where_no_reward_source_is_given():
    for source in (["--reward.model_name_or_path", "rm"], ["--reward.remote_url", "http://127.0.0.1:1"],
                   ["--train.agent_func_path", "agent.py"]):
        report = doctor(*source, "--algo.kl.init_coef", "0.01")
        assert not any("placeholder" in n for n in report.notes)
    args = parse(["--reward.model_name_or_path", "rm"])[0]
    assert args.reward.remote_url is None and args.critic.model_name_or_path == "rm"  # OpenRLHF's derivation


def test_an_unset_argument_the_validation_reads_is_named(monkeypatch):
    """Without the placeholder, OpenRLHF's validation fails on None (AttributeError); the doctor names the flag."""
    monkeypatch.setattr("kl_adapters.doctor.openrlhf.PLACEHOLDERS", ())
    with pytest.raises(DoctorError) as err:
        doctor("--algo.kl.use_loss", "--algo.kl.estimator", "k3")
    assert "validation needs --reward.model_name_or_path, which these arguments leave unset" in str(err.value)
    assert "--critic" not in str(err.value)  # the assignment's target is not what it needs


@pytest.mark.parametrize("argv, message", [
    (["--algo.kl.use_loss", "--algo.kl.init_coef"], "argument --algo.kl.init_coef: expected one argument"),
    (["--algo.kl.init_coef", "abc"], "invalid float value: 'abc'"),
    (["--algo.kl.bogus", "1"], "unrecognized arguments: --algo.kl.bogus 1"),
    (["--algo.advantage.estimator", "group_norm"], "OpenRLHF refuses these arguments: group_norm requires "
                                                    "n_samples_per_prompt > 1"),
    (["--use_kl_loss", "--init_kl_coef", "0.01"], "unrecognized arguments: --use_kl_loss --init_kl_coef 0.01; "
                                                  "--use_kl_loss was renamed --algo.kl.use_loss, --init_kl_coef was "
                                                  "renamed --algo.kl.init_coef in OpenRLHF 0.10.2"),
    (["no_such_script.sh"], "cannot read no_such_script.sh"),
])
def test_unreadable_command_lines_get_one_plain_line(argv, message, capsys):
    """Exit 2 and one line on stderr naming the problem: never a traceback."""
    assert main(["doctor", "openrlhf", *argv]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("kl-adapters doctor: cannot read this openrlhf configuration: ") and message in line
    assert captured.out == ""


@pytest.mark.parametrize("argv, message", [
    (LOSS + ["--algo.kl.preset", "nope"], "--algo.kl.preset='nope': unknown KL preset 'nope'"),
    (LOSS + ["--algo.kl.preset", "sequence", "--algo.kl.seq_target", "-1"], "kl_target must be a finite number > 0"),
    (LOSS + ["--algo.kl.seq_target", "0.5"], "--algo.kl.seq_target 0.5 needs --algo.kl.preset"),
    (LOSS + ["--algo.kl.preset", "sequence:kl_target=0.2", "--algo.kl.seq_target", "0.5"], "two KL budgets"),
    (LOSS + ["--algo.kl.preset", "full"], "needs the full next-token distributions"),
])
def test_refused_settings_get_a_verdict_not_a_traceback(argv, message, capsys):
    """What kl-adapters refuses (a value, or a setting OpenRLHF cannot run): the verdict REFUSED, exit 3, on stdout."""
    assert main(["doctor", "openrlhf", *argv]) == 3
    captured = capsys.readouterr()
    assert "verdict: REFUSED (exit 3)" in captured.out and message in captured.out and captured.err == ""


def test_project_example_script():
    """examples/openrlhf_ppo.sh (its arguments built with args+=(...) per MODE): the loss path with `sequence`."""
    script = str(Path(__file__).resolve().parents[2] / "examples" / "openrlhf_ppo.sh")
    report = diagnose("openrlhf", [script], env={})
    assert [(p.path, p.native.preset) for p in report.paths] == [("loss", "sequence")] and report.verdict == "unbiased"
    reward = diagnose("openrlhf", [script], env={"MODE": "reward"})
    assert [(p.path, p.native.preset) for p in reward.paths] == [("reward", "reward")] and reward.verdict == "unbiased"


#: the loss path with `sequence`, on-policy, one GPU, ZeRO stage 0: no setting of the support matrix on
SUPPORT_BASE = LOSS + ["--algo.kl.preset", "sequence", "--ds.zero_stage", "0", "--actor.num_gpus_per_node", "1"]
PACKED = ["--ds.packing_samples", "--vllm.num_engines", "1"]  # OpenRLHF packs only with vLLM engines


@pytest.mark.parametrize("key, extra", [
    ("lora", ["--ds.lora.rank", "8"]), ("vllm", ["--vllm.num_engines", "1"]), ("packing", PACKED),
    ("sequence-parallel", [*PACKED, "--ds.ring_attn_size", "2"]),
    ("tensor-parallel", ["--ds.tensor_parallel_size", "2"]), ("sharding", ["--ds.zero_stage", "2"]),
    ("data-parallel", ["--actor.num_gpus_per_node", "2"]),
    ("vision-language", ["--actor.model_name_or_path", "Qwen/Qwen2.5-VL-7B-Instruct"]),
    ("vision-language-other", ["--actor.model_name_or_path", "google/gemma-3-4b-it"]),
    ("liger", ["--ds.use_liger_kernel"]), ("dynamic-batch", [*PACKED, "--train.dynamic_batch_enable"]),
    ("off-policy", ["--train.max_epochs", "2"]), ("async", ["--train.async_enable"]),
])
def test_support_settings_print_their_verdict(key, extra):
    """Each setting of the support matrix the doctor reads prints the matrix's verdict (kl_adapters.support): a note
    when tested, a warning when accepted untested or refused; a refused one is also the adapter's own refusal
    (verdict refused: --ds.tensor_parallel_size > 1 and --ds.ring_attn_size > 1 are refused before Ray starts)."""
    report = doctor(*SUPPORT_BASE, *extra)
    check_verdict_printed("openrlhf", key, report, doctor(*SUPPORT_BASE))
    if key == "tensor-parallel":
        assert any("--ds.tensor_parallel_size > 1" in h.message for h in report.hazards if h.code == "refused")
