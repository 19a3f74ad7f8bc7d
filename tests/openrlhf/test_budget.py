"""KL budget in OpenRLHF: --algo.kl.seq_target / --algo.kl.preset <preset>:kl_target= through OpenRLHF's real CLI,
carried to the Ray actors by the PresetFlag; the controller in the single controller (BasePPOTrainer): OpenRLHF's own
train_step / ppo_train ship its beta as kl_ctl to the actors and it is updated once per rollout from the step's
kl_adapters/seq_kl; its state rides OpenRLHF's checkpoint client_states through save_logs_and_checkpoints and
init_checkpoint_states. The actor groups are stubs here (their methods are OpenRLHF's Ray actors: fit, save_checkpoint
and get_checkpoint_states with DeepSpeed, not run on CPU; the stub writes client_states to a file with torch.save and
reads them back, as DeepSpeed's checkpoint does); in the actor, OpenRLHF's own ppo_train (CPU strategy shim) with the
shipped kl_ctl; bad input at configuration."""

from __future__ import annotations

import pickle
import types

import pytest
import torch

import kl_adapters
from kl_adapters import activation
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters.openrlhf import budget as openrlhf_budget
from kl_adapters.budget import KLBudget
from openrlhf_harness import BETA, base_argv, cli_args

TARGET = 0.5


def budget_args(actor_dir, *flags):
    return cli_args(base_argv(actor_dir) + ["--algo.kl.preset", "sequence", *flags], wrapper=True)


@pytest.mark.parametrize("flags", [["--algo.kl.seq_target", "0.5"], ["--algo.kl.preset", "sequence:kl_target=0.5"]])
def test_flag_reaches_args_and_ray_actors(actor_dir, flags):
    args = budget_args(actor_dir, *flags)
    assert args.algo.kl.preset == "sequence:kl_target=0.5" and activation.active().kl_target == TARGET
    kl_adapters.disable()  # a fresh Ray actor process: only the pickled args carry the setting
    pickle.loads(pickle.dumps(args))
    assert activation.active() == activation.Settings("sequence", None, TARGET)


@pytest.mark.parametrize("flags, message", [
    (["--algo.kl.seq_target", "-1"], "kl_target must be a finite number > 0"),
    (["--algo.kl.seq_target", "nan"], "kl_target must be a finite number > 0"),
    (["--algo.kl.preset", "sequence:kl_target=0.2", "--algo.kl.seq_target", "0.5"], "two KL budgets"),
    (["--algo.kl.preset", "token", "--algo.kl.seq_target", "0.5"], "does not follow its gradient"),
])
def test_bad_budgets_are_refused_by_the_cli(actor_dir, flags, message, capsys):
    with pytest.raises(SystemExit):
        budget_args(actor_dir, *flags)
    assert message in capsys.readouterr().err


def test_target_without_a_preset_is_refused(actor_dir, capsys):
    with pytest.raises(SystemExit):
        cli_args(base_argv(actor_dir) + ["--algo.kl.seq_target", "0.5"], wrapper=True)
    assert "needs --algo.kl.preset" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--algo.kl.seq_target", "0.5", "--algo.kl.target", "0.01"], "--algo.kl.target"),  # OpenRLHF's controller too
    (["--algo.kl.preset", "reward", "--algo.kl.seq_target", "0.5"], "off-policy"),  # 2 epochs of the loss path
])
def test_budgets_that_openrlhfs_arguments_make_wrong_are_refused_at_parsing(actor_dir, flags, message):
    with pytest.raises(ValueError, match=message):
        budget_args(actor_dir, *flags)


class ActorGroup:
    """Stand-in for OpenRLHF's RayActorGroup of PolicyModelActors: records each method call; fit returns a status with
    the next sequence-KL estimate; save_checkpoint writes its client_states to `path` (<ckpt.path>/_actor/...) with
    torch.save, get_checkpoint_states reads them back."""

    def __init__(self, estimates=(), path=None):
        self.calls, self.estimates, self.saved, self.path = [], list(estimates), None, path

    def async_run_method_batch(self, method_name, **kwargs):
        self.calls.append((method_name, kwargs))
        return []

    def async_run_method(self, method_name, **kwargs):
        self.calls.append((method_name, kwargs))
        if method_name == "fit":
            return [{"kl": 0.01, "policy_loss": 0.0, adapter.SEQ_KL: self.estimates.pop(0)}]
        if method_name == "save_checkpoint":  # DeepSpeed pickles client_states into the checkpoint (torch.save)
            self.saved = kwargs["client_states"]
            self.path.parent.mkdir(exist_ok=True)
            torch.save(self.saved, self.path)
        if method_name == "get_checkpoint_states":  # PolicyModelActor: what load_ckpt read back at its init
            return [torch.load(self.path, weights_only=False)]
        return [self.saved]


def controller(args, group, tmp_path):
    """OpenRLHF's BasePPOTrainer with its real train_step, ppo_train, save_logs_and_checkpoints and
    init_checkpoint_states, and what they call stubbed: the actor group, the experience maker, the tokenizer."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    args.ckpt.path, args.ckpt.save_steps, args.ckpt.load_enable = str(tmp_path), 1, True
    trainer = object.__new__(BasePPOTrainer)
    experience = types.SimpleNamespace(sequences=torch.zeros(1, 3, dtype=torch.long), info={"reward": torch.ones(2)},
                                       response_length=torch.ones(2), truncated=torch.zeros(2))
    trainer.__dict__.update(
        args=args, strategy=None, actor_model_group=group, critic_model_group=None, vllm_engines=None,
        kl_ctl=FixedKLController(args.algo.kl.init_coef), wandb_logger=None, tensorboard_logger=None,
        experience_maker=types.SimpleNamespace(make_experience_batch=lambda samples: [experience]),
        tokenizer=types.SimpleNamespace(decode=lambda *a, **k: ["sample"]), best_eval_metric_key="",
        best_eval_metric_value=float("-inf"), _latest_eval_metric_value=None)
    return trainer


@pytest.fixture
def ray_get_is_identity(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)


def test_beta_is_shipped_to_the_actors_and_updated_once_per_rollout(actor_dir, tmp_path, ray_get_is_identity):
    import openrlhf.trainer.ppo_trainer  # noqa: F401  (patched on import: a trigger module)

    args = budget_args(actor_dir, "--algo.kl.seq_target", str(TARGET))
    estimates = [0.1, 0.9, 0.6, 0.4]
    group = ActorGroup(estimates)
    trainer = controller(args, group, tmp_path)
    statuses = [trainer.train_step(None, step)[0] for step in range(4)]
    shipped = [kw["kl_ctl"] for name, kw in group.calls if name == "fit"]
    replay = KLBudget(TARGET, BETA)  # the starting beta: the harness's --algo.kl.init_coef
    for kl, beta, status in zip(estimates, shipped, statuses):
        assert beta == pytest.approx(replay.beta, rel=1e-12)  # the fit of this rollout got the budget's beta
        assert status["kl_adapters/beta"] == beta and status["kl_adapters/kl_target"] == TARGET
        replay.observe(kl, 1)
        replay.update()
    assert trainer.kl_ctl.value == pytest.approx(replay.beta) and len(set(shipped)) == 4


def test_checkpoint_client_states_carry_the_budget(actor_dir, tmp_path, ray_get_is_identity):
    """save_logs_and_checkpoints stores the budget in OpenRLHF's client_states; a new trainer's
    init_checkpoint_states (fit's resume) gets them back from the actor and continues with the same beta."""
    import openrlhf.trainer.ppo_trainer  # noqa: F401

    args = budget_args(actor_dir, "--algo.kl.seq_target", str(TARGET))
    group = ActorGroup([0.9, 0.8], tmp_path / "_actor" / "client_states.pt")
    first = controller(args, group, tmp_path)
    for step in range(2):
        status, _ = first.train_step(None, step)
    first.save_logs_and_checkpoints(2, status, {"global_step": 2})
    assert group.saved["global_step"] == 2 and group.saved[adapter.BUDGET_STATE]["steps"] == 2
    resumed = controller(args, ActorGroup([], group.path), tmp_path)  # init_checkpoint_states finds _actor/
    states = resumed.init_checkpoint_states()
    assert states["global_step"] == 2
    assert resumed.kl_ctl.value == first.kl_ctl.value != BETA
    assert openrlhf_budget._budget(resumed).state_dict() == openrlhf_budget._budget(first).state_dict()


@pytest.mark.compat
def test_without_a_target_the_controller_is_openrlhfs(actor_dir, tmp_path, ray_get_is_identity):
    import openrlhf.trainer.ppo_trainer  # noqa: F401

    args = cli_args(base_argv(actor_dir) + ["--algo.kl.preset", "sequence"], wrapper=True)
    group = ActorGroup([0.9, 0.8], tmp_path / "_actor" / "client_states.pt")
    trainer = controller(args, group, tmp_path)
    statuses = [trainer.train_step(None, step)[0] for step in range(2)]
    assert [kw["kl_ctl"] for name, kw in group.calls if name == "fit"] == [BETA, BETA] and trainer.kl_ctl.value == BETA
    assert not any("kl_adapters/beta" in s for s in statuses) and openrlhf_budget._budget(trainer) is None
    trainer.save_logs_and_checkpoints(1, statuses[-1], {"global_step": 1})
    assert adapter.BUDGET_STATE not in group.saved


@pytest.mark.compat
def test_the_actor_applies_the_shipped_beta_as_its_kl_coefficient(actor_dir, ref_dir, cpu_cuda):
    """In the actor, the budget is only the kl_ctl fit() receives: OpenRLHF's ppo_train under
    --algo.kl.preset sequence:kl_target=0.5 makes bit-identical gradients and status to the preset without a target at
    the same kl_ctl (tests/openrlhf/test_loss_path.py pins that kl_ctl weighs the preset's KL term), and its status
    carries the sequence-KL estimate the controller reads."""
    from openrlhf_harness import loss_path_batch, ppo_train_on

    batch = loss_path_batch(actor_dir, ref_dir)
    runs = []
    for flags in (["--algo.kl.seq_target", str(TARGET)], []):
        args = budget_args(actor_dir, *flags)
        trainer, _, status = ppo_train_on(args, actor_dir, batch)
        runs.append((trainer.strategy.grad_log, status))
    (budget_grads, budget_status), (fixed_grads, fixed_status) = runs
    assert len(budget_grads) == 4 and all(torch.equal(a, b) for a, b in zip(budget_grads, fixed_grads))
    assert budget_status == fixed_status and adapter.SEQ_KL in budget_status
