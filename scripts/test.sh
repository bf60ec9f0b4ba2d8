#!/usr/bin/env bash
# Set up the venv and run every check CI runs: generated code up to date, lint, types, tests.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
if [ -f scripts/gen_protos.py ]; then
  "$py" scripts/gen_protos.py --check
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy node protocol
exec .venv/bin/pytest -q -p no:cacheprovider "$@"
