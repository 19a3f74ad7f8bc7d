#!/usr/bin/env bash
# The project's test command: build each framework's environment, then run its suite in it.
# Usage: scripts/test.sh [core] [trl] [verl] [openrlhf] [<framework>==<version>]... [device-image]
#   (default: the four suites, the compat suites of the oldest supported releases, then device-image)
# A <framework>==<version> suite builds .venvs/<framework>-<version> (scripts/envs.sh: a copy of .venvs/<framework>
# with the release and its few differing pins installed over it) and runs the tests of tests/<framework> marked
# `compat` (gradient identity, flag off bit-identical) against that release.
# device-image is the GPU suite's proof without a GPU (tests/device_image/prove.sh: the wheelhouses, installed with
# --no-index into a stand-in of the device image, every GPU test collected and skipped).
# Each suite runs in its own virtual environment (.venvs/<name>) because the frameworks' pins conflict
# (verl needs transformers<5.11, OpenRLHF pins 5.15.0).
#
# Two streams on the machine's two cores: one process builds every suite's environment in order and then runs the
# device-image proof (its output in .venvs/<suite>.build.log), while the suites' tests run one after another, each as
# soon as its environment is built (pytest and pip each keep about one core busy). Each suite prints its build log,
# the build's time, how long it waited for it, its tests' time, and `=== [suite] N s`: the time it added to the run
# (the wait plus its tests). Every suite runs even if an earlier one fails; the exit code is non-zero if any failed.
# Extra pytest arguments: PYTEST_ARGS="-x -k foo" scripts/test.sh core
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
[ $# -gt 0 ] || set -- core trl verl openrlhf trl==1.14.0 verl==0.9.0 openrlhf==0.10.4 device-image
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset KL_ADAPTERS
mkdir -p .venvs
for suite in "$@"; do rm -f ".venvs/$suite.build.status"; done

build_all() {  # every suite's environment in order (the device-image proof builds its own), each one's
               # "<exit status> <seconds>" in .venvs/<suite>.build.status when done
  local suite start rc
  for suite in "$@"; do
    start=$(date +%s)
    if [ "$suite" = device-image ]; then
      tests/device_image/prove.sh > ".venvs/$suite.build.log" 2>&1; rc=$?
    else
      scripts/envs.sh "$suite" > ".venvs/$suite.build.log" 2>&1; rc=$?
    fi
    echo "$rc $(( $(date +%s) - start ))" > ".venvs/$suite.build.status"
  done
}
build_all "$@" &
builder=$!
trap 'kill $builder 2>/dev/null' EXIT

failed=()
for suite in "$@"; do
  start=$(date +%s)
  echo "=== [$suite] building .venvs/$suite"
  while [ ! -f ".venvs/$suite.build.status" ]; do sleep 1; done
  read -r rc seconds < ".venvs/$suite.build.status"
  cat ".venvs/$suite.build.log"
  echo "=== [$suite] built in $seconds s (waited $(( $(date +%s) - start )) s)"
  if [ "$suite" = device-image ]; then  # the proof ran whole in the build stream
    [ "$rc" = 0 ] || failed+=("$suite"); echo "=== [$suite] $(( $(date +%s) - start )) s"; continue
  fi
  if [ "$rc" != 0 ]; then failed+=("$suite(env)"); echo "=== [$suite] $(( $(date +%s) - start )) s"; continue; fi
  name=${suite%%==*} venv=".venvs/$suite" select=()
  if [ "$name" != "$suite" ]; then venv=".venvs/$name-${suite#*==}" select=(-m compat); fi
  echo "=== [$suite] running tests/$name ${select[*]}"
  tests_start=$(date +%s)
  # `bin/pytest` (not `python -m pytest`) keeps the checkout off sys.path: tests import the *installed* kl_adapters.
  # shellcheck disable=SC2086
  if ! "$venv/bin/pytest" "tests/$name" "${select[@]}" -p no:cacheprovider ${PYTEST_ARGS:-}; then failed+=("$suite"); fi
  echo "=== [$suite] tests: $(( $(date +%s) - tests_start )) s"
  echo "=== [$suite] $(( $(date +%s) - start )) s"
done
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED suites: ${failed[*]}"; exit 1; fi
echo "all suites passed: $*"
