#!/usr/bin/env bash
# The README's test command: set up ./.venv, lint, run the whole test suite (CPU only, no GPU needed).
#   bash scripts/test.sh           everything (what CI runs): the slow tier, with the quick tier beside it
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
if [ ${#tier[@]} -gt 0 ] || [ ${#args[@]} -gt 0 ] || [ "${SKRULL_TEST_SERIAL:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest -q --durations=15 "${tier[@]}" "${args[@]}"
fi
# Everything: the quick tier runs beside the slow one, in a process of its own. The slow tier's Ray runs
# leave ~15-20% of 2 cores idle (waiting on processes, timeouts, restarts; vmstat over a whole run,
# 2026-11-26), which the quick tier's single process (~80 CPU-s) fills; one after the other they took
# ~95 s more. Its report prints as soon as it is done; SKRULL_TEST_SERIAL=1 runs the two in one process.
quick_log=$(mktemp)
(
  rc=0
  .venv/bin/python -m pytest -q -m "not slow" > "$quick_log" 2>&1 || rc=$?
  echo "== quick tier (-m 'not slow'; ran beside the slow tier) =="
  cat "$quick_log"
  exit $rc
) &
quick=$!
slow_rc=0
.venv/bin/python -m pytest -q --durations=15 -m slow || slow_rc=$?
quick_rc=0
wait $quick || quick_rc=$?
rm -f "$quick_log"
echo "test.sh: quick tier exit $quick_rc, slow tier exit $slow_rc"
[ $quick_rc -eq 0 ] && [ $slow_rc -eq 0 ]
