"""verl's real actor loss (`verl.workers.utils.losses.ppo_loss`, used by the FSDP and Megatron engines) on a tiny random
Llama: with a preset selected, its gradient is verl's task-loss gradient plus the gradient of `kl_surrogate` on the
same tensors, with beta_seq = per_sequence_beta(kl_loss_coef, mask, loss_agg_mode, num_tokens=<verl's global count>).

Identity checked, per preset p with weights c (the preset's per-token gradient weight):
    grad ppo_loss = grad task + kl_loss_coef * grad agg_loss(c_t * log pi_t)
                  = grad task + grad kl_surrogate(..., preset=p, beta=beta_seq, old_logp=old_log_probs, **reduced)
with, for the presets with batch statistics, reduced = the inputs the adapter hands the core:
task=TaskAdvantages(advantages, kl_loss_coef, normalized=True), group=uid ids, eos=EndOfSequence(model_output's
end-of-sequence probabilities, responses == EOS, max response length) -- or statistics of the worker's whole batch.
"""

import importlib.metadata

import pytest
import torch
from verl_cases import B, Case, R, actor_config, flat_grad, flat_log_probs, flat_outputs, padded

from kl_adapters import (SAMPLED_TOKEN_PRESETS, activation, kl_coefficients, kl_statistics, kl_surrogate,
                         per_sequence_beta, sequence_kl)
from kl_adapters.adapters import verl as verl_adapter
from kl_adapters.adapters.verl import loss as verl_loss

#: verl 0.8.0's agg_loss has no "token-sum" mode (verl raises ValueError for it; 0.9.0 added it, times dp_size)
TOKEN_SUM = pytest.mark.skipif(importlib.metadata.version("verl") == "0.8.0", reason="verl 0.8.0 has no token-sum")
MODES = ("token-mean", "seq-mean-token-sum", pytest.param("token-sum", marks=TOKEN_SUM), "seq-mean-token-sum-norm")
COEF = 0.3
UID = [f"p{i // 4}" for i in range(B)]  # verl's uid column: GRPO groups of 4
GROUPS = torch.arange(B) // 4  # the same groups as integer ids


def beta_seq(case: Case, mode: str, num_tokens=None) -> float:
    mask = case.tokens["response_mask"]
    return per_sequence_beta(COEF, mask, mode, num_tokens=num_tokens, max_length=R)


def assert_close(a, b, rtol=1e-5):
    err = ((a - b).norm() / b.norm()).item()
    assert err < rtol, f"relative error {err:.2e}"


def assert_kl_part(flagged, task, kl):
    """flagged == task + kl, checked on the KL part alone (it is a few % of the total on this problem)."""
    assert_close(flagged - task, kl, rtol=1e-4)


@pytest.fixture(scope="module")
def off_policy():
    return Case(seed=0)


@pytest.fixture(scope="module")
def on_policy():
    return Case(seed=1, on_policy=True)


@pytest.mark.compat
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", sorted(SAMPLED_TOKEN_PRESETS))
def test_gradient_is_task_plus_kl_surrogate(off_policy, preset, mode):
    """ppo_loss called on its own (no actor update around it): the reduced presets take their statistics from this
    batch, leave-one-out over its rows, as kl_surrogate does by default."""
    case = off_policy
    flagged, _, metrics = case.ppo_grad(actor_config(kl_loss_type=f"kl_adapters:{preset}", loss_agg_mode=mode))
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False, loss_agg_mode=mode))
    kl = case.surrogate_grad(preset=preset, beta=beta_seq(case, mode), **case.reduced(preset))
    assert_kl_part(flagged, task, kl)
    assert {"actor/pg_loss", "kl_loss", "kl_coef", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap",
            "kl_adapters/is_ess"} <= set(metrics)


@pytest.mark.parametrize("preset", ["sequence-plain", "sequence"])
def test_grad_weight_gap_is_the_distance_of_the_weights(off_policy, preset):
    """kl_adapters/grad_weight_gap = sum_t |c_native - c_preset| / sum_t |c_preset| over the micro-batch's tokens
    (`surrogate.weight_gap`, the adapters' one formula), c_native the on-policy weights of verl's own kl_loss_type
    (low_var_kl, as preset k3-loss, for a kl_adapters: name) and c_preset the preset's, on the same padded batch."""
    case = off_policy
    _, _, metrics = case.ppo_grad(actor_config(kl_loss_type=f"kl_adapters:{preset}"))
    lp = padded(case.log_probs(), case.tokens).detach()
    mask = case.tokens["response_mask"].bool()
    ours = kl_coefficients(lp, case.ref, mask, preset=preset, old_logp=case.old, **case.reduced(preset))
    native = kl_coefficients(lp, case.ref, mask, preset="k3-loss")
    want = ((native - ours).abs().sum() / ours.abs().sum()).item()
    assert want > 0 and metrics["kl_adapters/grad_weight_gap"].aggregate() == pytest.approx(want, rel=1e-5)


@pytest.mark.compat
@pytest.mark.parametrize("preset", ["sequence", "reward", "token"])
def test_on_policy_gradient(on_policy, preset):
    case = on_policy
    flagged, _, _ = case.ppo_grad(actor_config(kl_loss_type=f"kl_adapters:{preset}"))
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False))
    assert_kl_part(flagged, task, case.surrogate_grad(preset=preset, beta=beta_seq(case, "token-mean"),
                                                      **case.reduced(preset)))


@pytest.mark.compat
@pytest.mark.parametrize("preset, scaling", [("sequence", None), ("reward", None), ("sequence", "shifted")])
def test_task_group_and_eos_reach_the_core(off_policy, preset, scaling, monkeypatch):
    """ppo_loss on its own, model_output carrying the end-of-sequence probabilities the engine adds and data carrying
    verl's uid: the KL gradient is kl_surrogate's with task=TaskAdvantages(advantages, kl_loss_coef, normalized unless
    the driver's ADVANTAGES_ENV says "shifted"), group=uid and eos=EndOfSequence(model_output's pi(EOS),
    responses == EOS, R); and each of the three changes it."""
    case = off_policy
    if scaling:
        monkeypatch.setenv(verl_adapter.ADVANTAGES_ENV, scaling)
    flagged, _, _ = case.ppo_grad(actor_config(kl_loss_type=f"kl_adapters:{preset}"), eos=True, uid=UID)
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False), eos=True, uid=UID)
    eos = case.eos()
    assert eos.is_eos.any() and not eos.is_eos.all() and eos.horizon == R
    inputs = {"task": case.task(normalized=scaling != "shifted"), "group": GROUPS, "eos": eos}
    kl = case.surrogate_grad(preset=preset, beta=beta_seq(case, "token-mean"), **inputs)
    assert_kl_part(flagged, task, kl)
    others = {k: {n: v for n, v in inputs.items() if n != k} for k in inputs}
    others["scaling"] = {**inputs, "task": case.task(normalized=scaling == "shifted")}
    for changed, kwargs in others.items():
        other = case.surrogate_grad(preset=preset, beta=beta_seq(case, "token-mean"), **kwargs)
        assert (other - kl).norm() / kl.norm() > 1e-4, changed  # the identity above is not vacuous


@pytest.mark.compat
@pytest.mark.parametrize("mode, dp_size", [("token-mean", 1), ("token-mean", 2), ("seq-mean-token-sum", 1),
                                           ("seq-mean-token-sum", 2), pytest.param("token-sum", 2, marks=TOKEN_SUM)])
def test_micro_batch_keeps_verls_normaliser(off_policy, mode, dp_size):
    """One micro-batch of a mini-batch 3x larger, on one of dp_size ranks: verl's agg_loss divides by the global
    counts and multiplies by dp_size; the KL term shares that divisor D, i.e. beta_seq = kl_loss_coef * B / D with
    D = batch_num_tokens / dp (token-mean), global_batch_size / dp (seq-mean-token-sum), 1 / dp (token-sum)."""
    case = off_policy
    mask = case.tokens["response_mask"]
    tokens, sequences = 3 * int(mask.sum()), 3 * mask.shape[0]
    info = dict(batch_num_tokens=tokens, global_batch_size=sequences, dp_size=dp_size)
    flagged, _, _ = case.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence", loss_agg_mode=mode), **info)
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False, loss_agg_mode=mode), **info)
    divisor = {"token-mean": tokens / dp_size, "seq-mean-token-sum": sequences / dp_size, "token-sum": 1 / dp_size}
    beta = COEF * mask.shape[0] / divisor[mode]
    if mode == "token-mean":
        assert beta == pytest.approx(float(per_sequence_beta(COEF, mask, mode, num_tokens=tokens / dp_size)))
    assert_kl_part(flagged, task, case.surrogate_grad(preset="sequence", beta=beta, task=case.task()))


def test_is_clip_option(off_policy):
    case = off_policy
    flagged, _, _ = case.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence:is_clip=1.5"))
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False))
    kl = case.surrogate_grad(preset="sequence", beta=beta_seq(case, "token-mean"), is_clip=1.5, task=case.task())
    assert_kl_part(flagged, task, kl)


def test_sequence_level_rollout_is_weights_reweight_each_sequence(off_policy):
    """Decoupled rollout correction (rollout_is="sequence"): the KL term of sequence b is weighted by verl's W_b."""
    case = off_policy
    mask = case.tokens["response_mask"]
    weights = (torch.linspace(0.5, 1.5, mask.shape[0])[:, None] * mask).float()
    flagged, _, _ = case.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence"), rollout_is_weights=weights)
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False), rollout_is_weights=weights)
    lp = padded(case.log_probs(), case.tokens)
    beta = COEF / mask.sum()  # per_sequence_beta(COEF, one row, "token-mean", num_tokens=N)
    stats = kl_statistics(lp.detach(), case.ref, mask, old_logp=case.old, task=case.task())  # the batch's own
    kl = sum(weights[b, 0] * kl_surrogate(lp[b:b + 1], case.ref[b:b + 1], mask[b:b + 1], preset="sequence",
                                           beta=beta, old_logp=case.old[b:b + 1], statistics=stats[b:b + 1])
             for b in range(mask.shape[0]))
    assert_kl_part(flagged, task, flat_grad(kl, case.model))


def test_environment_flag_replaces_verls_estimator(off_policy):
    """KL_ADAPTERS / enable() replaces whatever kl_loss_type names; a kl_adapters: name wins over it."""
    case = off_policy
    activation.enable("reward")
    by_env, _, _ = case.ppo_grad(actor_config(kl_loss_type="low_var_kl"))
    by_name, _, _ = case.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence"))
    activation.disable()
    task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False))
    assert_kl_part(by_env, task, case.surrogate_grad(preset="reward", beta=beta_seq(case, "token-mean"),
                                                     task=case.task()))
    assert_kl_part(by_name, task, case.surrogate_grad(preset="sequence", beta=beta_seq(case, "token-mean"),
                                                      task=case.task()))


@pytest.mark.compat
@pytest.mark.parametrize("kl_loss_type", ["low_var_kl", "k1", "k2", "k3+", "abs"])
def test_flag_off_is_bit_identical_to_upstream(off_policy, kl_loss_type):
    case = off_policy
    config = actor_config(kl_loss_type=kl_loss_type)
    grad, loss, metrics = case.ppo_grad(config)
    verl_adapter.unpatch()
    upstream_grad, upstream_loss, upstream_metrics = case.ppo_grad(config)
    assert torch.equal(grad, upstream_grad) and torch.equal(loss, upstream_loss)
    assert set(metrics) == set(upstream_metrics)


def test_token_preset_is_verls_k3_plus_on_policy(on_policy):
    """The `token` preset (c_t = rho_t k1_t) is what verl's k3+ straight-through computes (rho = 1 on-policy)."""
    native, _, _ = on_policy.ppo_grad(actor_config(kl_loss_type="k3+"))
    ours, _, _ = on_policy.ppo_grad(actor_config(kl_loss_type="kl_adapters:token"))
    assert_close(ours, native)


def test_metrics_keep_verls_names_and_read_as_a_kl(off_policy):
    case = off_policy
    mask = case.tokens["response_mask"]
    _, _, metrics = case.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence"))
    with torch.no_grad():
        lp = padded(case.log_probs(), case.tokens)
    per_seq = sequence_kl(lp, case.ref, mask, old_logp=case.old)
    kl_loss = float(metrics["kl_loss"].values[0])
    assert kl_loss == pytest.approx(float(per_seq.sum() / mask.sum()), rel=1e-5)  # token-mean of the sequence KL
    assert float(metrics["kl_adapters/seq_kl"].values[0]) == pytest.approx(float(per_seq.mean()), rel=1e-5)
    assert metrics["kl_coef"] == COEF
    _, _, same = case.ppo_grad(actor_config(kl_loss_type="kl_adapters:k3-loss"))
    assert float(same["kl_adapters/grad_weight_gap"].values[0]) < 1e-6  # verl's low_var_kl has k3-loss's gradient


@pytest.mark.parametrize("kl_loss_type, error", [
    ("kl_adapters:bogus", "unknown KL preset 'bogus'; valid presets: sequence"),
    ("kl_adapters:k1-loss:is_clip=2", "applies no importance weights"),
    ("kl_adapters:off", "selects no preset"),
])
def test_bad_flag_values_raise(off_policy, kl_loss_type, error):
    with pytest.raises(ValueError, match=error):
        off_policy.ppo_grad(actor_config(kl_loss_type=kl_loss_type))


def test_length_normalized_aggregation_is_refused(off_policy):
    with pytest.raises(ValueError, match="seq-mean-token-mean.*length-normalized KL"):
        off_policy.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence", loss_agg_mode="seq-mean-token-mean"))


def test_full_is_refused_when_a_flag_would_replace_it(off_policy):
    activation.enable("sequence")
    with pytest.raises(ValueError, match="'full'.*NotImplementedError"):
        off_policy.ppo_grad(actor_config(kl_loss_type="full"))


def test_non_finite_reference_log_prob_is_a_clear_error(off_policy):
    case = Case(seed=0)
    case.ref = case.ref.clone()
    case.ref[0, 0] = float("nan")
    with pytest.raises(ValueError, match="ref_logp has non-finite values"):
        case.ppo_grad(actor_config(kl_loss_type="kl_adapters:sequence"))


def shuffled_update_grads(case: Case, config, *, uid=None, mini_batch: int = 2, untag: bool = False,
                          eos: bool = False) -> torch.Tensor:
    """What TrainingWorker.train_mini_batch does with the worker's batch: verl's make_iterator splits it into shuffled
    mini-batches, ppo_loss runs on each (global token count: one optimizer step's normaliser); summed gradient.
    untag: drop the adapter's row column from each mini-batch (ppo_loss then falls back to the micro-batch's own);
    eos: model_output carries the end-of-sequence probabilities (`flat_outputs`)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses

    data = case.data()
    if uid is not None:
        data["uid"] = uid
    total = 0
    for part in tu.make_iterator(data, mini_batch_size=mini_batch, epochs=1, seed=0,
                                 dataloader_kwargs={"shuffle": True}):
        if untag:
            part = part.exclude(verl_loss._ROW)
        outputs = flat_outputs(case.model, part) if eos else {"log_probs": flat_log_probs(case.model, part)}
        loss, _ = losses.ppo_loss(config, outputs, part)
        total = total + flat_grad(loss, case.model)
    return total


@pytest.mark.compat
@pytest.mark.parametrize("grouped", [False, True])
def test_statistics_of_the_workers_batch_reach_each_shuffled_micro_batch(off_policy, grouped):
    """Micro-batches of 2 rows, shuffled by verl: each row's KL term uses the statistics of the WHOLE batch the worker
    trains on (leave-one-out over its other rows, or within its GRPO group when verl's uid is in the batch), from the
    behaviour log-probs and the batch's advantages, i.e. grad = task + kl_surrogate(full batch,
    statistics=kl_statistics(old_log_probs, ..., task=TaskAdvantages(advantages, kl_loss_coef, normalized=True)),
    eos=each micro-batch's). No compute_log_prob pass kept end-of-sequence probabilities for the whole batch here
    (tests/verl/test_engine.py runs one), so the statistics carry no termination coefficient."""
    case = off_policy
    mask = case.tokens["response_mask"]
    uid = UID if grouped else None
    group = GROUPS if grouped else None
    flagged = shuffled_update_grads(case, actor_config(kl_loss_type="kl_adapters:sequence"), uid=uid, eos=True)
    task = shuffled_update_grads(case, actor_config(use_kl_loss=False), uid=uid)
    stats = kl_statistics(case.old, case.ref, mask, group=group, task=case.task())
    assert not stats.eos_coef.any()
    expected = case.surrogate_grad(preset="sequence", beta=beta_seq(case, "token-mean"), statistics=stats,
                                   eos=case.eos())
    assert_kl_part(flagged, task, expected)
    own = shuffled_update_grads(case, actor_config(kl_loss_type="kl_adapters:sequence"), uid=uid, untag=True)
    assert ((own - flagged).norm() / (flagged - task).norm()) > 1e-2  # 2-row statistics: another (noisier) estimate


@pytest.mark.compat
def test_flag_off_update_is_bit_identical_with_the_row_column(off_policy):
    """The row column the adapter adds to the worker's batch changes nothing verl computes with the flag off."""
    config = actor_config(kl_loss_type="low_var_kl")
    ours = shuffled_update_grads(off_policy, config)
    verl_adapter.unpatch()
    assert torch.equal(ours, shuffled_update_grads(off_policy, config))


def test_a_batch_split_again_gets_fresh_statistics(off_policy):
    """The worker's statistics belong to the batch of the current split: after the same TensorDict is split again with
    other behaviour log-probs, the KL term uses statistics of the new values (not the previous update's)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses

    case = off_policy
    mask = case.tokens["response_mask"]
    config = actor_config(kl_loss_type="kl_adapters:sequence")
    data = case.data()
    for part in tu.make_iterator(data, mini_batch_size=mask.shape[0], epochs=1):  # statistics of the first values
        losses.ppo_loss(config, {"log_probs": flat_log_probs(case.model, part)}, part)
    shifted = (case.old + 0.1) * mask
    data["old_log_probs"] = shifted
    (part,) = list(tu.make_iterator(data, mini_batch_size=mask.shape[0], epochs=1))
    flagged = flat_grad(losses.ppo_loss(config, {"log_probs": flat_log_probs(case.model, part)}, part)[0], case.model)
    task = flat_grad(losses.ppo_loss(actor_config(use_kl_loss=False), {"log_probs": flat_log_probs(case.model, part)},
                                     part)[0], case.model)
    lp = padded(case.log_probs(), case.tokens)
    kl = kl_surrogate(lp, case.ref, mask, preset="sequence", beta=beta_seq(case, "token-mean"), old_logp=shifted,
                      statistics=kl_statistics(shifted, case.ref, mask, task=case.task()))
    assert_kl_part(flagged, task, flat_grad(kl, case.model))
