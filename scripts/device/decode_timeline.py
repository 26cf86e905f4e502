"""Where a steady decode step's GPU time goes, kernel by kernel, as the kernels run in the
replayed CUDA graph (programmatic launches overlapping, caches warm), not each alone as
``ncu_layer.sh`` measures them.

    python3 scripts/device/decode_timeline.py run --model smollm2-135m --batch 64 --trace T.json
    python3 scripts/device/decode_timeline.py report T.json

``run`` drives an in-process engine on random weights to steady decode and records ``--steps``
steps with the PyTorch profiler (CUPTI: the graph's kernels one by one), as a Chrome trace.
``report`` reads such a trace and prints, per kernel name: launches per step, the median
duration, its share of the step, and the median gap from the end of the kernel before it to its
start (negative where a programmatic launch overlaps its predecessor). A step runs from one
host-to-device input copy to the next. On the GPU machine from the repository root;
``scripts/device/decode_timeline.sh`` runs both for several points.

Read it with its two distortions in mind (seen on an H100, 2026-11-27): a kernel launched as a
programmatic dependent (engine_core/triton_pdl.py) starts early and waits, so its duration
includes the wait and the chain's durations add up to more than the step; and CUPTI slows the
host's launches, so the gaps between steps, where the host launches the next one, are far
longer than without the profiler (the step stats' GPU idle share says what they are). The
durations of plain launches (cuBLAS's products, PyTorch's kernels) are what they take.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(args: argparse.Namespace) -> None:
    import torch
    from launch_host_probe import decoding_engine  # scripts/device, this script's folder

    core = decoding_engine(args.model, args.batch, args.steps + 200)
    for _ in range(100):  # the prefill, then about 100 tokens of context more
        core.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(args.trace))
    print(f"{args.model} batch {args.batch}: {args.steps} steps traced")


def read_trace(path: Path) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of each kernel and copy in a Chrome trace of the PyTorch
    profiler, in start order (copies are named "Memcpy HtoD ...", "Memcpy DtoH ...")."""
    events = json.loads(path.read_text())["traceEvents"]
    rows = [
        (float(e["ts"]), float(e["dur"]), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    ]
    rows.sort()
    return rows


def is_input_copy(name: str) -> bool:
    """A host-to-device copy: each step begins with one (its packed inputs)."""
    return name.startswith("Memcpy HtoD")


def split_steps(trace: list[tuple[float, float, str]]) -> list[list[tuple[float, float, str]]]:
    """The kernels of each step: from one input copy to the next (copies left out)."""
    steps: list[list[tuple[float, float, str]]] = []
    for row in trace:
        if is_input_copy(row[2]):
            steps.append([])
        elif steps and not row[2].startswith("Memcpy"):
            steps[-1].append(row)
    return steps[:-1]  # the last may be cut short by the capture's end


def short(name: str) -> str:
    """A kernel's name without its return type, template and parameters."""
    return name.removeprefix("void ").split("(")[0].split("<")[0][:48]


def report(args: argparse.Namespace) -> None:
    steps = [s for s in split_steps(read_trace(args.trace)) if s]
    walls = [s[-1][0] + s[-1][1] - s[0][0] for s in steps]
    durations: dict[str, list[float]] = defaultdict(list)
    gaps: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(list)
    for s in steps:
        per_step: dict[str, int] = defaultdict(int)
        for prev, k in zip([None, *s], s, strict=False):
            name = short(k[2])
            durations[name].append(k[1])
            per_step[name] += 1
            if prev is not None:
                gaps[name].append(k[0] - (prev[0] + prev[1]))
        for name, n in per_step.items():
            counts[name].append(n)
    wall = statistics.median(walls)
    busy = statistics.median(sum(k[1] for k in s) for s in steps)
    print(f"{len(steps)} steps: median wall {wall:.1f} us, kernels' own time {busy:.1f} us, "
          f"{statistics.median(len(s) for s in steps):.0f} kernels a step")  # fmt: skip
    print(f"{'kernel':48s} {'a step':>6s} {'median us':>9s} {'share':>6s} {'gap before us':>13s}")
    order = sorted(durations, key=lambda n: -sum(durations[n]))
    for name in order:
        per = statistics.median(counts[name])
        med = statistics.median(durations[name])
        gap = statistics.median(gaps[name]) if gaps[name] else float("nan")
        share = 100 * sum(durations[name]) / len(steps) / wall
        print(f"{name:48s} {per:6.0f} {med:9.2f} {share:5.1f}% {gap:13.2f}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="smollm2-135m", help="preset (random weights)")
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--trace", type=Path, required=True, help="the Chrome trace to write")
    p = sub.add_parser("report")
    p.add_argument("trace", type=Path)
    args = parser.parse_args(argv)
    run(args) if args.mode == "run" else report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
