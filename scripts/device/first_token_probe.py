"""Where an idle engine's first token goes, in process: one 128-token request at a time.

    python scripts/device/first_token_probe.py [--model llama-1b] [--trials 10] [--no-overlap]

An EngineCore on the GPU (random weights, the preset's real shape), warmed up, then for each trial
one fresh prompt with max_tokens=1: every ``step()`` call until the token comes out, timed
(wall, with the engine's step stats per phase), and the trial's steps under torch.profiler: the
CUDA kernels' total time and the top host ops. Answers scripts/first_token.py's question "the
engine's first step to first token takes 18 ms on llama-1b: where?" (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.request import Request  # noqa: E402
from engine_core.step_stats import format_summary  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def one_request(engine: EngineCore, rid: str, prompt: list[int]) -> list[float]:
    """Step until ``rid``'s token is out; each step's wall ms (the GPU synchronised after it)."""
    engine.add_request(Request(rid, prompt, PARAMS))
    steps = []
    while True:
        start = time.perf_counter()
        outputs = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append((time.perf_counter() - start) * 1e3)
        if any(out.request.request_id == rid and out.new_token_ids for out in outputs):
            while engine.has_unfinished():  # the overlapped loop's trailing step
                engine.step()
            return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    config = EngineConfig(
        model=f"random:{args.model}",
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_model_len=2048,
        step_stats=True,
        async_scheduling=not args.no_overlap,
    )
    engine = EngineCore(config)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, 49152) for _ in range(args.prompt_len)]

    for i in range(5):
        one_request(engine, f"warm-{i}", prompt())
    engine.step_stats.reset()
    trials = [one_request(engine, f"trial-{i}", prompt()) for i in range(args.trials)]
    totals = [sum(t) for t in trials]
    print(f"\n{args.model}, {args.prompt_len}-token prompt, overlap {not args.no_overlap}")
    print(f"first token: median {statistics.median(totals):.2f} ms over {len(trials)} trials")
    print(
        f"steps until it: {[len(t) for t in trials]}; step ms of trial 0: "
        f"{[round(s, 2) for s in trials[0]]}"
    )
    print(f"engine step stats: {format_summary(engine.step_stats.summary())}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_request(engine, "profiled", prompt())
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"profiled trial: CUDA kernels {gpu_us / 1e3:.2f} ms in all; top by GPU time:")
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:8]:
        print(f"  {e.key[:70]:<70} {e.self_device_time_total / 1e3:7.2f} ms {e.count:5d} calls")
    print("top by host time:")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]:
        print(f"  {e.key[:70]:<70} {e.self_cpu_time_total / 1e3:7.2f} ms {e.count:5d} calls")
    print(f"\ncommand: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
