#!/usr/bin/env bash
# The main job: build one framework's environment (scripts/envs.sh), then run its version of the demo -- first the
# exact gradient check through the framework's real loss code, then training on a problem whose KL-regularized
# optimum is known exactly, under each KL configuration, evaluated exactly after every step.
# Usage: bash scripts/demo.sh [trl|verl|openrlhf] [demo options, e.g. --long, --out bench/results]
#   trl (default)  `kl-adapters demo`: TRL's real GRPOTrainer (--long-horizon: the long-horizon benchmark's quick
#                  variant, T = 128, a few minutes; docs/long_horizon.md)
#   verl           bench/demo_verl.py: verl's real ppo_loss (and reward path) through kl_adapters.demo.harness
#   openrlhf       bench/demo_openrlhf.py: OpenRLHF's real ActorPPOTrainer.training_step through the harness
# Writes kl-adapters-demo/demo_<framework>_quick.{txt,png,json,log} (git-ignored; --long: demo_<framework>.*).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FRAMEWORK=trl
case "${1:-}" in
  trl|verl|openrlhf) FRAMEWORK=$1; shift ;;
esac
echo "building .venvs/$FRAMEWORK (scripts/envs.sh $FRAMEWORK) ..."
"$ROOT/scripts/envs.sh" "$FRAMEWORK" >/dev/null
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
case "$FRAMEWORK" in
  trl) exec "$ROOT/.venvs/trl/bin/kl-adapters" demo "$@" ;;
  *) exec "$ROOT/.venvs/$FRAMEWORK/bin/python" "$ROOT/bench/demo_$FRAMEWORK.py" "$@" ;;
esac
