#!/usr/bin/env bash
# Run a framework's kl-adapters suite against any release of it, with the version guard overridden. Not part of CI.
# Usage:
#   scripts/compat.sh <framework>==<version>...   e.g. scripts/compat.sh trl==1.15.0 verl==0.9.0
#   scripts/compat.sh --latest                    the newest release of trl, verl and openrlhf on the package index
# For each release: builds .venvs/<framework>-<version> (scripts/envs.sh), runs tests/<framework> (without the GPU
# tests) with KL_ADAPTERS_ALLOW_UNTESTED=1, then tests/<framework>/upstream_selftests.py when that file exists (the
# framework's own unit tests with kl-adapters off / flag off / flag on: same outcomes required), and prints a table.
# `--latest` is the early warning for a new release: the result depends on what the index serves that day, which is
# why CI does not run it. A release whose row passes can go into kl_adapters/adapters/versions.py (docs/versions.md,
# "Framework versions"). Exit status 1 if any suite or self-test run failed. Extra pytest arguments: PYTEST_ARGS="-x".
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
FRAMEWORKS=(trl verl openrlhf)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KL_ADAPTERS_ALLOW_UNTESTED=1
unset KL_ADAPTERS

newest() {  # the newest release of a distribution on the configured package index
  python3 -m pip index versions "$1" --disable-pip-version-check 2>/dev/null | sed -n "s/^$1 (\(.*\))$/\1/p"
}

if [ "${1:-}" = "--latest" ]; then
  set --
  for fw in "${FRAMEWORKS[@]}"; do
    version=$(newest "$fw")
    [ -n "$version" ] || { echo "could not find the newest release of $fw on the index" >&2; exit 2; }
    set -- "$@" "$fw==$version"
  done
fi
[ $# -gt 0 ] || { sed -n '2,12p' "$0"; exit 2; }

rows=() failed=0
for target in "$@"; do
  fw=${target%%==*} version=${target#*==}
  if [ "$fw" = "$target" ] || [ ! -d "tests/$fw" ]; then echo "not <framework>==<version>: $target" >&2; exit 2; fi
  # absolute: the self-test scripts run the interpreter from inside an unpacked sdist (their cwd)
  venv="$ROOT/.venvs/$fw-$version" log="$ROOT/.venvs/$fw-$version.compat.log" start=$(date +%s)
  echo "=== [$target] building .venvs/$fw-$version"
  if ! scripts/envs.sh "$target"; then rows+=("$fw|$version|environment failed|-|0"); failed=1; continue; fi
  echo "=== [$target] tests/$fw (guard overridden), log: $log"
  # `bin/pytest` keeps the checkout off sys.path: the tests import the installed kl_adapters (see scripts/test.sh)
  # shellcheck disable=SC2086
  "$venv/bin/pytest" "tests/$fw" -m "not gpu" -p no:cacheprovider -q ${PYTEST_ARGS:-} >"$log" 2>&1
  status=$?
  suite=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$log" | tail -1 | tr -d '=' | xargs)
  [ $status -eq 0 ] && suite="PASS: $suite" || { suite="FAIL: ${suite:-see $log}"; failed=1; }
  selftests="-"
  if [ -f "tests/$fw/upstream_selftests.py" ]; then
    echo "=== [$target] tests/$fw/upstream_selftests.py"
    # its last line is the verdict: PASS, FAIL or NONE (the release ships no test that runs offline on CPU)
    out=$("$venv/bin/python" "tests/$fw/upstream_selftests.py" --python "$venv/bin/python" 2>&1)
    code=$? selftests=$(echo "$out" | tail -1)
    [ $code -eq 0 ] || { selftests="FAIL (exit $code): $selftests"; failed=1; }
    echo "$out" | tail -20
  fi
  rows+=("$fw|$version|$suite|$selftests|$(( $(date +%s) - start ))")
done

printf '\n| framework | release | tests/<framework>, guard overridden | upstream self-tests | seconds |\n'
printf '|---|---|---|---|---|\n'
for row in "${rows[@]}"; do IFS='|' read -r a b c d e <<<"$row"; printf '| %s | %s | %s | %s | %s |\n' "$a" "$b" "$c" "$d" "$e"; done
exit $failed
