#!/usr/bin/env bash
# The README's benchmark results: all three benchmarks at full size, into benchmarks/results/.
# About 45 minutes on the 2-core development CPU; add --quick to each for a smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m benchmarks acceptance --out benchmarks/results/acceptance
$PY -m benchmarks serving --out benchmarks/results/serving
$PY -m benchmarks draft-step --out benchmarks/results/draft-step
