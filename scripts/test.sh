#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
$PY -m ruff check .
exec $PY -m pytest tests -q -p no:cacheprovider --durations=25 "$@"
