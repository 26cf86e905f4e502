#!/usr/bin/env bash
# How fast each CPU of this machine runs the engine's host work now: scripts/bench_host_step.py
# (a steady decode step's plan, pack, update and frames at batch 64, no model; its "steady"
# total, not the block-boundary steps' it prints apart) pinned to each
# CPU in turn with taskset, ROUNDS times (default 1). Prints one line per CPU and round: the
# median microseconds of a step's host work. On the H100 leases' KVM guests the CPUs split into
# two speeds, about 2x apart, and which CPUs are slow changed from minute to minute
# (docs/benchmarks.md, twenty-eighth session). From the repository root.
set -u
ROUNDS=${ROUNDS:-1}
for round in $(seq 1 "$ROUNDS"); do
  for cpu in $(seq 0 $(( $(nproc --all) - 1 ))); do
    us=$(taskset -c "$cpu" python3 scripts/bench_host_step.py --batch 64 --steps 200 --warmup 50 \
      2>&1 | awk '$2 == "steady" && $3 == "total" {print $4}')
    echo "round $round cpu $cpu: ${us:-failed} us a step"
  done
done
