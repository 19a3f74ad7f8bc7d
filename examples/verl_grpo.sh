#!/usr/bin/env bash
# GRPO with verl 0.9.1 whose KL regularizer is made exact by kl-adapters (GSM8K recipe; needs GPUs and vLLM).
#
#   bash examples/verl_grpo.sh [more Hydra overrides]        train
#   bash examples/verl_grpo.sh --print-overrides             print the Hydra overrides, one per line, and exit
#
# Environment: MODEL (HF id or path), DATA (folder with train.parquet / test.parquet, e.g. from verl's
# examples/data_preprocess/gsm8k.py), PRESET (kl-adapters preset, default "sequence"), KL_PATH ("loss", default: the
# KL as a loss term in the actor; or "reward": the KL as a reward, the "reward" preset), NNODES, GPUS_PER_NODE.
# Multi-node: install verl 0.9.1 and kl-adapters on every node (`pip install kl-adapters`); the config carries the
# flag to every worker and verl's plugin entry point patches each worker process. Nothing else to set.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
PRESET=${PRESET:-sequence}
KL_PATH=${KL_PATH:-loss}

# The only lines kl-adapters adds to a verl run. The KL reward is exact on-policy only (later mini-batches of a
# rollout see it through PPO's per-token ratio), so the reward path takes one update per rollout (mini-batch = the
# whole batch); the `sequence` loss is exact off-policy too and keeps 4 mini-batches per rollout.
MINI_BATCH=64
case "$KL_PATH" in
  loss) KL_OVERRIDES=(
          actor_rollout_ref.actor.use_kl_loss=True
          actor_rollout_ref.actor.kl_loss_coef=0.001
          "actor_rollout_ref.actor.kl_loss_type='kl_adapters:${PRESET}'"
          algorithm.use_kl_in_reward=False) ;;
  reward) KL_OVERRIDES=(
          actor_rollout_ref.actor.use_kl_loss=False
          algorithm.use_kl_in_reward=True
          algorithm.kl_ctrl.kl_coef=0.001
          algorithm.kl_penalty=kl_adapters:reward)
          MINI_BATCH=256 ;;
  *) echo "KL_PATH must be loss or reward, got $KL_PATH" >&2; exit 2 ;;
esac
# Equivalent without renaming the estimator (keeps kl_loss_type / kl_penalty as they are, selects the preset for
# whichever KL path is on): +ray_kwargs.ray_init.runtime_env.env_vars.KL_ADAPTERS=sequence
# or export KL_ADAPTERS=sequence before launching (the driver forwards it to every Ray worker).

OVERRIDES=(
  algorithm.adv_estimator=grpo
  "data.train_files=$DATA/train.parquet"
  "data.val_files=$DATA/test.parquet"
  data.train_batch_size=256
  data.max_prompt_length=512
  data.max_response_length=1024
  "actor_rollout_ref.model.path=$MODEL"
  actor_rollout_ref.actor.optim.lr=1e-6
  "actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH"
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
  actor_rollout_ref.actor.loss_agg_mode=token-mean
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=5
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
  "trainer.n_gpus_per_node=${GPUS_PER_NODE:-8}"
  "trainer.nnodes=${NNODES:-1}"
  'trainer.logger=["console"]'
  trainer.project_name=kl_adapters
  "trainer.experiment_name=grpo_${KL_PATH}_${PRESET//[:=]/_}"
  trainer.total_epochs=15
  "${KL_OVERRIDES[@]}"
)

if [ "${1:-}" = "--print-overrides" ]; then
  printf '%s\n' "${OVERRIDES[@]}"
  exit 0
fi
exec python3 -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@"
