#!/usr/bin/env bash
# The project's test command: build each framework's environment, then run its suite in it.
# Usage: scripts/test.sh [core] [trl] [verl] [openrlhf] [<framework>==<version>]... [device-image]
#   (default: the four suites, the compat suites of the oldest supported releases, then device-image)
# A <framework>==<version> suite builds .venvs/<framework>-<version> (scripts/envs.sh) and runs the tests of
# tests/<framework> marked `compat` (gradient identity, flag off bit-identical) against that release.
# device-image is the GPU suite's proof without a GPU (tests/device_image/prove.sh: the wheelhouses, installed with
# --no-index into a stand-in of the device image, every GPU test collected and skipped); it runs after openrlhf.
# Each suite runs in its own virtual environment (.venvs/<name>) because the frameworks' pins conflict
# (verl needs transformers<5.11, OpenRLHF pins 5.15.0). Every suite runs even if an earlier one fails; the exit code
# is non-zero if any failed. Extra pytest arguments: PYTEST_ARGS="-x -k foo" scripts/test.sh core
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
[ $# -gt 0 ] || set -- core trl verl openrlhf trl==1.14.0 verl==0.9.0 openrlhf==0.10.4 device-image
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset KL_ADAPTERS
failed=()
for suite in "$@"; do
  start=$(date +%s)
  if [ "$suite" = device-image ]; then
    tests/device_image/prove.sh || failed+=("$suite"); echo "=== [$suite] $(( $(date +%s) - start )) s"; continue
  fi
  echo "=== [$suite] building .venvs/$suite"
  if ! scripts/envs.sh "$suite"; then failed+=("$suite(env)"); continue; fi
  name=${suite%%==*} venv=".venvs/$suite" select=()
  if [ "$name" != "$suite" ]; then venv=".venvs/$name-${suite#*==}" select=(-m compat); fi
  echo "=== [$suite] running tests/$name ${select[*]}"
  # `bin/pytest` (not `python -m pytest`) keeps the checkout off sys.path: tests import the *installed* kl_adapters.
  # shellcheck disable=SC2086
  if ! "$venv/bin/pytest" "tests/$name" "${select[@]}" -p no:cacheprovider ${PYTEST_ARGS:-}; then failed+=("$suite"); fi
  echo "=== [$suite] $(( $(date +%s) - start )) s"
done
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED suites: ${failed[*]}"; exit 1; fi
echo "all suites passed: $*"
