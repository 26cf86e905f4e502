"""A decode step's GPU time under the board's power cap and with the GPU rested, on the GPU
machine (issue 17, llama-8b 256):

    python scripts/device/power_cap_probe.py --model llama-8b --batch 256 [--context 256]
        [--sustained 300] [--rests 20] [--rest-s 0.5]

The question: is a step at the power limit slower than the same step's work allows? The
engine (decode_graph_ab.py's ``engine_at_context``: random weights, CUDA graphs) decodes its
batch to about ``--context`` tokens; then its decode graph is replayed

- **sustained**: ``--sustained`` times back to back, each replay timed by CUDA events, as the
  engine's decode loop runs them (the median of the second half, once the board's power has
  settled at its limit);
- **rested**: ``--rests`` times, ``--rest-s`` seconds of idle GPU before each, then three
  replays in a row, each timed (the median for each position): steps that start at the idle
  clock, before the power limiter has anything to cut.

nvidia-smi's SM clock, instantaneous board power and software power cap flag are sampled during
the sustained replays and right after each rested group. The step's share of the HBM roofline
(bench_decode.py's: every weight and the KV cache at the context, over the best device copy) is
printed for both.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Workload, measure_hbm_bandwidth, roofline  # noqa: E402
from decode_graph_ab import decode_graph, engine_at_context  # noqa: E402

FIELDS = "clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap"


def gpu_sample() -> str:
    """SM clock (MHz), instantaneous board power (W) and the software power cap flag, now."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or out.stderr.strip()


def timed_replays(graph: torch.cuda.CUDAGraph, count: int) -> list[float]:
    """Milliseconds of each of ``count`` back-to-back replays."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    events[0].record()
    for i in range(count):
        graph.replay()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(count)]


def sustained(graph: torch.cuda.CUDAGraph, count: int) -> tuple[float, list[str]]:
    """The median of the second half of ``count`` back-to-back replays, and samples taken
    every half second while they run."""
    samples: list[str] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            samples.append(gpu_sample())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times = timed_replays(graph, count)
    done.set()
    sampler.join()
    return statistics.median(times[count // 2 :]), samples


def rested(graph: torch.cuda.CUDAGraph, rests: int, rest_s: float) -> tuple[list[float], list[str]]:
    """Per position (first, second, third replay after a rest), the median milliseconds over
    ``rests`` rests, and a sample taken right after each group."""
    groups, samples = [], []
    for _ in range(rests):
        torch.cuda.synchronize()
        time.sleep(rest_s)
        groups.append(timed_replays(graph, 3))
        samples.append(gpu_sample())
    return [statistics.median(g[i] for g in groups) for i in range(3)], samples


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-8b", help="preset (random weights)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=256, help="tokens per request, about")
    parser.add_argument("--sustained", type=int, default=300, help="back-to-back replays")
    parser.add_argument("--rests", type=int, default=20, help="rested groups of three replays")
    parser.add_argument("--rest-s", type=float, default=0.5, help="idle seconds before each")
    args = parser.parse_args(argv)
    print("# python " + " ".join([sys.argv[0], *argv]), flush=True)
    bandwidth = measure_hbm_bandwidth("cuda")
    _, step_bytes, _ = roofline(args.model, Workload(args.batch, args.context, 0, 0), bandwidth)
    roof_ms = 1e3 * step_bytes / bandwidth
    core = engine_at_context(args.model, args.batch, args.context)
    graph = decode_graph(core, args.batch)
    graph.replay()
    torch.cuda.synchronize()
    head = f"{args.model} batch {args.batch} context ~{args.context}"
    print(f"{head}: roofline step {roof_ms:.2f} ms ({bandwidth / 1e12:.2f} TB/s copies)")
    steady_ms, steady_samples = sustained(graph, args.sustained)
    share = 100 * roof_ms / steady_ms
    print(f"{head}, sustained: {steady_ms:.2f} ms a replay, {share:.1f}% of the roofline; "
          f"samples (MHz, W, power cap): {' | '.join(steady_samples)}")  # fmt: skip
    by_position, rest_samples = rested(graph, args.rests, args.rest_s)
    shown = ", ".join(f"{ms:.2f} ms ({100 * roof_ms / ms:.1f}%)" for ms in by_position)
    print(f"{head}, rested {args.rest_s} s: replays 1-3 after a rest {shown}; samples after "
          f"them: {' | '.join(rest_samples[:5])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
