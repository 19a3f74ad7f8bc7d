#!/usr/bin/env bash
# Build one isolated virtual environment per target  ->  .venvs/<name>
# Usage: scripts/envs.sh <target>...     (idempotent; re-installs kl-adapters itself every time)
#   <target> = core | trl | verl | openrlhf              the pinned environment of that suite (envs/<name>.txt)
#            | <framework>==<version>                    another release of a framework -> .venvs/<framework>-<version>,
#                                                        pins from envs/<framework>-<version>.txt if it exists, else
#                                                        envs/<framework>.txt without the framework's own pin
#
# A release's environment starts as a copy of the framework's built environment (.venvs/<framework>, built first if
# absent): `overlay`, hard links, so seconds and no disk. The same install steps then run in it, and pip changes only
# what differs: the release itself and the few pins where its pins file differs (envs/*.txt: at most four lines for
# the releases CI runs). The result is the environment a build from nothing gives (the same `pip freeze`, checked when
# this was introduced), in a fraction of the time.
#
# torch is installed FIRST as `torch==2.13.0` (TORCH_SPEC to change it: a version, a wheel file or URL). pip picks the
# build for the machine: a CPU build where no CUDA wheel applies (the machines this project is developed and tested
# on), a CUDA build on a user's CUDA machine. Either is accepted; the build is printed at the end. envs/<name>.txt pins
# every other package (a `pip freeze` of a green run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

# the pip distribution name of each framework target
declare -A DIST=([trl]=trl [verl]=verl [openrlhf]=openrlhf)

overlay() {  # a copy of the built venv $1 at $2: its files hard links (pip and Python replace files, never write into
             # them, so neither venv changes the other's), its scripts and pyvenv.cfg naming the copy
  cp -al "$1" "$2" 2>/dev/null || { rm -rf "$2"; cp -a "$1" "$2"; }
  { grep -rlI --null -F "$1" "$2/bin" "$2/pyvenv.cfg" || true; } | xargs -0 -r sed -i "s|${1//./\\.}|$2|g"
}

build() {
  local target=$1 name version="" venv pins
  name=${target%%==*}
  [ "$name" != "$target" ] && version=${target#*==}
  if [ -n "$version" ]; then
    [ -n "${DIST[$name]:-}" ] || { echo "unknown framework: $name (trl|verl|openrlhf)" >&2; exit 2; }
    venv="$ROOT/.venvs/$name-$version"
    pins="$ROOT/envs/$name-$version.txt"
    if [ ! -f "$pins" ]; then  # the newest release's pins, minus the framework's own
      mkdir -p "$venv"
      grep -iv "^${DIST[$name]}==" "$ROOT/envs/$name.txt" > "$venv.pins.txt"
      pins="$venv.pins.txt"
    fi
  else
    venv="$ROOT/.venvs/$name"
    pins="$ROOT/envs/$name.txt"
  fi
  if [ -n "$version" ] && [ ! -x "$venv/bin/python" ]; then
    [ -x "$ROOT/.venvs/$name/bin/python" ] || build "$name"
    rm -rf "$venv" && overlay "$ROOT/.venvs/$name" "$venv"
  fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  local con=(); [ -f "$pins" ] && con=(-c "$pins")
  "${pip[@]}" "$TORCH_SPEC"
  # a release's own pins file is a full freeze of a green run: install it as is (it may add what that release needs
  # but does not declare, e.g. requests for trl 1.14.0), then the framework's requirements below, constrained by it
  [ -n "$version" ] && [ -f "$ROOT/envs/$name-$version.txt" ] && "${pip[@]}" --no-deps -r "$pins"
  local fw=""
  [ -n "$version" ] && fw="${DIST[$name]:-}==$version"
  case "$name" in
    core) "${pip[@]}" "${con[@]}" pytest hypothesis numpy matplotlib transformers ;;
    trl) "${pip[@]}" "${con[@]}" "${fw:-trl==1.16.0}" peft pytest hypothesis numpy matplotlib ;;
    # megatron-core: verl's Megatron engine imports only with it (tests/verl/test_megatron.py; ~5 s, one 2.6 MB wheel)
    verl) "${pip[@]}" "${con[@]}" "${fw:-verl==0.9.1}" pytest numpy uvicorn fastapi cachetools transferqueue \
            matplotlib megatron-core ;;
    openrlhf)
      # openrlhf hard-depends on flash-attn + vllm (CUDA only): install it without deps, then what its KL path imports.
      # flash_attn / vllm are replaced by test-only import stubs (tests/openrlhf/cpu_stubs).
      "${pip[@]}" --no-deps "${fw:-openrlhf==0.11.2}"
      "${pip[@]}" "${con[@]}" "transformers==5.15.0" "ray[default]==2.55.0" peft torchdata einops pillow pylatexenc \
        sympy aiohttp packaging tqdm numpy datasets pytest matplotlib
      "${pip[@]}" "${con[@]}" "deepspeed==0.19.6" ;;
    *) echo "unknown environment: $target (core|trl|verl|openrlhf|<framework>==<version>)" >&2; exit 2 ;;
  esac
  # kl-adapters itself, non-editable: tests exercise the installed package (its .pth hook and entry points).
  "${pip[@]}" --no-deps --force-reinstall "$ROOT"
  "$venv/bin/python" -c "import torch, sys; print('$target', sys.version.split()[0], 'torch', torch.__version__, \
'(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)')"
}

[ $# -gt 0 ] || set -- core
for n in "$@"; do build "$n"; done
