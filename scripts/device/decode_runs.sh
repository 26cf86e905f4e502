#!/usr/bin/env bash
# Issue 7 (GPU idle with and without overlap) and issue 9 (llama-8b TP=2 against TP=1), decode-64,
# on the GPU machine from the repository root; logs and JSON go to $OUT. Needs 2 GPUs for TP=2.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on the lent machines
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
date -u +%FT%TZ | tee -a "$OUT/gpus.txt"

echo "== GPU tests"
timeout 150 python3 -m pytest -q -m gpu -x tests/test_gpu_overlap.py tests/test_cuda_graph.py \
  > "$OUT/gpu-tests.log" 2>&1
tail -2 "$OUT/gpu-tests.log"

echo "== decode-64 with the step profile (overlap and not)"
timeout 240 python3 scripts/bench_decode.py --models smollm2-135m,llama-1b --no-hf \
  --json "$OUT/decode64.json" > "$OUT/decode64.log" 2>&1
grep -v "Capturing\|it/s\]" "$OUT/decode64.log" | tail -24

for tp in 1 2; do
  echo "== llama-8b decode-64, tensor-parallel-size $tp"
  timeout 150 python3 scripts/bench_decode.py --models llama-8b --no-hf --no-profile \
    --tensor-parallel-size $tp --json "$OUT/llama8b-tp$tp.json" > "$OUT/llama8b-tp$tp.log" 2>&1
  tail -4 "$OUT/llama8b-tp$tp.log"
done
