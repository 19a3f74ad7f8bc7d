#!/usr/bin/env bash
# What can be proven of the GPU suite without a GPU (issue 13, item 5), per framework (default: trl verl openrlhf):
#   1. scripts/gpu.sh prepare <fw>: the wheelhouse .gpu-wheels/<fw> (network)
#   2. checks.py wheelhouse <fw>: exactly envs/gpu-<fw>.txt (the CPU suite's pins) + kl-adapters, CPython 3.12
#      manylinux x86_64 wheels, <= 60 MiB
#   3. a stand-in of the device image: Python 3.12 with envs/device-image.txt installed from the package index, then
#      everything the image does not hold (tests/device_image/image_packages.txt) removed; cached, keyed by those files
#      (DEVICE_IMAGE_VENV to place it elsewhere)
#   4. scripts/gpu.sh all <out> <fw>:900 with that Python: the exact device command (`run` under a time limit, its
#      files in one archive, unpacked here). --no-index install of the wheelhouse,
#      the framework and kl-adapters imported (environment report), `pytest -m gpu tests/<fw>` collected and every test
#      skipped, bench/gpu_bench.py's smoke configuration; checks.py run <fw> <out> checks what it left
# Usage: tests/device_image/prove.sh [trl] [verl] [openrlhf]      (needs Python 3.12: PYTHON312 to name one)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/tests/device_image"
[ $# -gt 0 ] || set -- trl verl openrlhf

python312() {  # PYTHON312, a working python3.12, or pyenv's 3.12 (its shim fails unless 3.12 is selected)
  local p
  for p in "${PYTHON312:-}" "$(command -v python3.12 || true)" "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    [ -n "$p" ] && "$p" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null && { echo "$p"; return; }
  done
  echo "no Python 3.12 found (set PYTHON312)" >&2
  return 1
}
PY312=$(python312)
key=$(cat "$ROOT/envs/device-image.txt" "$HERE/image_packages.txt" | sha256sum | cut -c1-12)
VENV=${DEVICE_IMAGE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kl-adapters/device-image-$key}
OUT=$(mktemp -d -t device-image-XXXX)

stand_in() {  # one builder at a time: a second proof on the machine waits for the first one's stand-in, never
             # removes it under that proof
  mkdir -p "$(dirname "$VENV")"
  exec 9> "$VENV.lock"
  flock 9
  [ -x "$VENV/bin/python" ] && [ -f "$VENV/.complete" ] && { flock -u 9; return; }
  echo "=== building the device-image stand-in $VENV"
  rm -rf "$VENV" && "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/envs/device-image.txt"
  # what the resolver pulled in that the image does not hold (e.g. typer's pydantic): gone, as on the device
  local extra
  extra=$("$VENV/bin/python" - "$HERE/image_packages.txt" <<'EOF'
import importlib.metadata as m, re, sys
image = set(open(sys.argv[1]).read().split())
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
print(" ".join(sorted({d.metadata["Name"] for d in m.distributions()} - {n for n in
      (d.metadata["Name"] for d in m.distributions()) if norm(n) in image})))
EOF
)
  [ -z "$extra" ] || "$VENV/bin/python" -m pip uninstall -q -y $extra
  touch "$VENV/.complete"
  flock -u 9
}

status=0
stand_in
for fw in "$@"; do
  start=$(date +%s)
  echo "=== [$fw] wheelhouse"
  "$ROOT/scripts/gpu.sh" prepare "$fw" || { status=1; continue; }
  "$VENV/bin/python" "$HERE/checks.py" wheelhouse "$fw" || { status=1; continue; }
  echo "=== [$fw] scripts/gpu.sh all <out> $fw:900 (device-image stand-in, no GPU)"
  # `all` runs `run` under its time limit and returns everything in one archive, as in a device call
  ok=1
  PYTHON="$VENV/bin/python" GPU_SITE="$OUT/site-$fw" "$ROOT/scripts/gpu.sh" all "$OUT/$fw-all" "$fw:900" \
    > "$OUT/$fw.log" 2>&1 || ok=0
  mkdir -p "$OUT/$fw-x" && tar xzf "$OUT/$fw-all/gpu.tgz" -C "$OUT/$fw-x" || ok=0
  grep -qx "$fw rc=0 seconds=[0-9]*" "$OUT/$fw-x/summary.txt" || ok=0
  "$VENV/bin/python" "$HERE/checks.py" run "$fw" "$OUT/$fw-x/$fw" || ok=0
  [ $ok = 1 ] || { status=1; cat "$OUT/$fw.log"; tail -40 "$OUT/$fw-x/$fw-run.log"; }
  echo "=== [$fw] $(( $(date +%s) - start )) s"
done
[ $status -eq 0 ] && rm -rf "$OUT" && echo "device image proof passed: $*"
exit $status
