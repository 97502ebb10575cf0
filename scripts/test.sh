#!/usr/bin/env bash
# The README's test command: set up ./.venv, lint, run the whole test suite (CPU only, no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check app scheduling workers tests
exec .venv/bin/python -m pytest -q --durations=15 "$@"
