#!/usr/bin/env bash
# Build one isolated virtual environment per target: core | trl | verl | openrlhf  ->  .venvs/<name>
# Usage: scripts/envs.sh <name>...     (idempotent; re-installs kl-adapters itself every time)
#
# torch is installed FIRST as `torch==2.13.0` (a CPU build on the machines this project is developed and tested on);
# envs/<name>.txt pins every other package (a `pip freeze` of a green run), so no install can pull CUDA torch.
# Elsewhere, pre-install a CPU torch (https://download.pytorch.org/whl/cpu) or set TORCH_SPEC to a wheel file/URL.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

build() {
  local name=$1 venv="$ROOT/.venvs/$1" pins="$ROOT/envs/$1.txt"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  local con=(); [ -f "$pins" ] && con=(-c "$pins")
  "${pip[@]}" "$TORCH_SPEC"
  case "$name" in
    core) "${pip[@]}" "${con[@]}" pytest hypothesis numpy matplotlib ;;
    trl) "${pip[@]}" "${con[@]}" "trl==1.16.0" peft pytest hypothesis numpy matplotlib ;;
    verl) "${pip[@]}" "${con[@]}" "verl==0.9.1" pytest numpy uvicorn fastapi cachetools transferqueue matplotlib ;;
    openrlhf)
      # openrlhf hard-depends on flash-attn + vllm (CUDA only): install it without deps, then what its KL path imports.
      # flash_attn / vllm are replaced by test-only import stubs (tests/openrlhf/cpu_stubs).
      "${pip[@]}" --no-deps "openrlhf==0.11.2"
      "${pip[@]}" "${con[@]}" "transformers==5.15.0" "ray[default]==2.55.0" peft torchdata einops pillow pylatexenc \
        sympy aiohttp packaging tqdm numpy datasets pytest matplotlib
      "${pip[@]}" "${con[@]}" "deepspeed==0.19.6" ;;
    *) echo "unknown environment: $name (core|trl|verl|openrlhf)" >&2; exit 2 ;;
  esac
  # kl-adapters itself, non-editable: tests exercise the installed package (its .pth hook and entry points).
  "${pip[@]}" --no-deps --force-reinstall "$ROOT"
  "$venv/bin/python" -c "import torch, sys; assert not torch.version.cuda, 'CUDA torch in $name'; print('$name', sys.version.split()[0], 'torch', torch.__version__)"
}

[ $# -gt 0 ] || set -- core
for n in "$@"; do build "$n"; done
