# Shared by the serving_*.sh scripts (source it after setting what differs from the defaults
# below): the common settings, start and stop `tandem serve`, run the load generator, read the
# servers' own TTFT. Runs on the GPU machine from the repository root; results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on the lent machines
# The server as users start it: `tandem serve` leaves the tokenizer's threads on, and a caller's
# TOKENIZERS_PARALLELISM=false would slow the API process's admission of a burst (see
# docs/benchmarks.md, eighth session: 79% of raw ZMQ against 91%).
unset TOKENIZERS_PARALLELISM
MODEL=${MODEL:-random:llama-1b}
N=${N:-256}  # concurrent requests
PORT=${PORT:-8011}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
URL=http://127.0.0.1:$PORT

serve() {  # serve NAME FLAGS...: start `tandem serve` and wait until /health answers
  local name=$1; shift
  python3 -m frontend.cli serve --model "$MODEL" --port "$PORT" --max-model-len "$MAX_MODEL_LEN" \
    "$@" > "$OUT/serve-$name.log" 2>&1 &
  SERVER=$!
  wait_healthy "$name"
}

wait_healthy() {  # wait_healthy NAME: until the server at $URL answers /health (2 min at most)
  # and say so if it parses HTTP with h11: the wheels lacked httptools (fetch-wheels.sh httptools)
  local name=$1
  python3 - "$URL" <<'PY' || { echo "server $name did not come up"; tail -5 "$OUT/serve-$name.log"; }
import sys, time, httpx
for _ in range(240):
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
  grep -q "httptools is not installed" "$OUT/serve-$name.log" 2>/dev/null \
    && echo "WARNING: server $name parses HTTP with h11, not httptools: not what users run"
  return 0
}

stop() { kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; sleep 1; }

bench() {  # bench NAME BACKEND OUTPUT_LEN [LOADGEN FLAGS...]: one loadgen run, one summary line
  # (the load generator of the checkout in $LG_DIR, default here: its protocol is its server's)
  local name=$1 backend=$2 olen=$3 tok=${TANDEM_TOKENIZER_DIR:-$PWD/.tok}; shift 3
  (cd "${LG_DIR:-.}" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
    timeout 150 ${LG_PREFIX:-} python3 -m loadgen --ignore-eos -n "$N" --input-len 128 --output-len "$olen" \
    --warmup-runs 1 --tokenizer "$tok" --no-progress --url "$URL" \
    --backend "$backend" --result-json "$OUT/lg-$name.json" "$@" > "$OUT/lg-$name.log" 2>&1)
  echo "$name: $(grep -E 'Failed requests|Output token throughput|Median TTFT|P99 TTFT|Median TPOT|load generator CPU' \
    "$OUT/lg-$name.log" | tr -s ' ' | paste -sd ';')"
}

server_ttft() {  # the API processes' own mean TTFT (arrival at the frontend to first token)
  python3 - "$URL" <<'PY'
import re, sys, httpx
seen = {}
for _ in range(64):  # new connections land on different API processes (SO_REUSEPORT)
    with httpx.Client() as c:
        r = c.get(sys.argv[1] + "/metrics")
    who = r.headers.get("x-tandem-api-server", "0")
    s = re.search(r"^tandem_time_to_first_token_seconds_sum\S* (\S+)", r.text, re.M)
    n = re.search(r"^tandem_time_to_first_token_seconds_count\S* (\S+)", r.text, re.M)
    if s and n and float(n.group(1)):
        seen[who] = (float(s.group(1)), float(n.group(1)))
print("server-side mean TTFT by API process (all runs so far): " + ", ".join(
    f"{k}: {1e3 * s / n:.0f} ms over {n:.0f}" for k, (s, n) in sorted(seen.items())))
PY
}

# Pinning: engine core i on cores 8i..8i+7, every other serving process (API processes, the
# parent) and the load generator on the cores above, so that they never take the engines' host
# time. With no taskset (PIN=no) nothing is pinned.
PIN=${PIN:-$(command -v taskset >/dev/null && echo yes || echo no)}
FIRST_FREE_CORE=${FIRST_FREE_CORE:-16}
[ "$PIN" = yes ] && LG_PREFIX="taskset -c $FIRST_FREE_CORE-$(($(nproc) - 1))"
pin() {
  [ "$PIN" = yes ] || { echo "no taskset: not pinned"; return; }
  local i=0 pid
  for pid in $(pgrep -f "frontend.cli engine"); do
    taskset -a -p -c $((8 * i))-$((8 * i + 7)) "$pid" > /dev/null; i=$((i + 1))
  done
  for pid in $(pgrep -f "frontend.api_processes|frontend.cli serve"); do
    taskset -a -p -c "$FIRST_FREE_CORE-$(($(nproc) - 1))" "$pid" > /dev/null
  done
}

cpu_s() {  # cpu_s PID...: the user + system CPU seconds these processes have used so far
  python3 - "$@" <<'PY'
import os, sys
tick = os.sysconf("SC_CLK_TCK")
total = 0.0
for pid in sys.argv[1:]:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
print(f"{total:.2f}")
PY
}

median() {  # median NAME: the median output tok/s of the runs a loadgen JSON reports
  python3 - "$OUT/lg-$1.json" <<'PY'
import json, statistics, sys
runs = json.load(open(sys.argv[1]))["runs"]
values = [r["summary"]["output_throughput"] for r in runs]
name = sys.argv[1].split("lg-")[-1][:-5]
print(f"{name}: median {statistics.median(values):.0f} tok/s of", [round(v) for v in values])
PY
}

engine_addresses() {  # the raw ZMQ addresses of the server's engine cores, one per line
  python3 - "$URL" <<'PY'
import httpx, sys
info = httpx.get(sys.argv[1] + "/v1/engine", timeout=10).json()
print("\n".join(e["address"] for e in info.get("engines", [info])))
PY
}
