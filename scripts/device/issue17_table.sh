#!/usr/bin/env bash
# Issue 17's decode table, every row with scripts/bench_decode.py in process and over raw ZMQ
# (random weights with the presets' shapes, fresh prompts each run, greedy, EOS ignored):
# 64 x (128 -> 256) on smollm2-135m, llama-1b and llama-8b; 256 x (128 -> 256) on llama-8b;
# 256 x (128 -> 512) on llama-1b; 32 x (3,800 -> 256) on llama-8b. Each row gives the roofline
# share two ways (bench_decode.py's docstring): %roof, the run's tok/s (prefill included), and
# step%, the roofline step over the median inter-token gap. The GPU machine, from the
# repository root; logs and JSON under $OUT, the rows printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%FT%TZ
steal() {  # the virtual CPUs' stolen time so far, all CPUs, in USER_HZ ticks (/proc/stat)
  awk '/^cpu /{print $9}' /proc/stat
}
run() {  # run NAME ARGS...: one bench_decode call, with the CPU time the host stole during it
  local name=$1; shift
  local before; before=$(steal)
  timeout 300 python3 scripts/bench_decode.py --no-hf --no-profile --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1 || echo "$name: exit $?"
  echo "cpu steal during the run: $(( ($(steal) - before) * 1000 / $(getconf CLK_TCK) )) ms" \
    >> "$OUT/$name.log"
}
run decode64 --models smollm2-135m,llama-1b,llama-8b
run llama8b-256 --models llama-8b --num-requests 256
run llama1b-256 --models llama-1b --num-requests 256 --output-len 512
run llama8b-long --models llama-8b --num-requests 32 --prompt-len 3800 --output-len 256
for name in decode64 llama8b-256 llama1b-256 llama8b-long; do
  echo "== $name: $(grep -m1 '^command:' "$OUT/$name.log")"
  grep -E "^(smollm2|llama)|^cpu steal" "$OUT/$name.log"
done
