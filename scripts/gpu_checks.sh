#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run, for a machine with torch, triton,
# transformers and pytest but no vLLM and no network (a lent H100/H200):
#   1. benchmarks/kernels_gpu.py --tune in bf16: the kernels against their references,
#      timed against the reference and unfused PyTorch (the projection with its fused
#      GEMM and with gemm="cublas"), the tile sweeps, the two goals;
#   2. the seeded kernel sweeps compiled, in float32, float16 and bfloat16 (both GEMM
#      paths of the projection);
#   3. kernels_gpu.py's correctness and timings in float16 and float32 (fewer shapes);
#   4. the training tests with CUDA present (both recipes on the GPU against the CPU).
# Results go to $OUT (default /tmp/gpu-checks): kernels_gpu*.json and log.txt.
#     bash scripts/gpu_checks.sh            # from the repository root
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1

# The package as installed (kernels/, train/, benchmarks/ under vllm_carryover), without pip.
SITE=$(mktemp -d)
cp -r vllm_carryover "$SITE/"
for folder in kernels train benchmarks; do cp -r "$folder" "$SITE/vllm_carryover/$folder"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step SECONDS NAME COMMAND...: run one check with its own time limit, log it
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())"
} >>"$LOG" 2>&1

step 200 "kernels_gpu bf16 --tune" "$PY" benchmarks/kernels_gpu.py --tune \
    --batches 1,8,32,128 \
    --attention-shapes 1x512,1x8192,1x32768,8x2048,8x32768,32x512,32x2048,32x8192,128x2048 \
    --out "$OUT/kernels_gpu.json"
for kind in projection attention; do
    step 75 "sweep $kind" env VLLM_CARRYOVER_KERNELS=triton "$PY" tests/support/kernel_sweep.py \
        "$kind" --cases 24 \
        --dtypes float32,float16,bfloat16
done
for dtype in float16 float32; do
    step 45 "kernels_gpu $dtype" "$PY" benchmarks/kernels_gpu.py --dtype "$dtype" \
        --batches 1,32 --attention-shapes 1x8192,32x2048 --reps 20 \
        --out "$OUT/kernels_gpu_$dtype.json"
done
# -P: the checkout's vllm_carryover/ (no kernels/ inside) must not shadow $SITE's.
step 120 "training tests with CUDA" "$PY" -P -m pytest -q -p no:cacheprovider \
    tests/test_train_device.py tests/test_train_loop.py tests/test_train_carryover.py
grep '^=== ' "$LOG"
