#!/usr/bin/env bash
# A decode layer's kernels, each alone under Nsight Compute (issue 17): scripts/bench_decode.py in
# process on random weights, ncu skipping SKIP kernel launches (warm-up, capture, prefill and
# early decode) and then profiling COUNT, one table row each (scripts/device/ncu_summary.py).
#
#   MODEL=smollm2-135m BATCH=64 bash scripts/device/ncu_layer.sh
#
# MODEL (smollm2-135m), BATCH (64), PROMPT (128), SKIP (38000: about step 125 of smollm2's
# decode-64, step 30 of llama-8b's decode-256), COUNT (11), KERNELS (an ncu -k filter, e.g.
# 'regex:^(_decode|_skinny)'; default every kernel), CLOCKS (none: the clocks the kernel gets;
# base: ncu's locked base clocks). ncu runs each kernel alone and flushes L2 before it, so the
# times bound what a kernel costs inside a CUDA graph, where PDL overlaps its start with the
# kernel before. The bench's own figures are then ncu's slowdown, not the engine's.
# On the GPU machine from the repository root; the report, its text and the table under $OUT.
set -u
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-smollm2-135m}; BATCH=${BATCH:-64}; PROMPT=${PROMPT:-128}
SKIP=${SKIP:-38000}; COUNT=${COUNT:-11}; CLOCKS=${CLOCKS:-none}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
mkdir -p "$OUT"
name="ncu-$MODEL-b$BATCH"
filter=()
[ -n "${KERNELS:-}" ] && filter=(-k "$KERNELS")
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%FT%TZ
cmd=("$NCU" --target-processes all --clock-control "$CLOCKS" "${filter[@]}"
     --launch-skip "$SKIP" --launch-count "$COUNT"
     --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --section SchedulerStats -f -o "$OUT/$name"
     python3 scripts/bench_decode.py --paths inproc --no-hf --no-profile --models "$MODEL"
     --num-requests "$BATCH" --prompt-len "$PROMPT")
echo "command: ${cmd[*]}"
"${cmd[@]}" > "$OUT/$name-run.log" 2>&1 || { echo "ncu: exit $?"; tail -20 "$OUT/$name-run.log"; exit 1; }
"$NCU" --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name-details.txt"
python3 scripts/device/ncu_summary.py "$OUT/$name-details.txt"
