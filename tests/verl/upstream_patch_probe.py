"""Measurements on a released verl tree, run by test_upstream_patch.py in a subprocess whose sys.path starts with that
tree (patched or pristine) and with verl plugins off, so that `import verl` is the tree's code alone. Writes a dict to
OUT with torch.save.

    python upstream_patch_probe.py TREE OUT {pristine,patched}

Both trees ("flag_off", verl's defaults): ppo_loss (low_var_kl and k3+ KL losses) on a tiny random Llama (verl_cases),
loss and parameter gradient; the KL-in-reward path (apply_kl_penalty, then compute_advantage for grpo and rloo, and
v1's compute_advantage_for_multi_trajectories) with its metrics and tensors.
Patched tree only:
    "loss_error"     kl_loss_type="sequence": |g_flag - g_task - g_kl| / |g_kl|, g_kl the gradient of
                     kl_surrogate("sequence-plain", beta=per_sequence_beta(kl_loss_coef, mask, loss_agg_mode), old_logp)
    "reward_error"   algorithm.kl_in_advantage: max |A - (A_scores - beta * sum_{s>=t} k1_s)| and, through verl's PG
                     loss on-policy, |g_flag - g_task - g_reward| / |g_reward| with kl_surrogate("reward-plain")
    "random_error"   kl_penalty_sequence vs kl_surrogate on random ragged batches (float64)
    "exact_error"    exact expected gradient over every sequence of tabular policies vs grad KL_seq: kl_penalty_sequence
                     on- and off-policy; the reward path (apply_kl_penalty + compute_advantage) on-policy
    "generated_configs"  whether each _generated_*.yaml equals what verl's config generator prints
"""

import sys
from pathlib import Path

import numpy as np
import torch

COEF, BETA, GROUP = 0.3, 0.1, 4
MODES = ("token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm")


def reward_batch(case, scores=None):
    """A DataProto as the trainers hold it before apply_kl_penalty (outcome scores at each response's last token)."""
    from verl import DataProto

    mask = case.tokens["response_mask"]
    if scores is None:
        last = mask.cumsum(-1) == mask.sum(-1, keepdim=True)
        scores = torch.rand(mask.shape[0], 1, generator=torch.Generator().manual_seed(7)) * mask * last
    return DataProto.from_dict(
        tensors={"response_mask": mask, "token_level_scores": scores, "old_log_probs": case.old.clone(),
                 "ref_log_prob": case.ref.clone()},
        non_tensors={"uid": np.array([f"p{i // GROUP}" for i in range(mask.shape[0])], dtype=object)})


def advantages(case, estimator: str, site: str = "v0", **algo):
    """apply_kl_penalty (if use_kl_in_reward) then the trainer's advantage function: the batch and the KL metrics."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.core_algos import FixedKLController
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    config = AlgoConfig(adv_estimator=estimator, **algo)
    data, metrics = reward_batch(case), {}
    if config.use_kl_in_reward:
        data, metrics = ray_trainer.apply_kl_penalty(data, FixedKLController(BETA), kl_penalty=config.kl_penalty)
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    kwargs = dict(adv_estimator=estimator, num_repeat=GROUP, config=config)
    if site == "v1":
        keys = [f"{uid}_{row}_0" for row, uid in enumerate(data.non_tensor_batch["uid"])]
        return compute_advantage_for_multi_trajectories(data, batch_keys=keys, **kwargs), metrics
    return ray_trainer.compute_advantage(data, **kwargs), metrics


def flag_off() -> dict:
    from verl_cases import Case, actor_config

    case, out = Case(seed=0), {}
    for kl_loss_type, mode in (("low_var_kl", "token-mean"), ("k3+", "seq-mean-token-sum")):
        grad, loss, _ = case.ppo_grad(actor_config(kl_loss_type=kl_loss_type, loss_agg_mode=mode))
        out[f"ppo_loss/{kl_loss_type}/{mode}"] = (loss, grad)
    for site, estimator in (("v0", "grpo"), ("v0", "rloo"), ("v1", "grpo")):
        data, metrics = advantages(case, estimator, site, use_kl_in_reward=True)
        tensors = {k: data.batch[k] for k in ("advantages", "returns", "token_level_rewards")}
        out[f"reward/{site}/{estimator}"] = (tensors, metrics)
    return out


def loss_path_errors() -> dict:
    from verl_cases import R, Case, actor_config

    from kl_adapters import per_sequence_beta

    errors = {}
    for regime, case in (("off", Case(seed=0)), ("on", Case(seed=1, on_policy=True))):
        mask = case.tokens["response_mask"]
        tokens, sequences = int(mask.sum()), mask.shape[0]
        runs = [(mode, {}, per_sequence_beta(COEF, mask, mode, max_length=R)) for mode in MODES]
        # one micro-batch of a mini-batch 3x larger, on one of 2 data-parallel ranks: verl's global normaliser
        runs.append(("token-mean", dict(batch_num_tokens=3 * tokens, global_batch_size=3 * sequences, dp_size=2),
                     per_sequence_beta(COEF, mask, "token-mean", num_tokens=3 * tokens / 2)))
        for mode, info, beta in runs:
            flagged, _, _ = case.ppo_grad(actor_config(kl_loss_type="sequence", loss_agg_mode=mode), **info)
            task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False, loss_agg_mode=mode), **info)
            kl = case.surrogate_grad(preset="sequence-plain", beta=beta)
            key = f"{regime}/{mode}" + ("/dp2" if info else "")
            errors[key] = float((flagged - task - kl).norm() / kl.norm())
    return errors


def reward_path_errors() -> dict:
    from verl_cases import Case, actor_config

    from kl_adapters import kl_reward, per_sequence_beta

    case, errors = Case(seed=2, on_policy=True), {}
    kl_to_go = kl_reward(case.old, case.ref, case.tokens["response_mask"], beta=BETA, to_go=True)
    for site, estimator in (("v0", "grpo"), ("v0", "rloo"), ("v0", "reinforce_plus_plus"), ("v1", "grpo")):
        ours, _ = advantages(case, estimator, site, use_kl_in_reward=True, kl_in_advantage=True)
        scores_only, _ = advantages(case, estimator, site)
        expected = scores_only.batch["advantages"] + kl_to_go
        errors[f"advantages/{site}/{estimator}"] = float((ours.batch["advantages"] - expected).abs().max())
    ours, _ = advantages(case, "grpo", use_kl_in_reward=True, kl_in_advantage=True)
    scores_only, _ = advantages(case, "grpo")
    config = actor_config(use_kl_loss=False)
    flagged, _, _ = case.ppo_grad(config, advantages=ours.batch["advantages"])
    task, _, _ = case.ppo_grad(config, advantages=scores_only.batch["advantages"])
    beta = per_sequence_beta(BETA, case.tokens["response_mask"], "token-mean")
    kl = case.surrogate_grad(preset="reward-plain", beta=beta)
    errors["pg_gradient/v0/grpo"] = float((flagged - task - kl).norm() / kl.norm())
    return errors


def function_errors() -> dict:
    """kl_penalty_sequence against kl_adapters (patches/gradient_checks.py), plus the reward path's exact gradient."""
    from gradient_checks import errors
    from verl.trainer.ppo.core_algos import kl_penalty_sequence

    result = errors(lambda logp, ref, old, mask: kl_penalty_sequence(logp, ref, old, mask).sum(-1))
    result["exact_error"].update(reward_path_exact_errors())
    return result


def reward_path_exact_errors() -> dict:
    """On-policy PG loss -sum_t A_t log pi_t with A from apply_kl_penalty + compute_advantage(kl_in_advantage): its
    exact expected gradient over every sequence of a tabular policy is beta * grad KL_seq."""
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.core_algos import FixedKLController

    from kl_adapters import audit

    exact_error = {}
    for vocab, horizon, seed in ((4, 4, 0), (3, 5, 1)):
        pol = audit.random_policies(vocab, horizon, seed)
        space, name = pol.space, f"V{vocab}T{horizon}s{seed}"
        ref = audit.token_logps(space, pol.ref_logits)
        theta = pol.logits.detach().clone().requires_grad_()
        logp = audit.token_logps(space, theta)
        n = space.num_sequences
        data = DataProto.from_dict(
            tensors={"response_mask": space.mask.double(), "token_level_scores": torch.zeros(n, horizon,
                     dtype=torch.float64), "old_log_probs": logp.detach(), "ref_log_prob": ref},
            non_tensors={"uid": np.array([str(i) for i in range(n)], dtype=object)})
        data, _ = ray_trainer.apply_kl_penalty(data, FixedKLController(BETA), kl_penalty="kl")
        config = AlgoConfig(adv_estimator="grpo", use_kl_in_reward=True, kl_in_advantage=True)
        adv = ray_trainer.compute_advantage(data, adv_estimator="grpo", config=config).batch["advantages"]
        q = logp.detach().sum(-1).exp()
        (expected,) = torch.autograd.grad(-(q * (adv * logp).sum(-1)).sum(), theta)
        target = audit.targets(space, pol.logits, pol.ref_logits, pol.logits)["kl_seq"]
        exact_error[f"reward_path/{name}/on"] = audit.relative_error(expected.flatten() / BETA, target)
    return exact_error


def generated_configs_in_sync() -> dict:
    """Each _generated_*.yaml (which the patch edits by hand, one line each) equals what verl's generator
    (scripts/generate_trainer_config.sh: print_cfg.py --cfg job [model_engine=X]) prints for the patched yaml sources,
    but for the generator's first line."""
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    in_sync = {}
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        for engine, name in (("dp", "ppo_trainer"), ("megatron", "ppo_megatron_trainer"),
                             ("veomni", "ppo_veomni_trainer"), ("torchtitan", "ppo_torchtitan_trainer")):
            config = compose(config_name="ppo_trainer", overrides=[] if engine == "dp" else [f"model_engine={engine}"])
            with open(os.path.join(config_dir, f"_generated_{name}.yaml")) as f:
                body = f.read().split("\n", 4)[4]  # after the 4-line header
            in_sync[name] = OmegaConf.to_yaml(config).split("\n", 1)[1] == body.split("\n", 1)[1]
    return in_sync


def main(tree: str, out: str, mode: str) -> None:
    import verl

    assert Path(verl.__file__).resolve().is_relative_to(Path(tree).resolve()), verl.__file__
    torch.set_num_threads(1)
    result = {"verl_file": verl.__file__, "flag_off": flag_off()}
    if mode == "patched":
        result.update(loss_error=loss_path_errors(), reward_error=reward_path_errors(), **function_errors(),
                      generated_configs=generated_configs_in_sync())
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
