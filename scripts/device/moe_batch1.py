"""Batch-1 decode pieces of qwen3-30b-a3b on the GPU, to tune what a one-token step launches.

    python scripts/device/moe_batch1.py [--json OUT]

1. The MoE layer for one token (128 experts, top 8, hidden 2048, expert width 768, bf16): the
   grouped path (``fused_moe`` with explicit blocks: align, two grouped GEMMs, combine) against
   the one-token path (``fused_moe_one_token``: no grouping) over a sweep of its tiles: gate/up
   tiles first (down at the default), then down tiles (gate/up at the best). Each timing is a
   CUDA graph of one call per layer over ``--layers`` layers' own weights (more bytes than the
   L2 holds, as in a model), with routing drawn afresh per layer; reported per call, with the
   bandwidth over the 8 experts' bytes it must read.
2. Paged decode attention at small batches and short contexts, qwen3-30b-a3b's heads (32 query,
   4 KV, head size 128) and llama-8b's, over ``min_split_tokens`` (the shortest context split):
   the engine's block-table width (4,096 tokens) fixes the split count, and the sequence's
   length decides how many splits do work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention_bench import MODELS, PagedCase, measure_bandwidth  # noqa: E402

from engine_core.attention import triton_kernels  # noqa: E402
from engine_core.models.fused_moe import (  # noqa: E402
    ONE_TOKEN_DOWN,
    ONE_TOKEN_GATE_UP,
    Blocks,
    block_sizes,
    fused_moe,
    fused_moe_one_token,
)

E, K, H, INTER = 128, 8, 2048, 768
EXPERT_BYTES = 3 * H * INTER * 2
MODELS["qwen3-30b-a3b"] = (32, 4, 128)


def time_calls(calls: list[Callable[[], Any]], replays: int = 50) -> float:
    """Microseconds per call: one CUDA graph of all the calls, replayed; median of 3."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(samples)


# Tile sweep: output columns, reduction step, (warps, pipeline stages); each GEMM in turn.
SWEEP = ([32, 64, 128], [64, 128], [(2, 4), (4, 3), (4, 4)])


def time_or_none(calls: list[Callable[[], Any]]) -> float | None:
    """time_calls, or None for tiles this GPU cannot launch (too much shared memory)."""
    try:
        return time_calls(calls)
    except triton.runtime.errors.OutOfResources as err:
        print(f"  skipped: {err}")
        return None


class MoELayers:
    """``n`` layers' experts, one token's input and routing per layer."""

    def __init__(self, n: int) -> None:
        self.w13 = [torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) / H**0.5
                    for _ in range(n)]  # fmt: skip
        self.w2 = [torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16) / INTER**0.5
                   for _ in range(n)]  # fmt: skip
        self.x = torch.randn(n, 1, H, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(n, E, device="cuda"), -1).topk(K, -1)
        self.weights = (weights / weights.sum(-1, keepdim=True)).view(n, 1, K)
        self.ids = ids.to(torch.int32).view(n, 1, K)

    def grouped(self) -> list[Callable[[], Any]]:
        blocks = block_sizes(K, E, INTER)
        return [
            lambda i=i: fused_moe(
                self.x[i], self.w13[i], self.w2[i], self.weights[i], self.ids[i], blocks=blocks
            )
            for i in range(len(self.w13))
        ]

    def one_token(self, gate_up: Blocks, down: Blocks) -> list[Callable[[], Any]]:
        return [
            lambda i=i: fused_moe_one_token(
                self.x[i], self.w13[i], self.w2[i], self.weights[i], self.ids[i], gate_up, down
            )
            for i in range(len(self.w13))
        ]


def moe_sweep(layers: MoELayers, bandwidth: float) -> dict[str, Any]:
    def report(label: str, us: float) -> dict[str, Any]:
        tb_s = K * EXPERT_BYTES / (us * 1e-6) / 1e12
        print(f"  {label:<58} {us:7.2f} us  {tb_s:5.2f} TB/s  {tb_s * 1e12 / bandwidth:5.1%}")
        return {"label": label, "us": us, "tb_s": tb_s}

    rows = [report("grouped (align, gate_up, down, combine)", time_calls(layers.grouped()))]
    want = fused_moe(layers.x[0], layers.w13[0], layers.w2[0], layers.weights[0], layers.ids[0],
                     blocks=block_sizes(K, E, INTER)).float()  # fmt: skip
    best_gu, best_down = ONE_TOKEN_GATE_UP, ONE_TOKEN_DOWN
    rows.append(report(f"one token, default {best_gu} / {best_down}",
                       time_calls(layers.one_token(best_gu, best_down))))  # fmt: skip
    best_us = rows[-1]["us"]
    for n, k, (warps, stages) in itertools.product(*SWEEP):
        tiles = Blocks(16, n, k, warps, stages)
        us = time_or_none(layers.one_token(tiles, best_down))
        if us is not None:
            rows.append(report(f"gate_up {tiles}", us))
            best_gu, best_us = (tiles, us) if us < best_us else (best_gu, best_us)
    for n, k, (warps, stages) in itertools.product(*SWEEP):
        tiles = Blocks(16, n, k, warps, stages)
        us = time_or_none(layers.one_token(best_gu, tiles))
        if us is not None:
            rows.append(report(f"down {tiles}", us))
            best_down, best_us = (tiles, us) if us < best_us else (best_down, best_us)
    got = fused_moe_one_token(layers.x[0], layers.w13[0], layers.w2[0], layers.weights[0],
                              layers.ids[0], best_gu, best_down).float()  # fmt: skip
    err = (got - want).abs().max().item()
    print(f"best one-token tiles: gate_up {best_gu}, down {best_down}: {best_us:.2f} us; "
          f"max |one token - grouped| {err:.3g}")  # fmt: skip
    best = {"gate_up": vars(best_gu), "down": vars(best_down)}
    return {"rows": rows, "best": best, "best_us": best_us, "max_err": err}


def attention_sweep(bandwidth: float) -> list[dict[str, Any]]:
    args = SimpleNamespace(working_set_mib=256, max_tables=128, min_calls=8, table_tokens=4096)
    rows = []
    for model, batch, context in itertools.product(
        ["qwen3-30b-a3b", "llama-8b"], [1, 4, 16], [128, 384, 1024, 4096]
    ):
        case = PagedCase(model, "bf16", batch, context, args)
        line = f"  {model:<14} batch {batch:>3} context {context:>5}:"
        for min_split in [32, 64, 128, 256]:
            calls = [
                lambda i=i, m=min_split, c=case: c.call(triton_kernels, i, min_split_tokens=m)
                for i in range(case.point.calls)
            ]
            us = time_calls(calls, replays=20)
            rows.append({"model": model, "batch": batch, "context": context,
                         "min_split": min_split, "us": us})  # fmt: skip
            line += f"  {min_split}: {us:6.2f} us"
        print(line, flush=True)
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    bandwidth = measure_bandwidth()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"MoE layer, one token, {args.layers} layers' weights in one graph:")
    moe = moe_sweep(MoELayers(args.layers), bandwidth)
    print("paged decode attention, bf16, us per call by min_split_tokens:")
    attention = attention_sweep(bandwidth)
    if args.json:
        args.json.write_text(json.dumps({"moe": moe, "attention": attention}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
