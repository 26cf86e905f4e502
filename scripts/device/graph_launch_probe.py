"""The host's cost of launching one decode CUDA graph (``CUDAGraph.replay``), on the GPU machine:

    python scripts/device/graph_launch_probe.py [--model smollm2-135m] [--batch 64]

An in-process engine on the preset's random weights (launch_host_probe.py's
``decoding_engine``) decodes a few steps, then its decode graph for ``--batch`` rows is
replayed by itself:

- **idle**: the GPU synchronized before each replay, so the launch never waits for room in the
  GPU's queue: what the driver's launch of the graph costs the host;
- **back to back**: replays queued one after another with no synchronization, the host time a
  replay takes once the queue is full (then it waits for the GPU, which is not host work);
- **GPU**: the replay's GPU time by CUDA events, for scale.

Prints microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_graph_ab import decode_graph, replay_us  # noqa: E402
from launch_host_probe import decoding_engine  # noqa: E402


def idle_launch_us(graph: torch.cuda.CUDAGraph, samples: int) -> list[float]:
    """Host microseconds of each replay() call on an idle GPU."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return times


def queued_launch_us(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Host microseconds of each of ``replays`` replay() calls made back to back."""
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset (random weights)")
    parser.add_argument("--batch", type=int, default=64, help="the decode graph's rows")
    parser.add_argument("--samples", type=int, default=200, help="replays timed each way")
    args = parser.parse_args()
    core = decoding_engine(args.model, args.batch, 400)
    for _ in range(30):  # the prefill and the first decode steps
        core.step()
    torch.cuda.synchronize()
    graph = decode_graph(core, args.batch)
    idle_launch_us(graph, 20)  # warm-up
    idle = idle_launch_us(graph, args.samples)
    queued = queued_launch_us(graph, args.samples)
    gpu = replay_us(core, args.batch, args.samples)
    head = queued[: min(8, len(queued))]
    print(f"{args.model} batch {args.batch}: "
          f"replay() on an idle GPU: median {statistics.median(idle):.1f} us, "
          f"p10 {sorted(idle)[len(idle) // 10]:.1f}, p90 {sorted(idle)[9 * len(idle) // 10]:.1f}; "
          f"back to back: median {statistics.median(queued):.1f} us "
          f"(the first {len(head)}: {' '.join(f'{t:.0f}' for t in head)}); "
          f"GPU {gpu:.1f} us a replay")  # fmt: skip


if __name__ == "__main__":
    main()
