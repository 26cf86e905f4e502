#!/usr/bin/env bash
# Issue 7 and 9 headline runs at 256 streams (llama-1b shape), with the load generator sending
# from 4 processes so its own Python does not set the pace: HTTP against raw ZMQ (4 and 8 API
# processes, --stream-interval 16), and DP=2 against one engine core, for 256 and 1024 output
# tokens per request. On the 2-GPU machine from the repository root; results under $OUT.
SHORT=${SHORT:-256}
LONG=${LONG:-1024}
source scripts/device/serve_lib.sh
C4=(--client-processes 4)

nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"; date -u +%FT%TZ

serve a4-si16 --api-servers 4 --stream-interval 16
bench zmq-a4-short zmq "$SHORT"
bench http-a4-si16-short-c4 openai-completions "$SHORT" "${C4[@]}"
bench zmq-a4-long zmq "$LONG"
bench http-a4-si16-long-c4 openai-completions "$LONG" "${C4[@]}"
server_ttft
stop
serve a8-si16 --api-servers 8 --stream-interval 16
bench http-a8-si16-short-c4 openai-completions "$SHORT" "${C4[@]}"
bench http-a8-si16-long-c4 openai-completions "$LONG" "${C4[@]}"
stop
serve a1-si16 --stream-interval 16
bench zmq-a1-short zmq "$SHORT"
bench http-a1-si16-short-c4 openai-completions "$SHORT" "${C4[@]}"
bench zmq-a1-long zmq "$LONG"
bench http-a1-si16-long-c4 openai-completions "$LONG" "${C4[@]}"
stop
serve dp2-si16 --data-parallel-size 2 --stream-interval 16
bench http-dp2-si16-short-c4 openai-completions "$SHORT" "${C4[@]}"
bench http-dp2-si16-long-c4 openai-completions "$LONG" "${C4[@]}"
stop
