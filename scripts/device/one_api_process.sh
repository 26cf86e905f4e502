#!/usr/bin/env bash
# One API process at 256 streams (issue 17): llama-1b shape, 256 requests at once, 128-token
# prompts, 512 output tokens each (EOS ignored), `--stream-interval 16`; raw ZMQ against HTTP
# streaming through the `tandem serve` process itself (--api-servers 1), the load generator
# sending HTTP from 4 client processes. Each run: one warm-up, then RUNS measured runs.
#
#   bash scripts/device/one_api_process.sh [NAME=DIR ...]
#
# Each NAME=DIR[=SITE] is a checkout whose server is measured in turn (default: now=.), with
# SITE (default $SITE, /tmp/site) first on its PYTHONPATH; for a before/after, carry an old tree
# (git archive REV | tar -x -C .before) and pass now=. before=.before[=/tmp/site-before].
# SERVE_FLAGS="..." adds flags to each `tandem serve` (for an A/B of a serving setting).
# Each checkout's own load generator drives its server (their protocols may differ); where it
# has --output-interval, a third line runs raw ZMQ with --output-interval 16, as the API
# process asks for each stream. After each load: the CPU seconds the API process (the serve
# process) and the engine process used during it (its warm-up and RUNS runs).
# CLIENTS=N: the load generator's HTTP client processes (default 4).
# PYSPY=path/to/py-spy also samples the serve process (the API process) during the runs: folded
# stacks in $OUT/pyspy-NAME.txt. On the GPU machine from the repository root; results under $OUT.
# The wheels must include httptools (`bash ../shared/device/fetch-wheels.sh httptools`), a
# dependency the GPU machine lacks: without it uvicorn parses HTTP with h11 (pure Python), and
# the serve log and this script say so.
LONG=${LONG:-512}
RUNS=${RUNS:-2}
FIRST_FREE_CORE=${FIRST_FREE_CORE:-8}
source scripts/device/serve_lib.sh
ROOT=$PWD
SITE=${SITE:-/tmp/site}

serve_tree() {  # serve_tree NAME DIR SITE: that checkout's server, with py-spy if asked
  local name=$1 dir=$2 site=$3 cmd
  cmd=(python3 -m frontend.cli serve --model "$MODEL" --port "$PORT" --max-model-len "$MAX_MODEL_LEN"
       --stream-interval 16 ${SERVE_FLAGS:-})
  [ -n "${PYSPY:-}" ] && cmd=("$ROOT/$PYSPY" record --rate 200 --format raw --nonblocking
                              -o "$OUT/pyspy-$name.txt" -- "${cmd[@]}")
  (cd "$dir" && PYTHONPATH=$site:$PWD exec "${cmd[@]}") > "$OUT/serve-$name.log" 2>&1 &
  SERVER=$!
  wait_healthy "$name"
}

stop_tree() {  # the serve process first (py-spy then writes its file and exits)
  pkill -TERM -f "^python3 -m frontend.cli serve" 2>/dev/null; wait "$SERVER" 2>/dev/null; sleep 1
}

measured() {  # measured NAME BACKEND OUTPUT_LEN [FLAGS...]: bench, its median, the CPU it took
  local engine api0 engine0
  engine=$(pgrep -f "frontend.cli engine" | head -1)
  if [ -n "${PYSPY:-}" ] || [ -z "$engine" ]; then  # $SERVER is py-spy, or no engine to read
    bench "$@"; median "$1"; return
  fi
  api0=$(cpu_s "$SERVER"); engine0=$(cpu_s "$engine")
  bench "$@"; median "$1"
  echo "$1: CPU s during it: API process $(python3 -c "print(round($(cpu_s "$SERVER") - $api0, 2))"), engine process $(python3 -c "print(round($(cpu_s "$engine") - $engine0, 2))")"
}

nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%FT%TZ; nproc
[ $# -eq 0 ] && set -- now=.
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; dir=${rest%%=*}; site=$SITE
  [ "$rest" != "$dir" ] && site=${rest#*=}
  serve_tree "$name" "$dir" "$site"; pin
  export LG_DIR=$dir
  measured "zmq-$name" zmq "$LONG" --repeat-runs "$RUNS"
  measured "http-$name" openai-completions "$LONG" --repeat-runs "$RUNS" \
    --client-processes "${CLIENTS:-4}"
  if grep -q -- "--output-interval" "$dir/loadgen/cli.py"; then
    measured "zmq16-$name" zmq "$LONG" --repeat-runs "$RUNS" --output-interval 16
  fi
  stop_tree; unset LG_DIR
done
date +%T
