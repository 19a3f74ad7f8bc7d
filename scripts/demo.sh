#!/usr/bin/env bash
# The main job: build the core environment, then run the exact audit (every preset's expected gradient vs the exact
# gradient of KL_seq, by enumerating every sequence of a tiny tabular policy). Extra arguments go to `kl-adapters audit`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/envs.sh" core >/dev/null
exec "$ROOT/.venvs/core/bin/kl-adapters" audit "$@"
