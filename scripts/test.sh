#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
$PY -m ruff check .
# Two workers: most of a test's time is one busy core (engine start-up, Python); each
# test file stays on one worker, so its module fixtures are built once.
exec $PY -m pytest tests -q -p no:cacheprovider --durations=25 \
  -n "${VLLM_CARRYOVER_TEST_WORKERS:-2}" --dist loadfile "$@"
