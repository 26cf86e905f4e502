"""Where a CPU engine step's time goes: the default model's decode step at several batch sizes.

    python scripts/profile_cpu.py [--batches 1,16,64] [--dtype float32] [--prompt-len 128]
                                  [--model default]

For each batch size, in this process (EngineCore, the offline path): admit that many random
prompts, run their prefill and a few decode steps, then time 30 decode steps (the median of three
windows of 10), with the engine's step stats (host ms per phase of a step), and profile 5 more
under ``torch.profiler``: the ops that took the most time, per step. Prints one summary line per
batch and the op table; nothing is written.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.request import Request  # noqa: E402
from engine_core.step_stats import format_summary  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

PROFILED_STEPS = 5


def decode_engine(batch: int, prompt_len: int, dtype: str, model: str) -> EngineCore:
    """An engine whose ``batch`` requests have all been prefilled and are decoding."""
    config = EngineConfig(
        model=model, dtype=dtype, max_model_len=2048, kv_cache_memory_gb=2, step_stats=True
    )
    engine = EngineCore(config)
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(min(100, vocab // 2), vocab) for _ in range(prompt_len)]
        engine.add_request(Request(f"profile-{i}", prompt, params))
    for _ in range(4):
        engine.step()
    return engine


def time_steps(engine: EngineCore, windows: int = 3, steps: int = 10) -> float:
    """Median over ``windows`` of the mean decode step time (ms) over ``steps`` steps."""
    means = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        means.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(means)


def profile_batch(batch: int, prompt_len: int, dtype: str, rows: int, model: str) -> None:
    engine = decode_engine(batch, prompt_len, dtype, model)
    engine.step_stats.reset()
    step_ms = time_steps(engine)
    phases = format_summary(engine.step_stats.summary())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
    threads = torch.get_num_threads()
    print(f"\n== decode, batch {batch}, {dtype}, {threads} threads: {step_ms:.1f} ms a step")
    print(f"   engine step stats: {phases}")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / PROFILED_STEPS / 1e3
    print(f"   ops: {total:.1f} ms of op time per step; the top {rows}:")
    for event in events[:rows]:
        per_step = event.self_cpu_time_total / PROFILED_STEPS / 1e3
        calls = event.count / PROFILED_STEPS
        print(f"   {event.key:<55} {per_step:8.2f} ms {calls:8.0f} calls/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8, help="ops listed per batch")
    parser.add_argument(
        "--model",
        default="default",
        help="what `tandem serve --model` takes; a tiny model leaves the host's own work per "
        "step in view (default: %(default)s)",
    )
    args = parser.parse_args()
    for batch in (int(b) for b in args.batches.split(",")):
        profile_batch(batch, args.prompt_len, args.dtype, args.rows, args.model)
    print(f"\ncommand: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
