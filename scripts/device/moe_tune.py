"""Sweep the fused-MoE tile sizes on the GPU at qwen3-30b-a3b's layer shape (128 experts, top 8,
hidden 2048, expert width 768, bf16; uniform random routing, then routing skewed onto --hot
experts) and print, per token count, the best settings, their time per layer and the bandwidth
of the expert bytes they read.

    python scripts/device/moe_tune.py [--tokens 1,64,256,4096] [--json OUT]
    python scripts/device/moe_tune.py --align-only

``--align-only`` times just the grouping step (align) per token count, the torch ops against the
one-launch kernel, each with the fused layer after it at the default tiles.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.models import fused_moe as moe_module  # noqa: E402
from engine_core.models.fused_moe import Blocks, align, block_sizes, fused_moe  # noqa: E402

E, K, H, INTER = 128, 8, 2048, 768
EXPERT_BYTES = 3 * H * INTER * 2


def time_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def sweep(t: int, w13: torch.Tensor, w2: torch.Tensor, hot: int) -> dict:
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, E, device="cuda")
    if hot:  # skewed routing: only ``hot`` experts, the first ones far more often
        logits[:, hot:] = -torch.inf
        logits[:, :hot] += torch.linspace(4.0, 0.0, hot, device="cuda")
    weights, ids = torch.softmax(logits, -1).topk(K, -1)
    ids = ids.to(torch.int32)
    touched = ids.unique().numel()
    default = block_sizes(t * K, E, INTER)
    ms_align = time_ms(lambda: align(ids, E, default.m))
    ms_default = time_ms(lambda: fused_moe(x, w13, w2, weights, ids))
    ms_by = {}
    per_expert = t * K / E
    rows = [16, 32, 64] if per_expert <= 64 else [64, 128]
    grid = itertools.product(rows, (32, 64, 128), (64, 128), (4, 8), (3, 4))
    for m, n, k, warps, stages in grid:
        b = Blocks(m, n, k, warps, stages)
        try:
            ms_by[b] = time_ms(lambda b=b: fused_moe(x, w13, w2, weights, ids, b))
        except Exception as exc:  # noqa: BLE001 - out of shared memory, say
            print(f"  {b}: {type(exc).__name__}", flush=True)
    best = min(ms_by, key=ms_by.get)
    row = {
        "tokens": t, "hot": hot, "experts_touched": touched, "align_ms": ms_align,
        "default": str(default), "default_ms": ms_default, "best": str(best),
        "best_ms": ms_by[best],
        "best_expert_GBps": touched * EXPERT_BYTES / (ms_by[best] * 1e-3) / 1e9,
        "top5": [(str(b), v) for b, v in sorted(ms_by.items(), key=lambda kv: kv[1])[:5]],
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def align_only(tokens: list[int], w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Per token count (uniform routing): align's torch ops against its one launch, alone and
    with the fused layer after it (fused_moe with each align in turn)."""
    for t in tokens:
        times = time_aligns(t, w13, w2)
        print(f"tokens {t:5d}: align " + ", ".join(
            f"{name} {a * 1e3:.1f} us (layer {b * 1e3:.1f} us)" for name, (a, b) in times.items()
        ), flush=True)  # fmt: skip


def time_aligns(t: int, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, tuple[float, float]]:
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(t, E, device="cuda"), -1).topk(K, -1)
    ids = ids.to(torch.int32)
    m = block_sizes(t * K, E, INTER).m
    limit = moe_module.ALIGN_KERNEL_MAX_SLOTS
    times = {}
    for name, slots_limit in (("torch", 0), ("one launch", limit)):
        moe_module.ALIGN_KERNEL_MAX_SLOTS = slots_limit
        alone = time_ms(lambda: align(ids, E, m))
        layer = time_ms(lambda: fused_moe(x, w13, w2, weights, ids))
        times[name] = (alone, layer)
    moe_module.ALIGN_KERNEL_MAX_SLOTS = limit
    return times


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,64,256,4096")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--hot", type=int, default=40, help="also sweep routing skewed onto N experts")
    p.add_argument("--align-only", action="store_true", help="time only the grouping step")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    if args.align_only:
        align_only([int(t) for t in args.tokens.split(",")], w13, w2)
        return 0
    results = [sweep(int(t), w13, w2, hot) for hot in (0, args.hot) for t in args.tokens.split(",")]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(
        "| tokens | hot | experts touched | align ms | default ms | best ms | best | expert GB/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        print(
            f"| {r['tokens']} | {r['hot']} | {r['experts_touched']} | {r['align_ms']:.3f} | "
            f"{r['default_ms']:.3f} | {r['best_ms']:.3f} | {r['best']} | "
            f"{r['best_expert_GBps']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
