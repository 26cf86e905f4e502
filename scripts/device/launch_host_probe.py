"""Host time of one decode step's launch (prepare, forward, sample, to_host) in process.

The engine core's step stats time each phase, but their CUDA events and timers cost host time
of their own (about as much again at batch 64). This probe times ``ModelRunner.launch`` alone,
with no step stats: an in-process engine on random weights (CUDA graphs and overlap on), every
request added at once, the median over ``--steps`` steady decode steps. ``--profile`` adds a
cProfile of the launches after that (its own overhead included), sorted by own time.

    python scripts/device/launch_host_probe.py --batch 64 [--model smollm2-135m] [--profile]

On the GPU machine from the repository root.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.processes import freeze_startup_heap, spread_young_collections  # noqa: E402
from engine_core.config import EngineConfig  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.request import Request  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402


class TimedLaunch:
    """Wraps the runner's ``launch``: times every call, and profiles it while ``profile``."""

    def __init__(self, launch: Callable[..., Any]) -> None:
        self.launch = launch
        self.seconds: list[float] = []
        self.profiler = cProfile.Profile()
        self.profile = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.profile:
            self.profiler.enable()
        start = time.perf_counter()
        result = self.launch(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        if self.profile:
            self.profiler.disable()
        return result

    def median_ms(self) -> float:
        ordered = sorted(self.seconds)
        return ordered[len(ordered) // 2] * 1e3


def decoding_engine(model: str, batch: int, max_tokens: int) -> EngineCore:
    """An in-process engine on a preset's random weights (CUDA graphs and overlap on; the
    collector set as the engine process sets it) with ``batch`` requests added: 128 random
    prompt tokens, greedy, ``max_tokens`` each, EOS ignored. Also used by decode_timeline.py."""
    config = EngineConfig(
        model=f"random:{model}",
        device="cuda",
        max_model_len=4096,
        block_size=16,
        num_kv_blocks=2 * batch * 40,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
    )
    core = EngineCore(config)
    freeze_startup_heap()  # as the engine process runs, before any request comes
    spread_young_collections()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for i in range(batch):
        core.add_request(Request(f"r{i}", [rng.randrange(1000) for _ in range(128)], params))
    return core


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset (random weights)")
    parser.add_argument("--batch", type=int, default=64, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=100, help="steady steps timed")
    parser.add_argument("--profile", action="store_true", help="then cProfile as many steps")
    args = parser.parse_args(argv)
    core = decoding_engine(args.model, args.batch, 3 * args.steps + 40)
    timed = TimedLaunch(core.runner.launch)
    core.runner.launch = timed
    for _ in range(30):  # the prefill and the first decode steps
        core.step()
    timed.seconds.clear()
    for _ in range(args.steps):
        core.step()
    print(f"{args.model} batch {args.batch}: launch median {timed.median_ms():.3f} ms "
          f"over {args.steps} steps (no profiler)")  # fmt: skip
    if args.profile:
        timed.profile = True
        for _ in range(args.steps):
            core.step()
        out = io.StringIO()
        pstats.Stats(timed.profiler, stream=out).sort_stats("tottime").print_stats(35)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
