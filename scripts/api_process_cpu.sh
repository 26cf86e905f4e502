#!/usr/bin/env bash
# What one API process spends on a burst of streams, on this machine (no GPU): the CPU seconds
# the `tandem serve` process (the API process; its engine runs in a child process) uses while
# the load generator streams N requests at once over HTTP, --stream-interval 16, a warm-up and
# RUNS measured runs. The model is a 2-layer random Llama with the default model's tokenizer
# (tests/factories.py), so the engine steps in milliseconds and the API process does the work of
# any model: tokenize, admit, detokenize, build and write the SSE chunks.
#
#   bash scripts/api_process_cpu.sh [NAME=DIR ...]      (default: now=.)
#
# Each NAME=DIR is a checkout served in turn (for an A/B: git archive REV | tar -x -C /tmp/before,
# then before=/tmp/before now=. before=/tmp/before now=.), all with this checkout's Python
# (.venv). N (256), OLEN (512 output tokens, EOS ignored), RUNS (2), PORT (8123). Prints one
# line per checkout: the API process's CPU seconds and milliseconds a request. CPU time, not
# throughput: on 2 cores the engine, the API process and the load generator share the machine.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
N=${N:-256}; OLEN=${OLEN:-512}; RUNS=${RUNS:-2}; PORT=${PORT:-8123}
WORK=$(mktemp -d /tmp/api-process-cpu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
unset TOKENIZERS_PARALLELISM  # as users start the server

(cd "$ROOT" && "$PY" - "$WORK/model" <<'PY') || exit 1
import sys
from pathlib import Path
from engine_core.loader import resolve_model_dir
from tests.factories import copy_tokenizer, write_tiny_llama
# 2,048 positions: room for 128-token prompts and 512 outputs
path = write_tiny_llama(Path(sys.argv[1]), vocab_size=49152, max_positions=2048)
copy_tokenizer(resolve_model_dir("default"), path)
PY
cpu_s() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }

measure() {  # measure NAME DIR
  local name=$1 dir=$2 server before after
  (cd "$dir" && exec "$PY" -m frontend.cli serve --model "$WORK/model" --port "$PORT" \
    --stream-interval 16 --max-model-len 1024) > "$WORK/serve-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
  before=$(cpu_s "$server")
  (cd "$ROOT" && "$PY" -m loadgen --ignore-eos -n "$N" --input-len 128 --output-len "$OLEN" \
    --warmup-runs 1 --repeat-runs "$RUNS" --tokenizer "$WORK/model" --no-progress \
    --url "http://127.0.0.1:$PORT" --backend openai-completions) > "$WORK/lg-$name.log" 2>&1
  after=$(cpu_s "$server")
  kill -TERM "$server"; wait "$server" 2>/dev/null
  local failed
  failed=$(grep -m1 "Failed requests" "$WORK/lg-$name.log" | awk '{print $NF}')
  python3 -c "
s = $after - $before; n = $N * ($RUNS + 1)
print(f'$name: API process {s:.2f} CPU s for {n} requests, {1000 * s / n:.2f} ms a request (failed: ${failed:-?})')"
}

[ $# -eq 0 ] && set -- now=.
for spec in "$@"; do measure "${spec%%=*}" "${spec#*=}"; done
