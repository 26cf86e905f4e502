#!/usr/bin/env bash
# Host time per decode step (issue 17): scripts/bench_decode.py's step profile (the engine's step
# stats: host ms per part of the step, GPU ms per step, GPU idle share, with the overlapped and
# the simple loop) in process, at batch 64 and 256 (128-token prompts), for each MODELS preset.
#
#   MODELS=smollm2-135m,llama-1b bash scripts/device/host_step.sh [NAME=DIR ...]
#
# Each NAME=DIR is a checkout measured in turn, all in one call (default: now=.); for a
# before/after, carry an old tree (git archive REV | tar -x -C .before) and pass now=.
# before=.before. PYSPY=path/to/py-spy also samples one decode-64 run per tree (folded stacks in
# $OUT/pyspy-NAME.txt). On the GPU machine from the repository root; results under $OUT.
set -u
OUT=${OUT:-/tmp/out}
MODELS=${MODELS:-smollm2-135m,llama-1b}
ROOT=$PWD
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%FT%TZ
[ $# -eq 0 ] && set -- now=.
for spec in "$@"; do
  name=${spec%%=*}; dir=${spec#*=}
  for batch in 64 256; do
    log="$OUT/host-$name-b$batch.log"
    (cd "$dir" && PYTHONPATH=$PYTHONPATH:$PWD timeout 400 python3 scripts/bench_decode.py \
      --paths inproc --no-hf --models "$MODELS" --num-requests "$batch" \
      --json "$OUT/host-$name-b$batch.json") > "$log" 2>&1 || echo "$name b$batch: exit $?"
    echo "== $name batch $batch: $(grep -m1 '^command:' "$log")"
    sed -n '/^engine start-up/,$p' "$log"
  done
  if [ -n "${PYSPY:-}" ]; then
    (cd "$dir" && PYTHONPATH=$PYTHONPATH:$PWD timeout 300 "$ROOT/$PYSPY" record --rate 500 \
      --format raw --nonblocking -o "$OUT/pyspy-$name.txt" -- python3 scripts/bench_decode.py \
      --paths inproc --no-hf --no-profile --models "${MODELS%%,*}" --output-len 1024) \
      > "$OUT/pyspy-$name.log" 2>&1 || echo "$name py-spy: exit $?"
  fi
done
date +%T
