#!/usr/bin/env bash
# Reproduce the shipped SmolLM2 drafters (train/checkpoints/smollm2-135m-instruct/):
#   1. data: 4 categories x (60 train + 12 held-out) prompts, SmolLM2's greedy answers
#      (vLLM, Ray), its hidden states at the drafter's context layers (cached);
#   2. stage 1: a plain DFlash drafter from scratch (2 threads, 8 min of training);
#   3. stage 2, from stage 1, side by side with equal compute (1 thread, 8 min each):
#      (a) more plain DFlash training -> dflash-baseline/
#      (b) carryover draft-verify-draft training -> carryover/
#   4. export both and measure tau per category through vLLM.
# About an hour on a 2-core CPU (data ~30 min). Logs under $LOGS (default /tmp/train-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${LOGS:-/tmp/train-smollm2}
OUT=train/checkpoints/smollm2-135m-instruct
mkdir -p "$LOGS"

$PY -m train data --num-train 60 --num-eval 12 --max-tokens 96 2>&1 | tee "$LOGS/data.log"
$PY -m train baseline --run mix-baseline-s1 --steps 100000 --minutes 8 --lr 1.5e-3 \
  --warmup 50 --eval-every 400 --save-every 200 2>&1 | tee "$LOGS/s1.log"
$PY -m train baseline --run mix-baseline --init-run mix-baseline-s1 --steps 100000 \
  --minutes 8 --lr 5e-4 --warmup 10 --threads 1 --eval-every 0 --save-every 100 \
  > "$LOGS/s2-baseline.log" 2>&1 &
BASELINE=$!
$PY -m train carryover --run mix-carryover --init mix-baseline-s1 --steps 100000 \
  --minutes 8 --lr 5e-4 --warmup 10 --threads 1 --eval-every 0 --save-every 20 \
  > "$LOGS/s2-carryover.log" 2>&1 &
CARRYOVER=$!
wait "$BASELINE"
wait "$CARRYOVER"
$PY -m train export --run mix-baseline --out "$OUT/dflash-baseline"
$PY -m train export --run mix-carryover --out "$OUT/carryover"
$PY -m train eval --num-prompts 12 --max-tokens 64 --out "$LOGS/eval.json" 2>&1 | tee "$LOGS/eval.log"
