"""Where an idle engine's first token goes, in process: one 128-token request at a time.

    python scripts/device/first_token_probe.py [--model llama-1b] [--trials 10]

Two EngineCores on the GPU in one process (random weights, the preset's real shape; the same
weights' seed): one with prefill CUDA graphs (the default) and one that runs prefills eagerly
(``max_prefill_graph_tokens=0``). For each trial round, each variant in turn (graphs / eager,
each with the overlapped and the simple loop) gets one fresh prompt with max_tokens=1, so the
variants alternate on the same machine state; every ``step()`` call until the token comes out is
timed (wall, and the calling thread's CPU time: a step whose CPU time falls short of its wall
time was waiting or descheduled, one whose CPU time matches it was busy). Then one trial of each
variant under torch.profiler: the GPU's kernel time and the top host ops. Answers "the engine's
first step to first token takes 18 ms on llama-1b: where?" (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.request import Request  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass
class Variant:
    name: str
    engine: EngineCore
    overlap: bool
    totals: list[float] = field(default_factory=list)  # first-token ms per trial
    first_step: list[float] = field(default_factory=list)  # the prefill step's wall ms
    first_step_cpu: list[float] = field(default_factory=list)  # its thread CPU ms


def one_request(engine: EngineCore, rid: str, prompt: list[int]) -> list[tuple[float, float]]:
    """Step until ``rid``'s token is out; each step's (wall ms, thread CPU ms), the GPU
    synchronised after it."""
    engine.add_request(Request(rid, prompt, PARAMS))
    steps = []
    while True:
        start, cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append(((time.perf_counter() - start) * 1e3, (time.thread_time() - cpu) * 1e3))
        if any(out.request.request_id == rid and out.new_token_ids for out in outputs):
            while engine.has_unfinished():  # the overlapped loop's trailing step
                engine.step()
            return steps


def run_trial(variant: Variant, rid: str, prompt: list[int]) -> None:
    variant.engine.set_async_scheduling(variant.overlap)
    steps = one_request(variant.engine, rid, prompt)
    variant.totals.append(sum(wall for wall, _ in steps))
    variant.first_step.append(steps[0][0])
    variant.first_step_cpu.append(steps[0][1])


def profile_trial(variant: Variant, prompt: list[int]) -> None:
    variant.engine.set_async_scheduling(variant.overlap)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_request(variant.engine, f"profiled-{variant.name}", prompt)
    events = prof.key_averages()
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\n{variant.name}: profiled trial: {gpu_ms:.2f} ms of CUDA kernels; top host ops:")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]:
        print(f"  {e.key[:70]:<70} {e.self_cpu_time_total / 1e3:7.2f} ms {e.count:5d} calls")


def build(args: argparse.Namespace, prefill_graphs: bool) -> EngineCore:
    config = EngineConfig(
        model=f"random:{args.model}",
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_model_len=2048,
        num_kv_blocks=2048,  # two engines share the GPU
        max_prefill_graph_tokens=2048 if prefill_graphs else 0,
        enforce_eager=args.device != "cuda",
    )
    return EngineCore(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    graphs, eager = build(args, prefill_graphs=True), build(args, prefill_graphs=False)
    variants = [
        Variant("prefill graph, overlap", graphs, True),
        Variant("prefill graph, simple loop", graphs, False),
        Variant("eager prefill, overlap", eager, True),
        Variant("eager prefill, simple loop", eager, False),
    ]
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, 49152) for _ in range(args.prompt_len)]

    for i in range(3):
        for v in variants:
            run_trial(v, f"warm-{i}", prompt())
    for v in variants:
        v.totals.clear()
        v.first_step.clear()
        v.first_step_cpu.clear()
    for i in range(args.trials):
        for v in variants:
            run_trial(v, f"trial-{i}", prompt())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\n{args.model}, {args.prompt_len}-token prompt, {args.trials} trials per variant, ")
    print(f"variants alternating; {cpus} CPUs usable, load average {os.getloadavg()}")
    print(f"{'variant':<30} {'first token':>12} {'prefill step wall':>18} {'its thread CPU':>15}")
    for v in variants:
        total, wall = statistics.median(v.totals), statistics.median(v.first_step)
        cpu = statistics.median(v.first_step_cpu)
        print(f"{v.name:<30} {total:9.2f} ms {wall:15.2f} ms {cpu:12.2f} ms")
    for v in variants:
        profile_trial(v, prompt())
    print(f"\ncommand: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
