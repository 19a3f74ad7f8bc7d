#!/usr/bin/env bash
# For maintainers: check each upstream patch against the release it targets.
# For each project: download the pinned release from the package index with pip (sha256 checked), apply
# patches/<project>-<version>.patch (it must apply cleanly: `git apply --check`, and GNU patch with no fuzz and no
# offset), then run the patch's unit tests (and the released tests of the functions it touches) on the patched tree,
# in .venvs/<project> (built by scripts/envs.sh if missing). Needs network access to the package index, git and patch.
# Usage: patches/check.sh [trl] [verl] [openrlhf]      (default: all three). Exit status 1 if any project fails.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || set -- trl verl openrlhf
failed=()
for project in "$@"; do
  python="$ROOT/.venvs/$project/bin/python"
  if [ ! -x "$python" ] && ! "$ROOT/scripts/envs.sh" "$project"; then
    echo "FAIL $project: could not build .venvs/$project"; failed+=("$project"); continue
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/kl-adapters-check-$project.XXXXXX")
  if "$python" "$ROOT/patches/release.py" check "$project" "$work" >"$work/check.log" 2>&1; then
    echo "PASS $project: patch applies cleanly to the release; $(grep -E '[0-9]+ passed' "$work/check.log" | tail -1)"
    rm -rf "$work"
  else
    tail -40 "$work/check.log"
    echo "FAIL $project (full log: $work/check.log)"
    failed+=("$project")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all patches pass: $*"
