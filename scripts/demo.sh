#!/usr/bin/env bash
# The main job: build the TRL environment, then run `kl-adapters demo` -- TRL's real GRPOTrainer on a problem whose
# KL-regularized optimum is known exactly, under each KL configuration, evaluated exactly after every step.
# Writes bench/results/demo_trl_quick.{txt,png,json}. Extra arguments go to `kl-adapters demo` (e.g. --long).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/envs.sh" trl >/dev/null
cd "$ROOT"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec "$ROOT/.venvs/trl/bin/kl-adapters" demo "$@"
