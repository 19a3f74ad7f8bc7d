#!/usr/bin/env bash
# The GPU integration suite in one device call per framework (issue 13).
#
#   scripts/gpu.sh prepare [trl|verl|openrlhf]...   here, with network: .gpu-wheels/<fw>/ (git-ignored), one
#                                                   wheelhouse per framework (default: all three), each <= 60 MiB, and
#                                                   its COMMIT (git describe --always --dirty of the wheel's source)
#   scripts/gpu.sh run <trl|verl|openrlhf> [outdir] on the GPU machine: install .gpu-wheels/<fw> with --no-index on top
#                                                   of the image's torch, run `pytest -m gpu` on tests/<fw>'s files
#                                                   that hold `gpu` tests and
#                                                   bench/gpu_bench.py (GPU_BENCH=0: not); logs + JSON to
#                                                   outdir (default $OUT); PYTEST_ADDOPTS (pytest's own) selects tests
#   scripts/gpu.sh all <outdir> <fw>:<seconds>...   on the GPU machine, one call for several frameworks: `run` for each
#                                                   in turn under its time limit, everything they write in one
#                                                   outdir/gpu.tgz, rewritten after each (the device returns at most 8
#                                                   files) with summary.txt (each framework's exit status and seconds)
#                                                   and <fw>-run.log. The whole suite is two calls of at most 8 minutes
#                                                   (CALLS; `all <outdir>` alone prints them)
#
# Every file a run writes records the kl-adapters commit it tested (KL_ADAPTERS_COMMIT, default the wheelhouse's
# COMMIT): the logs' and summary.txt's first lines, the environment report, the JUnit suite name, the benchmark JSON.
#
# A wheelhouse holds exactly the pins of envs/gpu-<fw>.txt (each one a pin of the CPU suite, envs/<fw>.txt; the
# device image has the rest: envs/device-image.txt), built for CPython 3.12 manylinux x86_64, plus a wheel of
# kl-adapters itself. deepspeed and antlr4-python3-runtime have no wheel on the index: they are built here from their
# sdists (deepspeed with its ops left to JIT, DS_BUILD_OPS=0). prepare needs only Python >= 3.10 with pip and a package
# index (no environment of this checkout). Ray is not carried (a 74 MB wheel): tests/device_image/ray_stub stands in
# for its import.
# tests/device_image/prove.sh checks the wheelhouses without a GPU.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
FRAMEWORKS=(trl verl openrlhf)
MAX_MIB=60
SDIST_ONLY=(deepspeed antlr4-python3-runtime)  # no wheel on the index: built here (pure Python)
PY=${PYTHON:-python3}
# the whole suite in two device calls, each within 8 minutes (480 s) of limits, from the H200 logs (docs/gpu.md, "Run"):
# openrlhf's tests and benchmark took 138 s, verl's three tests and benchmark together about 300 s at most, trl's 14
# tests then 154 s and its benchmark about 110 s (its 2 measure GPU tests, added since, never ran on a GPU: room left).
# verl's Megatron test (test_megatron_actor_update_on_gpu, added since, never ran on a GPU): one process, imports and
# two tiny engine checks, estimated 20-30 s from its CPU run; taken from openrlhf's margin
CALLS=("openrlhf:160 verl:320" "trl:420")
CALL_SECONDS=480

usage() { sed -n '3,17p' "$0" >&2; exit 2; }
known() { [[ " ${FRAMEWORKS[*]} " == *" $1 "* ]] || { echo "unknown framework: $1 (trl|verl|openrlhf)" >&2; exit 2; }; }
pins() { grep -v '^#' "$ROOT/envs/gpu-$1.txt" | grep -v '^[[:space:]]*$'; }

# pip's platform tags for the device's CPython 3.12 on x86_64 (pip matches each manylinux tag exactly)
PLATFORMS=()
for tag in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
  manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux_2_39; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

prepare() {
  local fw=$1 dir="$WHEELS/$1" sdists=() binaries=() spec
  known "$fw"
  mkdir -p "$dir"
  while read -r spec; do
    if [[ " ${SDIST_ONLY[*]} " == *" ${spec%%==*} "* ]]; then sdists+=("$spec"); else binaries+=("$spec"); fi
  done < <(pins "$fw")
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$dir" "${binaries[@]}"
  for spec in ${sdists[@]+"${sdists[@]}"}; do  # deepspeed's wheel leaves its ops to DeepSpeed's JIT (first use)
    local built="$dir/.build-${spec%%==*}" stem=${spec%%==*}
    ls "$dir/${stem//-/_}-${spec#*==}-"*.whl >/dev/null 2>&1 && continue
    rm -rf "$built" && mkdir -p "$built"
    # pip's isolated build environment, without torch: deepspeed's setup.py then records no torch build and leaves
    # every op to the JIT, exactly as `pip install deepspeed` built it for the CPU suite (scripts/envs.sh); nothing
    # of this checkout's environments is needed
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary :all: -w "$built" "$spec"
    mv "$built"/*.whl "$dir/" && rm -rf "$built"
  done
  rm -f "$dir"/kl_adapters-*.whl
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dir" "$ROOT"
  git -C "$ROOT" describe --always --dirty > "$dir/COMMIT" 2>/dev/null || echo unknown > "$dir/COMMIT"
  local mib
  mib=$(du -sm "$dir" | cut -f1)
  echo "$fw: $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
  [ "$mib" -le "$MAX_MIB" ] || { echo "$fw wheelhouse is $mib MiB > $MAX_MIB MiB" >&2; exit 1; }
}

# the kl-adapters commit a run of <fw> tests: KL_ADAPTERS_COMMIT, else the wheelhouse's COMMIT, else this checkout's
commit_of() {
  [ -z "${KL_ADAPTERS_COMMIT:-}" ] || { echo "$KL_ADAPTERS_COMMIT"; return; }
  cat "$WHEELS/$1/COMMIT" 2>/dev/null || git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown
}

run() {
  local fw=$1 out=${2:-${OUT:-}} site commit
  known "$fw"
  [ -n "$out" ] || { echo "run: give an output folder (or set OUT)" >&2; exit 2; }
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  site=${GPU_SITE:-/tmp/kl-adapters-gpu/$fw}
  rm -rf "$site"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$WHEELS/$fw"/*.whl
  local path="$site"
  # verl and OpenRLHF import ray at module level; their GPU paths never start it (the Ray activation is proven on CPU)
  [ "$fw" = trl ] || path="$path:$ROOT/tests/device_image/ray_stub"
  # flash_attn and vllm: OpenRLHF's imports of them, stubbed as on CPU (the tests run the HF attention path)
  [ "$fw" = openrlhf ] && path="$path:$ROOT/tests/openrlhf/cpu_stubs"
  export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  unset KL_ADAPTERS
  commit=$(commit_of "$fw")
  export KL_ADAPTERS_COMMIT=$commit  # bench/gpu_bench.py records it
  echo "# kl-adapters commit $commit ($fw)"
  # DeepSpeed 0.19.6's JIT builder (FusedAdam) reads TORCH_CUDA_ARCH_LIST as numbers: the image's arch-specific
  # suffixes (sm_90a as "9.0a") stop the build ("invalid literal for int() ... '0a'", seen on an H200)
  [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] || export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST//[af]/}
  cd "$ROOT"
  local status=0
  "$PY" -P tests/device_image/environment_report.py "$fw" "$out/$fw-environment.json" || status=1
  [ ! -f "$out/$fw-environment.json" ] || "$PY" -c 'import json, sys
path, commit = sys.argv[1:]
report = json.load(open(path))
json.dump({"kl_adapters_commit": commit, **report}, open(path, "w"), indent=1)' "$out/$fw-environment.json" "$commit"
  # the suite's files that hold `gpu` tests (other test modules may import what is not carried); -P: the checkout
  # stays off sys.path, so the tests import the installed kl-adapters wheel (as bin/pytest does)
  local files
  mapfile -t files < <(grep -l "mark\.gpu" "tests/$fw"/test_*.py)
  { echo "# kl-adapters commit $commit"
    "$PY" -P -m pytest "${files[@]}" -m gpu -p no:cacheprovider -rA --junitxml="$out/$fw-junit.xml" \
      -o junit_suite_name="kl-adapters $commit" 2>&1; } | tee "$out/$fw-pytest.log" || status=1
  [ "${GPU_BENCH:-1}" = 0 ] && return $status  # GPU_BENCH=0: the tests only (a rerun whose benchmark is recorded)
  { echo "# kl-adapters commit $commit"
    "$PY" -P bench/gpu_bench.py --framework "$fw" --out "$out" 2>&1; } | tee "$out/$fw-bench.log" || status=1
  return $status
}

run_all() {
  local out=$1 work spec fw limit start rc total=0 status=0
  shift
  if [ $# -eq 0 ]; then
    echo "all: name the frameworks and limits; the whole suite is two device calls of at most $CALL_SECONDS s:" >&2
    printf '  scripts/gpu.sh all <outdir> %s\n' "${CALLS[@]}" >&2
    exit 2
  fi
  for spec in "$@"; do  # every argument checked before the first run
    known "${spec%%:*}"
    [[ "${spec#*:}" =~ ^[1-9][0-9]*$ ]] || { echo "all: '$spec' is not <framework>:<seconds>" >&2; exit 2; }
    total=$(( total + ${spec#*:} ))
  done
  [ "$total" -le "$CALL_SECONDS" ] || echo "all: the limits add up to $total s, more than one device call's" \
    "$CALL_SECONDS s" >&2
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  work=$(mktemp -d -t kl-adapters-gpu-XXXX)
  for spec in "$@"; do
    fw=${spec%%:*} limit=${spec#*:} start=$(date +%s)
    echo "# kl-adapters commit $(commit_of "$fw") ($fw, $(date -u +%Y-%m-%dT%H:%MZ))" >> "$work/summary.txt"
    timeout "$limit" "$ROOT/scripts/gpu.sh" run "$fw" "$work/$fw" > "$work/$fw-run.log" 2>&1 && rc=0 || rc=$?
    echo "$fw rc=$rc seconds=$(( $(date +%s) - start ))$([ "$rc" = 124 ] && echo " (time limit)")" \
      | tee -a "$work/summary.txt"
    [ "$rc" = 0 ] || status=1
    tar czf "$out/gpu.tgz" -C "$work" .
  done
  rm -rf "$work"
  return $status
}

[ $# -gt 0 ] || usage
case "$1" in
  prepare) shift; [ $# -gt 0 ] || set -- "${FRAMEWORKS[@]}"; for fw in "$@"; do prepare "$fw"; done ;;
  run) [ $# -ge 2 ] && [ $# -le 3 ] || usage; run "$2" "${3:-}" ;;
  all) [ $# -ge 2 ] || usage; shift; run_all "$@" ;;
  *) usage ;;
esac
