"""Is the in-process decode loop bound by the GPU or by the host? (issue 17, the GPU machine)

    python scripts/device/gpu_bound_probe.py [--model smollm2-135m] [--batch 64] [--pad-us 40]
        [--rounds 3]

One in-process engine (bench_decode.py's configuration and workload: every request at once,
128 tokens in, 256 out, greedy). Its runner's ``launch`` is wrapped so that after each step's
launch (its event already recorded) the stream also runs a GPU-only wait (``torch.cuda._sleep``)
of about ``--pad-us`` microseconds: GPU time a step longer, no host time. Runs with and without
the pad take turns. If the median inter-token gap grows by the pad, the loop waits for the GPU
(every microsecond cut from the GPU step shows in the ITL); if it grows by less, the host had
the GPU waiting for part of each step, and the difference is that slack.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode  # noqa: E402

from engine_core.core import EngineCore  # noqa: E402


def sleep_cycles_for(us: float) -> int:
    """The ``torch.cuda._sleep`` argument that keeps the GPU about ``us`` microseconds."""
    cycles = 100_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # warm up, then time the last
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    per_us = cycles / (start.elapsed_time(end) * 1e3)
    return int(us * per_us)


class PaddedLaunch:
    """The runner's launch, then ``cycles`` of GPU-only wait on the stream when ``cycles``."""

    def __init__(self, launch: Any) -> None:
        self.launch = launch
        self.cycles = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = self.launch(*args, **kwargs)
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pad-us", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = bench_decode.Workload(args.batch, 128, 256, seed=0)
    core = EngineCore(bench_decode.engine_config(args.model, work, "cuda", False))
    vocab = core.model_config.vocab_size
    padded = PaddedLaunch(core.runner.launch)
    core.runner.launch = padded
    cycles = sleep_cycles_for(args.pad_us)
    print(f"# {' '.join(sys.argv)}; pad {args.pad_us} us = {cycles} sleep cycles", flush=True)
    bench_decode.run_inproc(core, work.shorter(16, seed=1), vocab, "warmup")
    results: dict[str, list[float]] = {"none": [], "pad": []}
    for round_no in range(args.rounds):
        for label in ("none", "pad"):
            padded.cycles = cycles if label == "pad" else 0
            run = bench_decode.run_inproc(
                core, work.shorter(256, seed=100 + round_no), vocab, f"{label}{round_no}"
            )
            results[label].append(run.itl_p50_ms * 1e3)
            print(f"round {round_no} {label}: ITL p50 {run.itl_p50_ms * 1e3:.1f} us", flush=True)
    none = sorted(results["none"])[len(results["none"]) // 2]
    pad = sorted(results["pad"])[len(results["pad"]) // 2]
    grew = pad - none
    print(
        f"{args.model} batch {args.batch}: ITL p50 {none:.1f} us, padded {pad:.1f} us: "
        f"+{grew:.1f} for a {args.pad_us:.0f} us pad ({100 * grew / args.pad_us:.0f}%)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
