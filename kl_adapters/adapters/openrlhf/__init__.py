"""OpenRLHF adapter (OpenRLHF 0.10.4-0.11.2): exact-gradient KL in the actor loss and the reward, in its Ray actors.

Flag: ``--algo.kl.preset <preset>[:is_clip=<c>]`` on ``python -m kl_adapters.adapters.openrlhf_cli`` (OpenRLHF's
``train_ppo_ray`` plus that one flag; the launcher is cli.py), or ``KL_ADAPTERS=<preset>`` with OpenRLHF's own
``train_ppo_ray``; the driver's ``args.algo.kl.preset`` becomes a `PresetFlag`, whose unpickling activates kl-adapters
in every training actor. Unset: OpenRLHF runs its own code, bit for bit (the patched functions call the originals).
Refusals: `check_args`; releases and what differs between them: `patch`.

Modules (the former openrlhf.py, openrlhf_cli.py, openrlhf_flags.py and openrlhf_statistics.py; names with a
leading underscore are the package's own):
    flags        the flag: `PresetFlag`, the settings (`_settings`), the refusals (`check_args`), the driver's args
    cli          the launcher ``python -m kl_adapters.adapters.openrlhf_cli`` (`main`)
    renamed      OpenRLHF's renamed flags (`RENAMED`), for the launcher and the doctor
    loss         the loss path: the preset's KL term through OpenRLHF's KL loss, its metrics
    reward       the reward path: k1 in the reward, the reduced preset's reward-to-go
    statistics   the rollout-wide statistics, fitted with OpenRLHF's advantages or scores, carried in Experience.info
    eos          pi(EOS | y_<t) from the policy forward OpenRLHF already runs; eos_payload: the values it carries
    positions    the action layout seen from each response's start (`aligned`), and the horizon
    budget       the KL budget in the single controller, its state in OpenRLHF's checkpoint
    state        what the wrappers hand each other (`patching.Scoped` values), with extents
This package wires them (`SITES`, `patch`, `unpatch`) through the adapters' shared `patching` module.

What is patched, at the narrowest points (`SITES`, installed by `patch` through the shared `patching`; wrappers, no copied
code):
    loss path (PolicyModelActor): ``ActorPPOTrainer.training_step`` (`loss._wrap_training_step`: hands the KL the batch
        and the optimizer step's normalisers) and ppo_actor.py's binding of ``compute_approx_kl`` (`loss._wrap_loss_kl`:
        value OpenRLHF's, gradient the preset's)
    rollout statistics (PPOTrainer / TrainingActor): ``RemoteExperienceMaker.compute_advantages_and_returns``
        (`_wrap_compute_advantages`: fits them once OpenRLHF has made the advantages)
    reward path (PPOTrainer / TrainingActor): ``RemoteExperienceMaker.make_experience`` (`_wrap_make_experience`) and
        experience_maker.py's binding of ``compute_approx_kl`` (`_wrap_reward_kl`: unclamped k1)
    pi(EOS | y_<t): ``Actor.forward`` and actor.py's binding of ``log_probs_from_logits`` (`_wrap_actor_forward`,
        `_wrap_log_probs_from_logits`): read from the policy forward OpenRLHF already runs
    KL budget: ``BasePPOTrainer.train_step``, ``save_logs_and_checkpoints``, ``init_checkpoint_states``
        (`_wrap_train_step`); driver: ``openrlhf.utils.config.hierarchize`` (`_wrap_hierarchize`)

Math. Loss path (`_loss_term`): OpenRLHF adds ``aggregate_loss(kl) * kl_ctl``; the returned term makes one optimizer
step's gradient beta / D * sum over its sequences of grad kl_surrogate(logp, ref_logp, mask, preset, old_logp),
beta = kl_ctl, old_logp = ``experience.action_log_probs``, D the policy loss's own normaliser (token-mean: the step's
token count N_tok; seq-mean-token-mean / gspo: N_seq x the horizon), so init_coef keeps its strength relative to the
task loss (`loss._wrap_training_step`). Reward path
(`_wrap_make_experience`): k1 in the reward and returns with gamma = 1 give the PPO gradient at the rollout policy
beta * (B / N_tok) * grad kl_surrogate(preset, statistics=the rows', eos=the rollout policy's). The reduced presets'
statistics are leave-one-out over the whole rollout (exact), fitted with OpenRLHF's advantages (`_loss_task`) or
scores (`_reward_task`) and the rollout forward's pi(EOS). Metrics: `_log_loss_metrics`.

Pinned by tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate,
tests/openrlhf/test_reward_path.py (::test_reward_path_gradient_is_reward_preset,
::test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages), tests/openrlhf/test_eos.py,
tests/openrlhf/test_ray.py and tests/openrlhf/test_budget.py.
"""

from __future__ import annotations

import re

from ... import activation
from .._guard import ALLOW_UNTESTED_ENV, UnsupportedFrameworkError, require_version
from ..metrics import GRAD_WEIGHT_GAP, IS_ESS, SEQ_KL
from ..patching import Site, install, installed, uninstall
from ..versions import supported_range
from .budget import BUDGET_STATE, _wrap_init_checkpoint_states, _wrap_save, _wrap_train_step
from .eos import _wrap_actor_forward, _wrap_log_probs_from_logits
from .flags import FLAG, TARGET_FLAG, PresetFlag, _wrap_hierarchize, check_args
from .flags import _receive_flag  # noqa: F401 - what PresetFlags pickled before the split name (this module's)
from .loss import _PPO_ACTOR, _wrap_loss_kl, _wrap_training_step
from .reward import _wrap_make_experience, _wrap_reward_kl
from .statistics import _wrap_compute_advantages

__all__ = ["BUDGET_STATE", "FLAG", "GRAD_WEIGHT_GAP", "IS_ESS", "SEQ_KL", "SITES", "TARGET_FLAG", "PresetFlag",
           "check_args", "patch", "patched", "unpatch"]

_PPO_TRAINER = "openrlhf.trainer.ppo_trainer"
_EXPERIENCE_MAKER = "openrlhf.trainer.ppo_utils.experience_maker"
_CONFIG = "openrlhf.utils.config"
_ACTOR = "openrlhf.models.actor"


#: the first release whose training_step gets the optimizer-step normalisers (loss_batch_info) this adapter relies on
_FIRST_COMPATIBLE = (0, 10, 4)


def _refuse_incompatible(version: str) -> None:
    """UnsupportedFrameworkError for releases the adapter cannot patch correctly, whatever KL_ADAPTERS_ALLOW_UNTESTED."""
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    if release < _FIRST_COMPATIBLE:
        raise UnsupportedFrameworkError(
            f"openrlhf=={version} cannot be patched: before 0.10.4 ActorPPOTrainer.training_step takes no "
            "loss_batch_info and normalises the loss per micro-batch, so the KL scale kl-adapters sets would be wrong "
            f"(not overridable by {ALLOW_UNTESTED_ENV}); kl-adapters supports {supported_range('openrlhf')}")


#: trigger module -> what is patched when it is imported (leading parameters common to versions.TESTED["openrlhf"];
#: compute_approx_kl gained log_probs_old and unbiased_gradient in 0.11.1, `_wrap_loss_kl` reads its own signature)
SITES: dict[str, tuple[Site, ...]] = {
    _PPO_ACTOR: (
        Site("training_step", ("self", "experience", "kl_ctl", "step", "loss_batch_info"), _wrap_training_step,
             owner="ActorPPOTrainer"),
        Site("compute_approx_kl", ("log_probs", "log_probs_base"), _wrap_loss_kl),
        Site("forward", ("self", "sequences", "action_mask"), _wrap_actor_forward, module=_ACTOR, owner="Actor"),
        Site("log_probs_from_logits", ("logits", "labels"), _wrap_log_probs_from_logits, module=_ACTOR),
        Site("hierarchize", ("args",), _wrap_hierarchize, module=_CONFIG),
    ),
    _PPO_TRAINER: (
        Site("train_step", ("self", "rollout_samples", "global_step"), _wrap_train_step, owner="BasePPOTrainer"),
        Site("save_logs_and_checkpoints", ("self", "global_step", "logs_dict", "client_states"), _wrap_save,
             owner="BasePPOTrainer"),
        Site("init_checkpoint_states", ("self",), _wrap_init_checkpoint_states, owner="BasePPOTrainer"),
    ),
    _EXPERIENCE_MAKER: (
        Site("make_experience", ("self", "samples_list"), _wrap_make_experience, owner="RemoteExperienceMaker"),
        Site("compute_advantages_and_returns", ("self", "experiences"), _wrap_compute_advantages,
             owner="RemoteExperienceMaker"),
        Site("compute_approx_kl", ("log_probs", "log_probs_base"), _wrap_reward_kl),
    ),
}


def patch(trigger: str) -> None:
    """Patch what OpenRLHF keeps in module `trigger` (idempotent; UnsupportedFrameworkError off versions.TESTED).

    openrlhf.trainer.ray.ppo_actor: ActorPPOTrainer.training_step, its compute_approx_kl binding, and
        openrlhf.utils.config.hierarchize (the CLI's args builder, which then carries the flag into the actors);
    openrlhf.trainer.ppo_trainer: BasePPOTrainer.train_step, save_logs_and_checkpoints, init_checkpoint_states (the KL
        budget, in the single controller);
    openrlhf.trainer.ppo_utils.experience_maker: RemoteExperienceMaker.make_experience, its compute_approx_kl binding.
    A refused KL_ADAPTERS raises its SettingError (`activation.check_environment`).

    Releases (their KL code diffed, not only tested): what differs and where it is handled.
        0.11.1 -> 0.11.2  compute_approx_kl clamps log_ratio at -10 before k3's exp (the value OpenRLHF logs; our
                          gradient never goes through it); --actor.loss_agg_mode is new (`_check_reward_path` reads it
                          with the 0.11.1 meaning, token-mean, as default); PolicyLoss returns 5 values (training_step
                          is wrapped, not copied, so its arity does not matter); the reward path promotes rewards to
                          float32 and gains flash_reinforce (the KL reward is float32 already; compute_reward and the
                          returns are unchanged).
        0.11.0 -> 0.11.1  compute_approx_kl gains log_probs_old and unbiased_gradient, and training_step passes them;
                          --algo.kl.unbiased_gradient is new. `_wrap_loss_kl` forwards the release's own call and takes
                          old_logp from the experience on every release; `check_args` reads the flag only where it
                          exists.
        0.11.0 -> 0.11.1  also: Actor.forward divides the logits by the temperature before log_probs_from_logits,
                          which 0.10.4 / 0.11.0 do inside it; `_wrap_log_probs_from_logits` reads the logits after its
                          call, so pi(EOS) is at the rollout temperature on every release.
        0.10.4 -> 0.11.0  no change to compute_approx_kl, compute_reward, the returns, training_step's KL,
                          aggregate_loss or the replay buffer (the diffs: z3 leaf modules, masked_normalize's keepdim,
                          a dead GSPO line).
        0.10.3 and older  refused even with KL_ADAPTERS_ALLOW_UNTESTED=1 (`_refuse_incompatible`): training_step takes
                          no loss_batch_info and normalises each micro-batch by its own token count (0.10.4 introduced
                          the optimizer-step normalisers, loss_utils.iter_grad_accum_global_norm), so `_loss_term`'s
                          scale would be wrong.
    """
    activation.check_environment()
    version = require_version("openrlhf")
    _refuse_incompatible(version)
    if trigger not in SITES:
        raise ValueError(f"{trigger!r} is not an OpenRLHF module kl-adapters patches ({', '.join(SITES)})")
    install("openrlhf", version, trigger, SITES[trigger])


def unpatch() -> None:
    """Restore every original OpenRLHF function."""
    uninstall("openrlhf")


def patched() -> list[str]:
    """The OpenRLHF attributes currently replaced, as 'owner.name' (for checks inside Ray actors)."""
    return installed("openrlhf")
