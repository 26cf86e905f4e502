"""The first prefills of each length after start-up, against the same lengths again, in an
in-process engine configured as ``tandem serve`` configures it (issue 17: the first long
prompts after start-up took 50-250 ms steps where later ones took a few):

    python scripts/device/first_prefill_probe.py [--model smollm2-135m]
        [--lengths 3000,3000,2048,2048,...] [--profile] [--tensor-parallel-size 2]

Each length runs as one request of fresh random tokens (no prefix-cache hit) with one token out;
the figure is the time from ``add_request`` until the request finished (its first token, in
process). Beside it: the device memory the caching allocator asked the driver for
(``cudaMalloc``) during it. ``--profile`` records the first measured prefill with the torch
profiler (warmed on a one-token prompt first, so CUPTI's own start-up is not in it) and prints
the host's CUDA calls and the GPU's kernels by time. Set ``CUDA_MODULE_LOADING=EAGER`` in the
environment to load every kernel module at start-up instead of at first use.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.presets import PRESETS  # noqa: E402
from engine_core.request import Request  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

DEFAULT_LENGTHS = "3000,3000,2048,2048,700,700,3900,3900,1500,1500,128,128"


def first_token_ms(core: EngineCore, rng: random.Random, length: int, tag: str) -> float:
    """One fresh prompt of ``length`` tokens, one token out; ms until it finished."""
    vocab = core.model_config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(length)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    core.add_request(Request(tag, prompt, params))
    while core.has_unfinished():
        core.step()
    return (time.perf_counter() - start) * 1e3


def device_allocs() -> int:
    """How many times the caching allocator has called cudaMalloc so far."""
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


def print_profile(prof: torch.profiler.profile) -> None:
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=14))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=10))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset (random weights)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths, in order")
    parser.add_argument("--profile", action="store_true", help="profile the first prefill")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs for the model")
    args = parser.parse_args(argv)
    loading = os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy)")
    print(f"# python {' '.join([sys.argv[0], *argv])}  CUDA_MODULE_LOADING={loading}", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    max_len = min(16384, PRESETS[args.model].max_position_embeddings)
    start = time.perf_counter()
    config = EngineConfig(
        model=f"random:{args.model}",
        max_model_len=max_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    core = EngineCore(config)
    print(f"start-up {time.perf_counter() - start:.1f} s", flush=True)
    rng = random.Random(7)
    budget = core.config.max_num_batched_tokens
    lengths = [int(n) for n in args.lengths.split(",")]
    for i, length in enumerate(lengths):
        allocs = device_allocs()
        if args.profile and i == 0:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as warm:
                first_token_ms(core, rng, 1, "p")
            del warm
            with torch.profiler.profile(activities=activities) as prof:
                ms = first_token_ms(core, rng, length, f"r{i}")
        else:
            ms = first_token_ms(core, rng, length, f"r{i}")
        steps = -(-length // budget)
        print(
            f"prompt {length:>6} tokens ({steps} step(s)): {ms:8.1f} ms, "
            f"cudaMalloc calls {device_allocs() - allocs}",
            flush=True,
        )
        if args.profile and i == 0:
            print_profile(prof)
    core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
