#!/usr/bin/env bash
# The main job on a fresh machine: set up, then serve SmolLM2 with carryover and chat with it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m vllm_carryover.tools.demo "$@"
