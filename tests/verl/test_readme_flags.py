"""README.md's "Turn it on" table, verl row, runs as written: its overrides (read from the README, not copied here)
applied to verl's own ppo_trainer Hydra config select the `sequence` preset on the loss path -- verl's validate_config
(the driver, before Ray starts) accepts them and logs the activation line -- and verl's ppo_loss built from that
config's actor section takes one step with the preset's KL term in it."""

import re
from pathlib import Path

import torch
from verl_cases import Case

from kl_adapters import activation
from kl_adapters.adapters import verl as verl_adapter

README = Path(__file__).resolve().parents[2] / "README.md"
#: what verl's defaults leave unset and validate_config requires of every run (nothing about the KL)
MICRO_BATCHES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"]


def readme_overrides(framework: str = "verl") -> list[str]:
    """The Hydra overrides in the first code span of the framework's row of README's "## Turn it on" table."""
    section = README.read_text().split("\n## Turn it on\n", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if re.match(rf"\|\s*{framework}\s*\|", line)]
    change = row.split("|")[2]
    return re.search(r"`([^`]+)`", change).group(1).split()


def test_readme_verl_row_selects_sequence_and_the_loss_runs(monkeypatch, caplog):
    from test_config import compose
    from verl.trainer import main_ppo
    from verl.utils.config import omega_conf_to_dataclass

    overrides = readme_overrides()
    assert overrides and all("=" in o for o in overrides), overrides
    config = compose(MICRO_BATCHES + overrides)
    monkeypatch.setattr(activation, "_announced", set())
    main_ppo.validate_config(config, use_reference_policy=True, use_critic=False)
    assert "kl-adapters: preset sequence active in verl" in caplog.text
    assert verl_adapter.check_config(config) == ("loss", activation.parse("sequence"))

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    case = Case(seed=0)
    flagged, loss, metrics = case.ppo_grad(actor, uid=[f"p{i // 4}" for i in range(len(case.advantages))])
    without_kl, _, _ = case.ppo_grad(omega_conf_to_dataclass(compose(MICRO_BATCHES).actor_rollout_ref.actor))
    assert torch.isfinite(loss) and torch.isfinite(flagged).all()
    assert {"kl_loss", "kl_adapters/seq_kl"} <= set(metrics)
    assert not torch.equal(flagged, without_kl)  # the KL term is in the step
