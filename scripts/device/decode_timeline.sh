#!/usr/bin/env bash
# Steady decode steps kernel by kernel as they run in the replayed graph (the PyTorch profiler),
# for each POINTS entry MODEL:BATCH (default smollm2-135m:64 llama-1b:64 llama-1b:256
# llama-8b:256): scripts/device/decode_timeline.py run, then its report. On the GPU machine from
# the repository root; traces and reports under $OUT.
set -u
OUT=${OUT:-/tmp/out}
POINTS=${POINTS:-smollm2-135m:64 llama-1b:64 llama-1b:256 llama-8b:256}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%FT%TZ
for point in $POINTS; do
  model=${point%%:*}; batch=${point#*:}; name=tl-$model-$batch
  if ! timeout 300 python3 scripts/device/decode_timeline.py run --model "$model" \
      --batch "$batch" --trace "$OUT/$name.json" > "$OUT/$name.log" 2>&1; then
    echo "$name: failed"; tail -5 "$OUT/$name.log"; continue
  fi
  echo "== $model batch $batch"
  python3 scripts/device/decode_timeline.py report "$OUT/$name.json" | tee "$OUT/$name.txt"
done
