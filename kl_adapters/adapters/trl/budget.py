"""TRL adapter, KL budget (``KLGRPOConfig(kl_target=<nats>)``, ``--kl_target``,
``KL_ADAPTERS=<preset>:kl_target=<nats>``; kl_adapters.budget): `KLBudgetCallback`, its refusals at configuration (`check_budget`) and its beta in the trainer.
Pinned by tests/trl/test_budget.py.

Shared with the other adapters (adapters/budget_wiring.py): the controller (`budget.KLBudget`) and `restore` from the
checkpoint. TRL's own part: the controller is a transformers callback, so that its state rides in trainer_state.json
(``stateful_callbacks``, which rebuilds it from its arguments), observed at every micro-batch from the sums the metrics
already reduce (`observe_budget`, which also logs beta per micro-batch, as TRL averages its metrics) and updated at
on_step_end; budget_wiring's `kept_budget` / `take_step` model a controller kept on the object that owns beta and
updated from one estimate per rollout (verl, OpenRLHF), which TRL's optimizer steps over several micro-batches are not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ... import activation
from ...budget import DEFAULT_RULE, KLBudget, check_budget_preset
from ..budget_wiring import restore
from .flags import BUDGET_START_BETA, settings_of

if TYPE_CHECKING:  # pragma: no cover
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer


def _off_policy(args: GRPOConfig) -> bool:
    """Whether the loss can see batches from another policy than the one it trains: TRL's own condition for keeping
    rollout log-probs (a generation batch spanning optimizer steps, num_iterations > 1), or vLLM's sampler."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(getattr(args, "use_vllm", False))


def check_budget(args: GRPOConfig) -> None:
    """Refuse, at configuration time (KLGRPOConfig.__post_init__; the trainer's __init__ for the KL_ADAPTERS route), a
    KL budget that cannot do what it says in this trainer: no KL term to adjust (no preset, kl_preset 'off'; beta ==
    0, which `start_budget` leaves only where TRL made the config itself), or a preset whose gradient is not the
    sequence KL's for this trainer's (off-policy) batches (`budget.check_budget_preset`). What every path refuses
    (a bad target, a preset biased on-policy, is_clip) `activation.validate` has refused already. Pinned by
    tests/trl/test_budget.py::test_bad_budgets_are_refused_at_configuration."""
    settings = settings_of(args)
    if settings is None:
        raise activation.SettingError("kl_target needs a KL term to adjust: set kl_preset (e.g. 'sequence') or "
                                      "KL_ADAPTERS")
    if args.beta == 0.0:
        raise activation.SettingError(f"kl_target with beta=0.0: pass GRPOTrainer a GRPOConfig (its beta 0 then "
                                      f"starts the budget at {BUDGET_START_BETA}), or set beta > 0")
    try:
        check_budget_preset(settings.spec, settings.is_clip, off_policy=_off_policy(args))
    except ValueError as err:
        raise activation.SettingError(str(err)) from None


class KLBudgetCallback(TrainerCallback, ExportableState):
    """The run's KL budget (`budget.KLBudget`, initial beta = TRL's beta) as a transformers callback: updated at
    on_step_end, once per optimizer step, from that step's micro-batches on every process (`observe_budget`: the
    sums `_log_metrics` already reduces across processes, so every process computes the same beta); stored in each
    checkpoint's trainer_state.json (TrainerState.stateful_callbacks, where transformers keeps callback state) and
    restored from it at on_train_begin, which train(resume_from_checkpoint=...) reaches with the checkpoint's state.
    The trainer reads beta from it at each generation and loss call (`_apply_budget`).

    KL budget (``KLGRPOConfig(kl_target=<nats>)``, ``--kl_target``, or ``KL_ADAPTERS=<preset>:kl_target=<nats>``;
    kl_adapters.budget): TRL's ``beta`` is the starting value of a controller that sets ``trainer.beta`` once per optimizer
    step so that KL(pi || pi_ref) per completion tracks the target. ``KLBudgetCallback`` holds it: at on_step_end it
    updates beta from the step's mean ``kl_adapters/seq_kl`` (the sums `_log_metrics` already reduces across processes:
    no extra synchronisation, the same beta on every process); the generation and loss wrappers read it
    (`_apply_budget`), so TRL's own code and the statistics see the current beta. Its state is saved in each checkpoint's
    trainer_state.json (``stateful_callbacks``) and restored at on_train_begin by ``train(resume_from_checkpoint=...)``.
    Metrics beside TRL's: ``kl_adapters/beta``, ``kl_adapters/kl_target``. With TRL's default ``beta = 0`` the budget
    starts from ``BUDGET_START_BETA`` (`start_budget`, before TRL decides whether to build its reference model). Refused
    at configuration (`activation.validate`, `check_budget`): no KL term, a target that is not a finite number > 0, a
    preset whose gradient is not the sequence KL's (or ``reward`` off-policy), is_clip; RLOOTrainer (not patched).
    Without kl_target nothing of this runs. Pinned by tests/trl/test_budget.py.
    """

    def __init__(self, target: float, beta: float, rule: str = DEFAULT_RULE):
        self.budget = KLBudget(target, beta, rule)

    @property
    def budget_state(self) -> dict:
        return self.budget.state_dict()

    @budget_state.setter
    def budget_state(self, state: dict) -> None:  # transformers' restore_callback_states_from_checkpoint sets it
        self.budget.load_state_dict(state)

    def state(self) -> dict:
        b = self.budget
        return {"args": {"target": b.target, "beta": b.beta, "rule": b.rule}, "attributes": {"budget_state": b.state_dict()}}

    def on_train_begin(self, args, state, control, **kwargs):
        stored = state.stateful_callbacks.get(type(self).__name__)
        stored = stored[0] if isinstance(stored, list) else stored
        if stored or state.global_step:  # a fresh run stores the initial state here: loading it changes nothing
            restore({"budget_state": self.budget}, (stored or {}).get("attributes", {}),
                    "the checkpoint's trainer_state.json")

    def on_step_end(self, args, state, control, **kwargs):
        self.budget.update()


def budget_of(trainer: GRPOTrainer) -> KLBudget | None:
    """The trainer's KL budget, None without kl_target."""
    return next((cb.budget for cb in trainer.callback_handler.callbacks if isinstance(cb, KLBudgetCallback)), None)


def _apply_budget(trainer: GRPOTrainer) -> None:
    """trainer.beta = the budget's beta (TRL and the adapter read trainer.beta at every use)."""
    budget = budget_of(trainer)
    if budget is not None:
        trainer.beta = budget.beta


def observe_budget(trainer: GRPOTrainer, mode: str, total: float, count: float) -> None:
    """Hand a micro-batch's summed sequence-KL estimates over all processes (`total`, `count`: host numbers the
    metrics already computed) to the budget in training, and log kl_adapters/beta and kl_adapters/kl_target."""
    budget = budget_of(trainer)
    if budget is None:
        return
    if mode == "train":
        budget.observe(total, count)
    for key, value in budget.metrics().items():
        trainer._metrics[mode][key].append(value)
