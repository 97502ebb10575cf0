#!/usr/bin/env bash
# The README's test command: set up ./.venv, lint, run the whole test suite (CPU only, no GPU needed).
#   bash scripts/test.sh           everything (what CI runs)
#   bash scripts/test.sh --quick   the quick tier: no test that starts Ray, a server or a training run in
#                                  other processes (`-m "not slow"`; tests/conftest.py marks them)
# Any other argument goes to pytest (a file, -k EXPR, -x, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then tier=(-m "not slow"); else args+=("$arg"); fi
done
bash scripts/setup.sh
.venv/bin/ruff check app scheduling workers tests
exec .venv/bin/python -m pytest -q --durations=15 "${tier[@]}" "${args[@]}"
