"""Prefill attention over the paged cache at the FP8 benchmark's prefill steps (issue 18), on the
GPU machine:

    python scripts/device/prefill_attention_bench.py [--json OUT]

llama-8b's heads (32 query, 8 kv, head dim 128), two steps of bench_fp8.py: 4 prompts of 3,800
tokens (the long workload) and 8 of 2,048 (the prefill workload), with a bf16 and an e4m3 cache
(scales 1.0), the prompts' K/V already in the cache as the engine writes them first. Each launch
shape of the sweep (keys per iteration, warps, stages) is timed over 10 calls after 2, and its
output compared with the default shape's. Prints ms per call and causal TFLOP/s (QK and PV, 4
flops per query, key and head dimension).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.attention import triton_kernels  # noqa: E402
from engine_core.attention.prefill_tiles import device_tiles  # noqa: E402
from engine_core.attention.triton_kernels import PrefillLaunch, paged_prefill_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
STEPS = {"long 4x3800": (4, 3800), "prefill 8x2048": (8, 2048)}
SWEEP = [PrefillLaunch(bn, w, st) for bn in (32, 64) for w in (4, 8) for st in (2, 3)] + [
    PrefillLaunch(128, 8, 2)
]


def case(prompts: int, length: int, dtype: torch.dtype) -> dict[str, Any]:
    tokens = prompts * length
    blocks_per_seq = -(-length // PAGE)
    num_blocks = prompts * blocks_per_seq
    shape = (num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(dtype)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(dtype)
    order = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    starts = [i * length for i in range(prompts + 1)]
    return {
        "q": torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        "k": k,
        "v": v,
        "bt": order.view(prompts, blocks_per_seq),
        "sl": torch.full((prompts,), length, device="cuda", dtype=torch.int32),
        "qsl": torch.tensor(starts, device="cuda", dtype=torch.int32),
        "tiles": device_tiles(starts, torch.device("cuda")),
        "flops": prompts * 4 * (length * (length + 1) / 2) * HEAD_DIM * HEADS,
        "length": length,
    }


def run(c: dict[str, Any], launch: PrefillLaunch) -> torch.Tensor:
    return paged_prefill_attention(
        c["q"], c["k"], c["v"], c["bt"], c["sl"], c["qsl"], c["length"], HEAD_DIM**-0.5,
        tiles=c["tiles"], launch=launch,
    )  # fmt: skip


def time_ms(fn: Any) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for step, (prompts, length) in STEPS.items():
        for cache, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            rows += sweep(case(prompts, length, dtype), step, cache)
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def sweep(c: dict[str, Any], step: str, cache: str) -> list[dict[str, Any]]:
    default = triton_kernels.prefill_launch(HEAD_DIM, cache == "fp8")
    ref = run(c, default).float()
    rows = []
    for launch in SWEEP:
        try:
            diff = (run(c, launch).float() - ref).abs().max().item()
            ms = time_ms(lambda launch=launch: run(c, launch))
        except Exception as exc:  # out of shared memory or registers: skip the shape
            print(f"  skip {launch}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        tflops = c["flops"] / ms / 1e9
        rows.append({"step": step, "cache": cache, "launch": str(launch), "ms": ms,
                     "tflops": tflops, "max_abs_diff": diff})  # fmt: skip
    print_best(rows, default)
    return rows


def print_best(rows: list[dict[str, Any]], default: PrefillLaunch) -> None:
    mine = sorted(rows, key=lambda r: r["ms"])
    shown = mine[:5] + [r for r in mine[5:] if r["launch"] == str(default)]
    for r in shown:
        mark = " (default)" if r["launch"] == str(default) else ""
        head = f"{r['step']:15} {r['cache']:4} {r['launch']:60}"
        print(f"{head} {r['ms']:7.2f} ms {r['tflops']:6.1f} TFLOP/s "
              f"diff {r['max_abs_diff']:.1e}{mark}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
