"""What engine_check.py (verl's FSDP engine) and megatron_check.py (verl's Megatron engine) share: the batch sizes and
the actor configuration (`actor_config`), the batch as verl's trainer hands it to the actor (`batch`), the calls of
verl's TrainingWorker the checks make (`log_probs`: compute_log_prob's forward; `train`: one actor update), the flagged
loss that records the training forward's pi(EOS) (`capturing`), the behaviour and reference log-probs and advantages
(`behaviour`), the oracle loss (`oracle`), the updates the flagged one is compared with (`oracle_updates`,
`update_errors`) and the flag-off comparison (`flag_off_is_upstream`). What differs between the engines comes in as
arguments: the actor config class and its engine's fields, the script's batch builder (`batch`: batch(**columns);
the callers may replace the rows it lays out), how the initial weights come back (`restart`) and how an update is
read (`update`). Imported by the two scripts once they have set up the process (its environment; the test-only CPU
platform shim): it imports verl.

The oracle, for one SGD step (lr 1, no weight decay, no clipping: the parameter update is the gradient) from the same
initial weights as the flagged update (``kl_loss_type=kl_adapters:<preset>``), per micro-batch:

    verl's ppo_loss without KL (a config with use_kl_loss=False)
    + kl_surrogate(log-probs, ref, mask, preset, beta=per_sequence_beta(COEF, mask, "token-mean",
                   num_tokens=<verl's global token count> / dp_size), old_logp=<the behaviour log-probs>)

and for the reduced presets (uses_batch_statistics) with statistics = kl_statistics(old, ref, mask,
task=TaskAdvantages(advantages, COEF, normalized=True), eos) of the whole batch -- all B rows, at the initial policy
(one SGD step: the policy is the initial one at every micro-batch) -- and the micro-batch's rows of those statistics
and of eos: EndOfSequence(pi(EOS | y_<t) of a separate forward of the same weights, responses == EOS, R). eos None:
the statistics and the loss without it (the oracle without the termination control variate, whose distance from the
oracle is the variate's effect). Each micro-batch row is found in the batch by its behaviour log-probs, independently
of the adapter's row tags. The flagged update must equal the oracle's (`update_errors`: kl_rel_error, relative to the
KL part = the oracle's update - the task-only update).
"""

from functools import partial

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils import losses
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from kl_adapters import EndOfSequence, TaskAdvantages, get_preset, kl_statistics, kl_surrogate, per_sequence_beta
from kl_adapters.adapters import verl as verl_adapter
from kl_adapters.adapters.verl import loss as verl_loss

#: verl's kl_loss_coef, the mini-batch (the whole 8-row batch: one update) and micro-batch sizes (rows)
COEF, MINI, MICRO = 0.5, 8, 4


def actor_config(config_class, kl_loss_type, use_kl_loss=True, **engine):
    """verl's actor config (`config_class`: FSDPActorConfig or McoreActorConfig) with the checks' batch sizes and the
    KL term (`kl_loss_type` at COEF); `engine`: the engine's own fields."""
    return config_class(rollout_n=4, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
                        use_kl_loss=use_kl_loss, kl_loss_type=kl_loss_type, kl_loss_coef=COEF, **engine)


def batch(tokens, **extra):
    """The rows `tokens` (verl_cases.make_tokens) as verl's trainer hands them to the actor: prompt + response ids,
    attention mask and positions through verl's left_right_2_no_padding, temperature 1; `extra`: more columns."""
    t = tokens
    td = tu.get_tensordict({"prompts": t["prompts"], "responses": t["responses"],
                            "input_ids": torch.cat([t["prompts"], t["responses"]], 1),
                            "attention_mask": t["attention_mask"],
                            "position_ids": (t["attention_mask"].cumsum(1) - 1).clamp(min=0),
                            "response_mask": t["response_mask"], **extra})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0)
    return td


def log_probs(batch, worker, **flags):
    """compute_log_prob's forward (TrainingWorker.infer_batch) of batch(): the padded log-probs of the responses (None
    on a rank verl returns no outputs from); `flags`: more of its non-tensor flags."""
    td = batch()
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, **flags)
    output = worker.infer_batch(td)
    return None if output is None else no_padding_2_padding(tu.get(output, "log_probs"), td).float().cpu()


def capturing(config):
    """partial(ppo_loss, config=...) as verl's worker builds it, recording model_output's EOS_PROB per micro-batch."""
    captured = []

    def loss(config, model_output, data, dp_group=None):
        prob = no_padding_2_padding(model_output[verl_adapter.EOS_PROB], data).detach().cpu()
        captured.append((data[verl_loss._ROW].cpu(), prob))
        return losses.ppo_loss(config, model_output, data, dp_group)

    return partial(loss, config=config), captured


def train(batch, worker, loss_fn, old, ref, adv):
    """One actor update (TrainingWorker.train_mini_batch, the whole batch one mini-batch) with `loss_fn`: verl's
    metrics (None on a rank verl returns no outputs from: Ulysses ranks after a group's first, tensor-parallel ranks
    > 0)."""
    worker.set_loss_fn(loss_fn)
    td = batch(old_log_probs=old, ref_log_prob=ref, advantages=adv)
    tu.assign_non_tensor(td, global_batch_size=MINI, mini_batch_size=MINI, epochs=1, dp_size=1)
    output = worker.train_mini_batch(td)
    return None if output is None else tu.get(output, "metrics")


def behaviour(current, mask):
    """Behaviour and reference log-probs != `current` (the policy's: + 0.3 and 0.5 N(0, 1)) and random advantages,
    masked by `mask`; seeded."""
    gen = torch.Generator().manual_seed(1)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask  # a behaviour policy != pi_theta
    ref = (current + 0.5 * torch.randn(current.shape, generator=gen)) * mask
    adv = torch.randn(mask.shape[0], 1, generator=gen) * mask
    return old, ref, adv


def oracle(config_without_kl, preset, mask, old, ref, adv, eos):
    """The oracle loss (the module's docstring) for `preset`: `mask` the batch's response mask, `eos` an EndOfSequence
    of the whole batch or None."""
    upstream = losses.ppo_loss.__kl_adapters_original__
    reduced = get_preset(preset).uses_batch_statistics
    statistics = kl_statistics(old, ref, mask.bool(), task=TaskAdvantages(adv, COEF, True),
                               eos=eos) if reduced else None

    def loss_fn(model_output, data, dp_group=None):
        loss, metrics = upstream(config_without_kl, model_output, data, dp_group)
        lp = no_padding_2_padding(model_output["log_probs"], data)
        td = data.select("response_mask", "old_log_probs", "ref_log_prob").to_padded_tensor()
        mask = td["response_mask"].bool()
        beta = per_sequence_beta(COEF, mask, "token-mean", num_tokens=data["batch_num_tokens"] / data["dp_size"])
        width = mask.shape[1]
        rows = (td["old_log_probs"][:, None].cpu() == old[None, :, :width]).all(-1).float().argmax(1)
        kl_kwargs = {} if not reduced else {
            "statistics": statistics[rows].with_width(width).to(lp.device),
            "eos": None if eos is None else EndOfSequence(eos.prob[rows, :width].to(lp.device),
                                                          eos.is_eos[rows, :width].to(lp.device), eos.horizon)}
        return loss + kl_surrogate(lp, td["ref_log_prob"], mask, preset=preset, beta=beta,
                                   old_logp=td["old_log_probs"], **kl_kwargs), metrics

    return loss_fn


def oracle_updates(batch, worker, config_without_kl, preset, mask, old, ref, adv, eos, restart, update):
    """Each from the initial weights (`restart()`): the oracle's update ("oracle"), the oracle's without pi(EOS)
    ("oracle_without_eos") and the task-only one (verl's ppo_loss without KL: "task"), as `update()` reads one after
    the step. Returns those updates and the oracle's metrics."""
    updates, metrics = {}, {}
    for name, loss_eos in (("oracle", eos), ("oracle_without_eos", None)):
        restart()
        metrics[name] = train(batch, worker, oracle(config_without_kl, preset, mask, old, ref, adv, loss_eos), old, ref,
                              adv)
        updates[name] = update()
    restart()
    train(batch, worker, partial(losses.ppo_loss, config=config_without_kl), old, ref, adv)
    updates["task"] = update()
    return updates, metrics["oracle"]


def update_errors(captured, eos, flagged, updates):
    """The flagged update against `oracle_updates`' (KL part = oracle - task): pi(EOS) of the training forward
    (`capturing`'s record of the flagged update) against the separate forward's (`eos`), the effect of pi(EOS) on the
    oracle, the flagged update's relative error and the KL part's size against the task-only update."""
    training_eos = torch.zeros_like(eos.prob)
    for rows, prob in captured:  # the flagged update's micro-batches, at the initial weights
        training_eos[rows, :prob.shape[1]] = prob
    kl_part = updates["oracle"] - updates["task"]
    return {"training_eos_error": float((training_eos - eos.prob).abs().max()),
            "eos_effect": float((updates["oracle_without_eos"] - updates["oracle"]).norm() / kl_part.norm()),
            "kl_rel_error": float((flagged - updates["oracle"]).norm() / kl_part.norm()),
            "kl_vs_task": float(kl_part.norm() / updates["task"].norm())}


def flag_off_is_upstream(batch, worker, config, restart, weights, old, ref, adv):
    """With verl's own kl_loss_type (`config`), compute_log_prob's outputs (every key and value) and one update's
    weights (`weights()`), each from the initial weights (`restart()`), are the same as with the adapter unpatched
    (last: it unpatches). Returns whether they are, and the patched run's weights after its update."""
    native = partial(losses.ppo_loss, config=config)
    outputs, after = [], []
    for patched in (True, False):
        if not patched:
            verl_adapter.unpatch()
        restart()
        worker.set_loss_fn(native)
        td = batch()
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
        out = worker.infer_batch(td)
        outputs.append({} if out is None else {k: out[k].values() for k in out.keys() if k != "metrics"})
        train(batch, worker, native, old, ref, adv)
        after.append(weights())
    same_outputs = outputs[0].keys() == outputs[1].keys() and all(
        torch.equal(outputs[0][k], outputs[1][k]) for k in outputs[0])
    return same_outputs and torch.equal(*after), after[0]
