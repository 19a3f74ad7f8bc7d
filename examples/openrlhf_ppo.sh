#!/usr/bin/env bash
# OpenRLHF 0.11.2 with kl-adapters, one 8-GPU node, GRPO-style (group_norm) training.
#
# Compared with a plain OpenRLHF run, a user changes (lines marked "kl-adapters"):
#   1. the entry point: `python -m kl_adapters.adapters.openrlhf_cli` instead of `python -m openrlhf.cli.train_ppo_ray`
#      (the same arguments, plus one flag);
#   2. the flag: --algo.kl.preset sequence (KL as a loss: exact gradient of the sequence KL, on- and off-policy)
#      or --algo.kl.preset reward (OpenRLHF's default KL-in-reward path, made exact: k1, no clamp, gamma 1);
#   3. nothing else: --algo.kl.init_coef keeps its strength relative to the policy loss (the KL over the same token
#      count). See docs/openrlhf.md.
# Multi-node: start Ray on every node as usual (`ray start --head` / `ray start --address ...`) with kl-adapters
# installed in every node's Python; the flag reaches every actor with OpenRLHF's own arguments.
#
# Usage: [MODEL=...] [DATA=...] [REWARD_URL=...] [MODE=loss|reward] [DRY_RUN=1] bash examples/openrlhf_ppo.sh
#        DRY_RUN=1 prints the arguments instead of training (tests/openrlhf/test_cli.py parses them with OpenRLHF).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD_URL=${REWARD_URL:-http://127.0.0.1:5000/get_reward}
MODE=${MODE:-loss}

args=(
  --actor.model_name_or_path "$MODEL" --reward.remote_url "$REWARD_URL"
  --data.prompt_dataset "$DATA" --data.input_key context_messages --data.apply_chat_template
  --actor.num_gpus_per_node 8 --ref.num_gpus_per_node 8 --vllm.num_engines 8 --train.colocate_all
  --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --rollout.micro_batch_size 16
  --rollout.max_new_tokens 1024 --data.max_len 2048
  --train.micro_batch_size 8 --train.max_epochs 1
  --ds.zero_stage 2 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --actor.gradient_checkpointing_enable
  --algo.advantage.estimator group_norm
  --ckpt.output_dir "./ckpt/kl_adapters_$MODE"
)
case "$MODE" in
  loss)   # KL as a loss; the estimator only sets the logged `kl` value, the preset sets the gradient
    args+=(--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001)
    args+=(--train.batch_size 256)   # 4 optimizer steps per rollout: `sequence` is exact off-policy too
    args+=(--algo.kl.preset sequence) ;;                                              # kl-adapters
  reward) # KL in the reward (k1, gamma 1, token-mean loss aggregation); init_coef keeps its OpenRLHF meaning
    args+=(--algo.kl.estimator k1 --algo.kl.init_coef 0.01)
    args+=(--train.batch_size 1024)  # one optimizer step per rollout: `reward`'s per-token ratio is exact on-policy only
    args+=(--algo.kl.preset reward) ;;                                                # kl-adapters
  *) echo "MODE must be loss or reward, got $MODE" >&2; exit 2 ;;
esac

if [ -n "${DRY_RUN:-}" ]; then printf '%s\n' "${args[@]}"; exit 0; fi
exec python -m kl_adapters.adapters.openrlhf_cli "${args[@]}"                          # kl-adapters
