#!/usr/bin/env bash
# Set up the venv and run every check CI runs: generated code up to date, lint, types, tests.
#   bash scripts/test.sh [pytest args...]      (e.g. -n 0: serially; tests/node: one folder)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
# The tests' processes cache what they compile (.pyc, pytest's rewritten test modules): otherwise each of
# the 6 workers and every node they start compiles the same test and library modules again.
unset PYTHONDONTWRITEBYTECODE
if [ -f scripts/gen_protos.py ]; then
  "$py" scripts/gen_protos.py --check
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy runs beside the tests: they keep the 2 cores ~92% busy, so its ~25 CPU-seconds (cold cache) fill
# their gaps instead of ~40 s of wall time before them. Its failure fails the run as before.
mypy_log=$(mktemp)
.venv/bin/mypy node protocol >"$mypy_log" 2>&1 &
mypy_pid=$!
# Tests run on parallel pytest-xdist workers: many wait on sockets, timers and child processes, so
# more workers than cores pay (on 2 cores: 6 workers keep them ~92% busy, 4 left a quarter idle);
# tests/conftest.py orders the longest first and gives each worker one intra-op thread.
# DTNODE_TEST_WORKERS=0 runs them serially in this process; a later -n in the arguments wins.
tests_rc=0
.venv/bin/pytest -q -p no:cacheprovider -n "${DTNODE_TEST_WORKERS:-6}" --dist loadgroup "$@" || tests_rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$mypy_log" && rm -f "$mypy_log"
[ "$mypy_rc" -eq 0 ] || { echo "mypy failed (exit $mypy_rc)" >&2; exit "$mypy_rc"; }
exit "$tests_rc"
