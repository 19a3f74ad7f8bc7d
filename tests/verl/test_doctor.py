"""kl-adapters doctor on verl 0.9.1: Hydra composition with verl's own config, launch scripts (the project's example
and vendored verl examples, tests/fixtures/doctor/MANIFEST), every verl hazard on a constructed config, the fix
(re-read: unbiased, and accepted by the adapter), the JSON schema, the exit codes, and agreement of the doctor's
mapping with verl's own kl_penalty gradient and with the adapter's native preset and refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from kl_adapters import activation, native
from kl_adapters.adapters import verl as adapter
from kl_adapters.adapters.verl import flags as verl_flags
from kl_adapters.cli import main
from kl_adapters.doctor import SCHEMA, DoctorError, diagnose
from kl_adapters.doctor.verl import compose
from kl_adapters.surrogate import kl_term

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support_verdicts import check_verdict_printed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "doctor" / "verl"
LOSS = ["actor_rollout_ref.actor.use_kl_loss=True"]
REWARD = ["algorithm.use_kl_in_reward=True"]
ON_POLICY = ["data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=256"]


def doctor(*overrides: str):
    return diagnose("verl", list(overrides))


def codes(report) -> dict[str, str]:
    return {h.code: h.severity for h in report.hazards}


@pytest.mark.parametrize("name", ["kl", "k1", "mse", "k2", "low_var_kl", "k3", "k3+", "low_var_kl+", "kl+"])
def test_mapping_is_verls_own_gradient(name):
    """d kl_penalty(logp, ref, name) / d logp_t (verl's code) equals the per-token weight c_t of the preset the doctor
    names (on-policy, log-ratios inside verl's clamps), and the adapter's native preset is the same."""
    from verl.trainer.ppo import core_algos

    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    ref = (logp.detach() + 0.5 * torch.randn(3, 5, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.ones(3, 5, dtype=torch.bool)
    (weight,) = torch.autograd.grad(core_algos.kl_penalty(logp, ref, name).sum(), logp)
    preset = native.verl_loss(name).preset
    assert verl_flags._native_preset(name) == preset
    expected = kl_term(logp.detach(), ref, mask, preset=preset).coefficients
    torch.testing.assert_close(weight, expected.to(weight.dtype), rtol=1e-6, atol=1e-9)


def test_defaults_have_no_kl():
    report = doctor()
    assert report.verdict == "no-kl" and report.exit_code == 0 and report.version == "0.9.1" and report.tested


def test_grpo_k3_loss_is_biased_with_fix():
    report = doctor(*LOSS, *ON_POLICY)
    (path,) = report.paths
    assert (path.path, path.native.preset, report.regimes) == ("loss", "k3-loss", ("on-policy",))
    assert codes(report) == {"clamp": "warning"} and report.verdict == "biased"
    assert "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence" in report.fix.lines


def test_mini_batches_make_it_off_policy():
    report = doctor(*LOSS, "data.train_batch_size=512", "actor_rollout_ref.actor.ppo_mini_batch_size=128")
    assert report.regimes == ("on-policy", "off-policy") and "4 mini-batch" in report.off_policy_reason
    epochs = doctor(*LOSS, *ON_POLICY, "actor_rollout_ref.actor.ppo_epochs=2")
    assert epochs.regimes == ("on-policy", "off-policy")


HAZARDS = [
    (LOSS + ["actor_rollout_ref.actor.kl_loss_coef=0"], "zero-coefficient", "no-op"),
    (REWARD + ["algorithm.kl_ctrl.kl_coef=0"], "zero-coefficient", "no-op"),
    (LOSS + REWARD, "double-kl", "bias"),
    (LOSS + ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], "length-normalized", "bias"),
    (REWARD + ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], "length-normalized", "bias"),
    (REWARD + ["algorithm.adv_estimator=grpo"], "std-normalized-reward", "bias"),
    (REWARD + ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False"], "mean-baseline",
     "warning"),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_type=low_var_kl"], "clamp", "warning"),
    (REWARD + ["algorithm.kl_penalty=low_var_kl"], "clamp", "warning"),
    (REWARD + ["algorithm.kl_ctrl.type=adaptive"], "adaptive-controller", "warning"),
    (REWARD + ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"], "discounted", "bias"),
    (REWARD + ["algorithm.adv_estimator=gae", "algorithm.lam=0.95"], "gae-lambda", "bias"),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_type=abs"], "unsupported-estimator", "bias"),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_type=full"], "unsupported-estimator", "bias"),
    (["+ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS=sequence"], "refused", "refused"),
    (["actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"], "refused", "refused"),
    (LOSS + REWARD + ["actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"], "refused", "refused"),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_type=kl_adapters:full"], "refused", "refused"),
]


@pytest.mark.parametrize("overrides, code, severity", HAZARDS)
def test_hazard(overrides, code, severity):
    report = doctor(*overrides)
    assert codes(report).get(code) == severity, report.hazards
    assert report.exit_code == {"refused": 3, "warning": report.exit_code}.get(severity, 1)


def with_fix(overrides: list[str], report) -> list[str]:
    """The overrides with the report's fix lines in place of the same keys."""
    keys = {line.split("=", 1)[0] for line in report.fix.lines}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + list(report.fix.lines)


@pytest.mark.parametrize("overrides, code, severity", [h for h in HAZARDS if h[2] != "warning"])
def test_fix_makes_it_unbiased_and_the_adapter_accepts_it(overrides, code, severity):
    """Re-reading the configuration with the fix's override lines in place of the same keys: exit 0, and the
    adapter's own check (run by verl's patched validate_config before Ray starts) accepts it."""
    fixed = with_fix(overrides, doctor(*overrides))
    again = doctor(*fixed)
    assert again.verdict == "unbiased", (fixed, again.hazards)
    adapter.check_config(compose(fixed)[0])


def test_on_policy_reward_path_fix_is_the_reward_preset():
    report = doctor(*REWARD, *ON_POLICY, "algorithm.adv_estimator=grpo")
    assert report.fix.preset == "reward" and report.fix.lines == ("algorithm.kl_penalty=kl_adapters:reward",)
    assert doctor(*REWARD, *ON_POLICY, "algorithm.adv_estimator=grpo", *report.fix.lines).verdict == "unbiased"


def test_adapter_refusals_agree():
    """Every configuration the adapter's check_config refuses is reported as a 'refused' hazard, and no other."""
    for overrides, _, _ in HAZARDS:
        try:
            adapter.check_config(compose(overrides)[0])
            refused = False
        except ValueError:
            refused = True
        assert refused == ("refused" in codes(doctor(*overrides))), overrides


#: KL budgets (kl_adapters:<preset>:kl_target=<nats>) the adapter's check_config refuses before Ray starts
BUDGET_REFUSALS = [
    (REWARD + ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_penalty='kl_adapters:reward:kl_target=0.5'"],
     "would both set the reward's KL coefficient"),
    (REWARD + ["algorithm.kl_ctrl.kl_coef=0", "algorithm.kl_penalty='kl_adapters:reward:kl_target=0.5'"],
     "starts from algorithm.kl_ctrl.kl_coef"),
    (LOSS + ["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.kl_loss_type='kl_adapters:reward:"
             "kl_target=0.5'"], "does not follow its gradient off-policy"),
]


@pytest.mark.parametrize("overrides, message", BUDGET_REFUSALS)
def test_budget_refusals_are_the_adapters(overrides, message):
    report = doctor(*overrides)
    (refused,) = [h for h in report.hazards if h.code == "refused"]
    assert refused.severity == "refused" and message in refused.message and report.exit_code == 3
    with pytest.raises(ValueError, match=message):
        adapter.check_config(compose(overrides)[0])


def test_kl_budget_is_noted_and_a_fixed_beta_is_told_how_to_state_one():
    report = doctor(*LOSS, "actor_rollout_ref.actor.kl_loss_type='kl_adapters:sequence:kl_target=0.5'")
    assert report.verdict == "unbiased"
    assert any(n.startswith("KL budget: 0.5 nats of KL(pi || pi_ref) per sequence; kl_loss_coef=0.001 is the "
                            "controller's starting value and follows once per rollout") for n in report.notes)
    fixed = doctor(*LOSS, "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence")
    assert any("kl_loss_type=kl_adapters:sequence:kl_target=<the run's logged kl_adapters/seq_kl" in n
               for n in fixed.notes)


def test_adaptive_controller_warning_gives_the_per_sequence_budget():
    """verl's adaptive controller targets a per-token KL: the warning converts target_kl to nats per sequence (at
    most target_kl x data.max_response_length) and names the budget that targets KL_seq."""
    report = doctor(*REWARD, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01",
                    "data.max_response_length=100")
    (warning,) = [h for h in report.hazards if h.code == "adaptive-controller"]
    assert "about 0.01 x the mean response length; at most 1 nats at the maximum length 100" in warning.message
    assert "algorithm.kl_penalty='kl_adapters:reward:kl_target=<that>' (with kl_ctrl.type=fixed)" in warning.message


def test_project_example_script():
    loss = diagnose("verl", [str(ROOT / "examples" / "verl_grpo.sh")], env={"HOME": "/home/u"})
    assert [p.native.preset for p in loss.paths] == ["sequence"] and loss.verdict == "unbiased"
    assert loss.unresolved == ["$@ (the script's own arguments, dropped)", "UNRESOLVED_PRESET"]
    reward = diagnose("verl", [str(ROOT / "examples" / "verl_grpo.sh")], env={"KL_PATH": "reward"})
    assert [p.native.preset for p in reward.paths] == ["reward"]
    assert reward.regimes == ("on-policy",) and reward.verdict == "unbiased"  # one update per rollout (256 / 256)


@pytest.mark.parametrize("script, preset, verdict", [
    ("grpo_trainer_run_qwen2-7b.sh", "k3-loss", "biased"),
    ("rloo_trainer_run_qwen2-7b.sh", "reward-sum", "biased"),  # unbiased on-policy, but 4 mini-batches per rollout
])
def test_vendored_verl_examples(script, preset, verdict):
    report = diagnose("verl", [str(FIXTURES / script)], env={})
    assert [p.native.preset for p in report.paths] == [preset] and report.verdict == verdict
    assert "$HOME" in report.unresolved


def test_keys_of_another_release():
    """Strict (the CLI): Hydra refuses a key verl 0.9.1's config lacks (exit 2); strict=False (the examples table)
    drops it and says so."""
    argv = [*LOSS, "critic.model.fsdp_config.param_offload=False"]
    with pytest.raises(DoctorError, match="Could not override 'critic.model.fsdp_config.param_offload'"):
        doctor(*argv)
    report = diagnose("verl", argv, strict=False)
    assert codes(report)["unknown-arguments"] == "warning" and report.paths[0].native.preset == "k3-loss"


def test_unresolved_kl_setting_is_unreadable(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.use_kl_loss=$USE_KL\n")
    assert main(["doctor", "verl", str(script)]) == 2
    assert "actor_rollout_ref.actor.use_kl_loss is set from something the script computes" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code", [
    ([], 0), (LOSS, 1), (LOSS + ["actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"], 0),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_coef=0"], 1), (["no_such_key=1"], 2),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_type=kl_adapters:full"], 3),
    (LOSS + ["actor_rollout_ref.actor.kl_loss_type=kl_adapters:nope"], 3),
])
def test_exit_codes_and_json(argv, code, capsys):
    assert main(["doctor", "verl", "--json", *argv]) == code
    out = capsys.readouterr().out
    if code != 2:
        doc = json.loads(out)
        jsonschema.validate(doc, SCHEMA)
        assert doc["exit_code"] == code


def test_table_output(capsys):
    assert main(["doctor", "verl", *LOSS]) == 1
    out = capsys.readouterr().out
    assert "\033[" not in out  # not a terminal
    assert "k3-loss" in out and "verdict: BIASED (exit 1)" in out and "kl_adapters:sequence" in out


#: partial override lists, as a user asks "is my KL setting right?": no model, data or cluster settings
PARTIAL = [
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl"],
     [("loss", "k3-loss")]),
    (["algorithm.adv_estimator=grpo", *LOSS], [("loss", "k3-loss")]),
    ([*REWARD, "algorithm.kl_ctrl.kl_coef=0.001"], [("reward", "reward-plain")]),  # gae: KL reward-to-go
    (["actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", "data.train_files=train.parquet", *LOSS],
     [("loss", "k3-loss")]),
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"], [("loss", "sequence")]),
    (["--config-name", "ppo_megatron_trainer", *LOSS], [("loss", "k3-loss")]),
    (["-cn=ppo_megatron_trainer", *LOSS], [("loss", "k3-loss")]),
]


@pytest.mark.parametrize("argv, paths", PARTIAL)
def test_partial_override_lists(argv, paths):
    assert [(p.path, p.native.preset) for p in doctor(*argv).paths] == paths


@pytest.mark.parametrize("argv, message", [
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_type=kl_adapters:nope"],
     "actor_rollout_ref.actor.kl_loss_type='kl_adapters:nope': unknown KL preset 'nope'"),
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_type='kl_adapters:sequence:kl_target=-1'"],
     "kl_target must be a finite number > 0"),
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_type='kl_adapters:token:kl_target=1'"],
     "preset 'token' does not follow its gradient"),
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_type=kl_adapters:full"], "preset 'full' needs the full next-token"),
    (LOSS, "KL_ADAPTERS='sequnce': unknown KL preset 'sequnce'"),  # the doctor's own environment (monkeypatched)
])
def test_refused_settings_get_a_verdict_not_a_traceback(argv, message, capsys, monkeypatch):
    """What kl-adapters refuses (a value, or a setting verl cannot run): the verdict REFUSED, exit 3, on stdout."""
    if "sequnce" in message:
        monkeypatch.setenv(activation.ENV_VAR, "sequnce")
        activation.activate_from_env(defer=True)
    assert main(["doctor", "verl", *argv]) == 3
    captured = capsys.readouterr()
    assert "verdict: REFUSED (exit 3)" in captured.out and message in captured.out and captured.err == ""


@pytest.mark.parametrize("argv, message", [
    (["use_kl_loss=True"], "verl's ppo_trainer.yaml has no key 'use_kl_loss': did you mean "
                           "actor_rollout_ref.actor.use_kl_loss?"),
    (["actor_rollout_ref.actor.use_kl_loss"], "Error parsing override 'actor_rollout_ref.actor.use_kl_loss'; "
                                              "missing EQUAL"),
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_coef=abc"], "actor_rollout_ref.actor.kl_loss_coef='abc' is not a "
                                                          "number"),
    (["actor_rollout_ref.actor.use_kl_loss=maybe"], "actor_rollout_ref.actor.use_kl_loss='maybe' is not True or "
                                                    "False"),
    ([*LOSS, "actor_rollout_ref.actor.kl_loss_coef=${no.such.key}"], "kl_loss_coef does not resolve"),
    (["--config-name"], "--config-name needs a value"),
    (["--config-name", "nope"], "config 'nope' is not one of the installed verl's trainer configs"),
    (["--actor_rollout_ref.actor.use_kl_loss=True"], "unsupported main_ppo option"),
    (["no_such_script.sh"], "cannot read no_such_script.sh"),
])
def test_unreadable_overrides_get_one_plain_line(argv, message, capsys):
    """Exit 2 and one line on stderr naming the problem: never a traceback or Hydra's multi-line message."""
    assert main(["doctor", "verl", *argv]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("kl-adapters doctor: cannot read this verl configuration: ") and message in line
    assert captured.out == ""


#: the loss path with `sequence`, on-policy, one GPU, no remove-padding: of the support matrix only FSDP is on
SUPPORT_BASE = [*LOSS, *ON_POLICY, "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence",
                "actor_rollout_ref.model.use_remove_padding=False", "trainer.n_gpus_per_node=1"]


@pytest.mark.parametrize("key, extra", [
    ("lora", ["actor_rollout_ref.model.lora_rank=8"]), ("vllm", ["actor_rollout_ref.rollout.name=vllm"]),
    ("packing", ["actor_rollout_ref.model.use_remove_padding=True"]),
    ("sequence-parallel", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]),
    ("sharding", ["actor_rollout_ref.actor.strategy=fsdp2"]), ("megatron", ["--config-name", "ppo_megatron_trainer"]),
    ("data-parallel", ["trainer.n_gpus_per_node=2"]),
    ("vision-language", ["actor_rollout_ref.model.path=Qwen/Qwen2.5-VL-7B-Instruct"]),
    ("vision-language-other", ["actor_rollout_ref.model.path=zai-org/GLM-4.1V-9B-Thinking"]),
    ("liger", ["actor_rollout_ref.model.use_liger=True"]),
    ("dynamic-batch", ["actor_rollout_ref.actor.use_dynamic_bsz=True"]),
    ("off-policy", ["actor_rollout_ref.actor.ppo_mini_batch_size=64"]),
])
def test_support_settings_print_their_verdict(key, extra):
    """Each setting of the support matrix the doctor reads prints the matrix's verdict (kl_adapters.support): a note
    when tested, a warning when accepted untested or refused (and then the verdict refused).
    verl's default strategy fsdp is the FSDP row, so the base configuration prints that one already."""
    check_verdict_printed("verl", key, doctor(*SUPPORT_BASE, *extra), doctor(*SUPPORT_BASE),
                          in_base=key == "sharding")


def ulysses_example() -> list[str]:
    """A verl Ulysses example: the project's GRPO example (examples/verl_grpo.sh) with verl's default KL loss
    (low_var_kl) and sequence parallel size 2 (verl requires remove-padding for it)."""
    from test_config import example_overrides

    return [*(o for o in example_overrides() if not o.startswith("actor_rollout_ref.actor.kl_loss_type=")),
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]


def test_ulysses_fix_exits_0_and_verl_accepts_it(capsys):
    """Ulysses sequence parallelism is accepted (tests/verl/test_sequence_parallel.py): the example's fix,
    ``kl_loss_type=kl_adapters:sequence``, re-read exits 0 with the matrix's tested note and no refusal, and verl's
    own validate_config (with the adapter's check, as in the driver before Ray starts) accepts it."""
    from verl.trainer import main_ppo

    from kl_adapters import support

    example = ulysses_example()
    report = doctor(*example)
    assert report.verdict == "biased" and "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence" in report.fix.lines
    fixed = with_fix(example, report)
    assert main(["doctor", "verl", *fixed]) == 0
    out = capsys.readouterr().out
    (note,), _ = support.doctor_lines("verl", ["sequence-parallel"])
    assert note in out and "refused" not in out
    main_ppo.validate_config(compose(fixed)[0], use_reference_policy=True, use_critic=False)
