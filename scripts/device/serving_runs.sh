#!/usr/bin/env bash
# Issue 7 (HTTP against raw ZMQ at 256 streams, by API processes and stream interval) and issue 9
# (data parallel 2 against one engine core at 256 concurrent requests), llama-1b shape, on the GPU
# machine from the repository root (2 GPUs for DP=2); logs and loadgen JSON go to $OUT.
OUTPUT_LEN=${OUTPUT_LEN:-256}
MAX_MODEL_LEN=1024
source scripts/device/serve_lib.sh

nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"; date -u +%FT%TZ

serve a1-si1;                                   bench zmq-one-engine zmq "$OUTPUT_LEN"; bench http-a1-si1 openai-completions "$OUTPUT_LEN"; stop
serve a1-si16 --stream-interval 16;             bench http-a1-si16 openai-completions "$OUTPUT_LEN"; stop
serve a4-si1 --api-servers 4;                   bench http-a4-si1 openai-completions "$OUTPUT_LEN"; stop
serve a4-si16 --api-servers 4 --stream-interval 16; bench zmq-a4 zmq "$OUTPUT_LEN"; bench http-a4-si16 openai-completions "$OUTPUT_LEN"; stop
serve a8-si16 --api-servers 8 --stream-interval 16; bench http-a8-si16 openai-completions "$OUTPUT_LEN"; stop
serve dp2-si16 --data-parallel-size 2 --stream-interval 16; bench http-dp2-si16 openai-completions "$OUTPUT_LEN"; stop
serve dp2-si1 --data-parallel-size 2;           bench http-dp2-si1 openai-completions "$OUTPUT_LEN"; stop
