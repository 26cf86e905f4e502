#!/usr/bin/env bash
# The GPU's clock, power and power-cap flag while a command runs, on the GPU machine (issue 17):
#
#   LABEL=llama8b-256 bash scripts/device/power_during.sh python3 scripts/bench_decode.py ...
#
# nvidia-smi samples every 100 ms into $OUT/power-$LABEL.csv; the summary counts the samples
# taken while the GPU was busy (utilization of 90% or more): their median and range of SM clock
# and board power, the power limit, and the share of them with the software power cap active.
set -u
OUT=${OUT:-/tmp/out}
LABEL=${LABEL:-run}
mkdir -p "$OUT"
csv="$OUT/power-$LABEL.csv"
fields=utilization.gpu,clocks.sm,power.draw,power.limit,clocks_event_reasons.sw_power_cap,temperature.gpu
nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits -lms 100 > "$csv" &
sampler=$!
"$@"
status=$?
kill $sampler
python3 - "$csv" "$LABEL" <<'PY'
import statistics, sys
rows = [[f.strip() for f in line.split(",")] for line in open(sys.argv[1]) if line.strip()]
# The sampler is killed mid-line at the end: a short last row is skipped.
busy = [r for r in rows if len(r) >= 6 and r[0].isdigit() and int(r[0]) >= 90]
if not busy:
    sys.exit(f"{sys.argv[2]}: no busy samples among {len(rows)}")
clock = [float(r[1]) for r in busy]
power = [float(r[2]) for r in busy]
capped = sum(r[4] == "Active" for r in busy)
print(f"{sys.argv[2]}: {len(busy)} busy samples of {len(rows)}; SM clock median "
      f"{statistics.median(clock):.0f} MHz ({min(clock):.0f}-{max(clock):.0f}); power median "
      f"{statistics.median(power):.0f} W ({min(power):.0f}-{max(power):.0f}) of a {busy[0][3]} W "
      f"limit; software power cap active in {100 * capped / len(busy):.0f}% of them; "
      f"temperature up to {max(int(r[5]) for r in busy)} C")
PY
exit $status
