"""OpenRLHF's renamed ``train_ppo_ray`` flags: the one table that the launcher (`cli`) and the doctor
(`kl_adapters.doctor.openrlhf`) read to say what an old flag is called now.

OpenRLHF 0.10.2 (commit ed62d0e2, "dotted config hierarchy") replaced the flat flags of openrlhf/cli/train_ppo_ray.py
by dotted ones; every release kl-adapters supports (0.10.4-0.11.2) refuses the old names as "unrecognized arguments".
`RENAMED` holds the flags the doctor reads and those most scripts and posts use: each old name with its new one, the
same argument (matched by help text, default and use between the 0.10.1.post2 and 0.11.2 parsers). Imports nothing.
Pinned by tests/openrlhf/test_activation.py::test_renamed_flags_are_new_flags_of_the_installed_openrlhf.
"""

from __future__ import annotations


#: the release that renamed them
RENAMED_IN = "0.10.2"


#: old flag (OpenRLHF <= 0.10.1) -> its name since RENAMED_IN
RENAMED: dict[str, str] = {
    # the KL and the advantages
    "--use_kl_loss": "--algo.kl.use_loss",
    "--init_kl_coef": "--algo.kl.init_coef",
    "--kl_estimator": "--algo.kl.estimator",
    "--kl_target": "--algo.kl.target",
    "--kl_horizon": "--algo.kl.horizon",
    "--advantage_estimator": "--algo.advantage.estimator",
    "--gamma": "--algo.advantage.gamma",
    "--lambd": "--algo.advantage.lambd",
    "--no_advantage_std_norm": "--algo.advantage.no_std_norm",
    "--dynamic_filtering": "--algo.dynamic_filtering_enable",
    "--policy_loss_type": "--actor.policy_loss_type",
    "--eps_clip": "--actor.eps_clip",
    "--entropy_loss_coef": "--actor.entropy_coef",
    # batch sizes and epochs (on- or off-policy)
    "--rollout_batch_size": "--rollout.batch_size",
    "--micro_rollout_batch_size": "--rollout.micro_batch_size",
    "--n_samples_per_prompt": "--rollout.n_samples_per_prompt",
    "--train_batch_size": "--train.batch_size",
    "--micro_train_batch_size": "--train.micro_batch_size",
    "--max_epochs": "--train.max_epochs",
    "--async_train": "--train.async_enable",
    "--use_dynamic_batch": "--train.dynamic_batch_enable",
    # generation and data
    "--max_new_tokens": "--rollout.max_new_tokens",
    "--max_len": "--data.max_len",
    "--temperature": "--rollout.temperature",
    "--top_p": "--rollout.top_p",
    "--prompt_data": "--data.prompt_dataset",
    "--input_key": "--data.input_key",
    "--label_key": "--data.label_key",
    "--apply_chat_template": "--data.apply_chat_template",
    "--max_samples": "--data.max_samples",
    # models, reward, parallelism, checkpoints
    "--pretrain": "--actor.model_name_or_path",
    "--reward_pretrain": "--reward.model_name_or_path",
    "--critic_pretrain": "--critic.model_name_or_path",
    "--remote_rm_url": "--reward.remote_url",
    "--normalize_reward": "--reward.normalize_enable",
    "--agent_func_path": "--train.agent_func_path",
    "--eval_dataset": "--eval.dataset",
    "--actor_learning_rate": "--actor.adam.lr",
    "--critic_learning_rate": "--critic.adam.lr",
    "--zero_stage": "--ds.zero_stage",
    "--adam_offload": "--ds.adam_offload",
    "--gradient_checkpointing": "--actor.gradient_checkpointing_enable",
    "--packing_samples": "--ds.packing_samples",
    "--ring_attn_size": "--ds.ring_attn_size",
    "--ds_tensor_parallel_size": "--ds.tensor_parallel_size",
    "--colocate_all_models": "--train.colocate_all",
    "--vllm_num_engines": "--vllm.num_engines",
    "--num_episodes": "--train.num_episodes",
    "--seed": "--train.seed",
    "--save_path": "--ckpt.output_dir",
    "--ckpt_path": "--ckpt.path",
    "--load_checkpoint": "--ckpt.load_enable",
    "--save_steps": "--ckpt.save_steps",
    "--logging_steps": "--logger.logging_steps",
    "--eval_steps": "--eval.steps",
}


def renamed_hint(argv: list[str]) -> str | None:
    """One line naming each old flag in `argv` with its new name ("--use_kl_loss was renamed --algo.kl.use_loss in
    OpenRLHF 0.10.2"), or None when argv has none."""
    old = list(dict.fromkeys(word.split("=", 1)[0] for word in argv if word.split("=", 1)[0] in RENAMED))
    if not old:
        return None
    renames = ", ".join(f"{flag} was renamed {RENAMED[flag]}" for flag in old)
    return f"{renames} in OpenRLHF {RENAMED_IN} (dotted flags; this OpenRLHF refuses the old names)"
