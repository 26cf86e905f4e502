#!/usr/bin/env bash
# Issue 17's chunk-size question: goodput of llama-8b (random weights) on the mixed workload
# (prompts of 64-2,048 tokens, outputs of 32-512, Poisson arrivals at 4, 8, 16 and 32 req/s)
# under the SLO TTFT <= 500 ms and TPOT <= 25 ms, for several --max-num-batched-tokens, over raw
# ZMQ. One server per setting; N requests per rate (fresh random prompts: no prefix cache helps).
#
#   MNBT="1024 2048 8192" N=120 bash scripts/device/chunk_goodput.sh
#
# The GPU machine, from the repository root (TANDEM_TOKENIZER_DIR for the random preset); one
# loadgen JSON and log per setting under $OUT, a goodput line per setting and rate printed last.
MODEL=${MODEL:-random:llama-8b}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
N=${N:-120}
MNBT=${MNBT:-"1024 2048 8192"}
PIN=no
source scripts/device/serve_lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%FT%TZ
for tokens in $MNBT; do
  serve "mnbt$tokens" --max-num-batched-tokens "$tokens"
  timeout 400 python3 -m loadgen --backend zmq --url "$URL" -n "$N" --input-len 64:2048 \
    --output-len 32:512 --ignore-eos --sweep rate=4,8,16,32 --slo ttft=500,tpot=25 \
    --tokenizer "${TANDEM_TOKENIZER_DIR:-.tok}" --no-progress \
    --result-json "$OUT/goodput-mnbt$tokens.json" > "$OUT/goodput-mnbt$tokens.log" 2>&1 \
    || echo "mnbt$tokens: loadgen exit $?"
  stop
done
python3 - "$OUT" $MNBT <<'PY'
import json, sys
out, settings = sys.argv[1], sys.argv[2:]
print("| --max-num-batched-tokens | rate req/s | goodput req/s | met SLO | output tok/s | TTFT p50 ms | TPOT p50 ms |")
print("|---|---|---|---|---|---|---|")
for tokens in settings:
    try:
        doc = json.load(open(f"{out}/goodput-mnbt{tokens}.json"))
    except OSError:
        print(f"| {tokens} | no result |")
        continue
    for run in doc["runs"]:
        s = run["summary"]
        print(f"| {tokens} | {run['sweep_value']} | {s['goodput']:.2f} | {s['good_requests']}/{s['completed']} "
              f"| {s['output_throughput']:.0f} | {s['ttft']['p50']:.0f} | {s['tpot']['p50']:.1f} |")
PY
