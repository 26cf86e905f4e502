#!/usr/bin/env bash
# Issue 7 and issue 9 at 256 concurrent requests (llama-1b shape, 128-token prompts, 1024 output
# tokens each, EOS ignored), every figure the median of 3 runs after a warm-up, with engine cores
# and the rest pinned apart (serve_lib.sh, `pin`):
# - one engine core: raw ZMQ against HTTP streaming (--stream-interval 16) through 4 and through 8
#   API processes, the load generator sending HTTP from 4 client processes;
# - two engine cores (--data-parallel-size 2, one GPU each): HTTP through 4 and 8 API processes,
#   and raw ZMQ straight to each engine core from two load generators at once (128 requests
#   each), which measures the engines without any frontend.
# On the 2-GPU machine from the repository root; results under $OUT, a summary line per run.
LONG=${LONG:-1024}
source scripts/device/serve_lib.sh
RUNS=(--repeat-runs 3)
C4=(--client-processes 4)
SI=(--stream-interval 16)

zmq_to_each_engine() {  # NAME: raw ZMQ to every engine core at once, N / (engines) requests each
  local name=$1 i=0 address pids=() addresses
  addresses=$(engine_addresses)
  local count; count=$(echo "$addresses" | wc -l)
  for address in $addresses; do
    N=$((N / count)) bench "$name-e$i" zmq "$LONG" --address "$address" "${RUNS[@]}" &
    pids+=($!); i=$((i + 1))
  done
  wait "${pids[@]}"
  for ((j = 0; j < i; j++)); do median "$name-e$j"; done
}

nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"; date -u +%FT%TZ; nproc

serve one-a4 --api-servers 4 "${SI[@]}"; pin; date +%T
bench zmq-one zmq "$LONG" "${RUNS[@]}"; median zmq-one
bench http-one-a4 openai-completions "$LONG" "${RUNS[@]}" "${C4[@]}"; median http-one-a4
server_ttft
stop
serve dp2-a4 --data-parallel-size 2 --api-servers 4 "${SI[@]}"; pin; date +%T
bench http-dp2-a4 openai-completions "$LONG" "${RUNS[@]}" "${C4[@]}"; median http-dp2-a4
zmq_to_each_engine zmq-dp2
stop
serve one-a8 --api-servers 8 "${SI[@]}"; pin; date +%T
bench http-one-a8 openai-completions "$LONG" "${RUNS[@]}" "${C4[@]}"; median http-one-a8
bench zmq-one-again zmq "$LONG" "${RUNS[@]}"; median zmq-one-again
stop
serve dp2-a8 --data-parallel-size 2 --api-servers 8 "${SI[@]}"; pin; date +%T
bench http-dp2-a8 openai-completions "$LONG" "${RUNS[@]}" "${C4[@]}"; median http-dp2-a8
stop
date +%T
