#!/usr/bin/env bash
# Follow-up to serving_runs.sh, same machine and model (llama-1b shape, 256 streams): where the
# HTTP path's first-token delay comes from (ZMQ with staggered arrivals, the servers' own TTFT),
# and the HTTP/ZMQ and DP=2/one-engine comparisons with 1024 output tokens per request.
source scripts/device/serve_lib.sh

nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"; date -u +%FT%TZ

serve a4-si16 --api-servers 4 --stream-interval 16
bench zmq-256 zmq ${SHORT:-256}
bench zmq-256-staggered zmq ${SHORT:-256} --request-rate 2500
bench http-a4-si16-256 openai-completions ${SHORT:-256}
server_ttft
bench zmq-1024 zmq ${LONG:-1024}
bench http-a4-si16-1024 openai-completions ${LONG:-1024}
stop
serve a1-si16 --stream-interval 16
bench zmq-a1-1024 zmq ${LONG:-1024}
bench http-a1-si16-1024 openai-completions ${LONG:-1024}
stop
serve dp2-si16 --data-parallel-size 2 --stream-interval 16
bench http-dp2-si16-1024 openai-completions ${LONG:-1024}
stop
