"""Triton compilations after a warm-up, and the steps that took far longer than the median, in
an in-process engine on the GPU machine (issue 17: what stalls a running batch):

    python scripts/device/compile_watch.py [--model smollm2-135m] [--batch 64]
        [--quantization fp8] [--kv-cache-dtype fp8]

A compilation mid-serving stalls every running request for as long as it takes (85-104 ms for
a small kernel on an H100 with an empty Triton cache, 2-3 ms to load it from a warm one). The
engine (bench_decode.py's configuration, random weights, CUDA graphs) runs the decode
benchmark's warm-up (``--batch`` prompts of 128 tokens, 16 tokens out). Then, with Triton's
``jit_cache_hook`` recording every kernel it has to build, three phases of new sizes:

- decode: ``--batch`` prompts of 128 tokens to 728 tokens of context (block tables 9 to 46
  wide);
- mixed prompts: 48 prompts of 1 to 3,000 tokens (prefill graphs, eager and chunked prefills),
  greedy and sampled, 1 to 40 tokens out;
- cached prompts: 16 of them again (prefix-cache hits).

For each phase it prints the steps slower than three times the median (and 3 ms) and the
garbage collections of 1 ms or more, then every compilation with its phase and step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode  # noqa: E402

from engine_core.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.request import Request  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402


class CompileLog:
    """Every Triton compilation and every garbage collection of 1 ms or more, with the phase
    and step the engine was in."""

    def __init__(self) -> None:
        self.phase = "start-up"
        self.step = -1
        self.entries: list[tuple[str, int, str]] = []
        self.collections: list[tuple[str, int, int, float]] = []  # phase, step, generation, ms
        self._gc_start = 0.0

    def hook(self, **info: Any) -> None:
        """Triton's jit_cache_hook: record, and return nothing (a true value skips the build)."""
        self.entries.append((self.phase, self.step, info["repr"][:160]))

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """gc.callbacks: time each collection."""
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_start) * 1e3
        if ms >= 1.0:
            self.collections.append((self.phase, self.step, info["generation"], round(ms, 1)))


def drive(core: EngineCore, log: CompileLog, phase: str, requests: list[Request]) -> None:
    """Add the requests, step until all finish, print the slow steps."""
    log.phase = phase
    for request in requests:
        core.add_request(request)
    ends = [time.perf_counter()]
    log.step = 0
    while core.has_unfinished():
        core.step()
        ends.append(time.perf_counter())
        log.step += 1
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(ends)]
    median = statistics.median(gaps)
    slow = [(i, round(g, 1)) for i, g in enumerate(gaps) if g > 3 * median and g > 3]
    print(f"{phase}: {len(gaps)} steps, median {median:.3f} ms, slow steps (step, ms) {slow[:12]}")
    pauses = [(step, gen, ms) for p, step, gen, ms in log.collections if p == phase]
    print(f"  collections of 1 ms or more (step, generation, ms): {pauses[:12]}")


def prompts(rng: random.Random, vocab: int, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset (random weights)")
    parser.add_argument("--batch", type=int, default=64, help="requests decoding together")
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_METHODS, default=None, help="weights in FP8"
    )
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    args = parser.parse_args(argv)
    print("# python " + " ".join([sys.argv[0], *argv]), flush=True)
    log = CompileLog()
    triton.knobs.runtime.jit_cache_hook = log.hook
    gc.callbacks.append(log.on_gc)
    work = bench_decode.Workload(args.batch, 128, 700, 0)
    config = dataclasses.replace(
        bench_decode.engine_config(args.model, work, "cuda", enforce_eager=False),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    core = EngineCore(config)
    vocab = core.model_config.vocab_size
    print(f"start-up: {len(log.entries)} compilations")
    rng = random.Random(5)
    with bench_decode.serving_collector():
        warmup = bench_decode.Workload(args.batch, 128, 256, 0).shorter(16, seed=1)
        bench_decode.run_inproc(core, warmup, vocab, "warmup")
        warm = len(log.entries)
        decode = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
        batch = prompts(rng, vocab, [128] * args.batch)
        drive(core, log, "decode", [Request(f"d{i}", p, decode) for i, p in enumerate(batch)])
        lengths = [1, 15, 16, 17, 100, 255, 256, 257, 1000, 2047, 2048, 2049, 3000]
        mixed = []
        for i, prompt in enumerate(prompts(rng, vocab, [rng.choice(lengths) for _ in range(48)])):
            params = SamplingParams(
                max_tokens=rng.choice([1, 2, 16, 40]),
                temperature=rng.choice([0.0, 0.8]),
                ignore_eos=True,
            )
            mixed.append(Request(f"m{i}", prompt, params))
        drive(core, log, "mixed prompts", mixed)
        again = [
            Request(f"c{i}", r.prompt_token_ids[:], r.params) for i, r in enumerate(mixed[:16])
        ]
        drive(core, log, "cached prompts", again)
    print(f"compilations after the warm-up: {len(log.entries) - warm}")
    for phase, step, kernel in log.entries[warm:]:
        print(f"  {phase}, step {step}: {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
