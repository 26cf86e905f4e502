"""FP8 GEMMs at decode sizes inside CUDA graphs (issue 18): how fast each streams llama-8b's
projection weights at M = 16, 64 and 128 tokens.

    python scripts/device/fp8_skinny_bench.py [--json OUT]

Variants, each timed as a CUDA graph of LAYERS calls over distinct weights (more bytes than the
L2 holds, as a model's layers are): the bf16 matmul; ``torch._scaled_mm`` row-wise
(``fp8_rowwise_gemm``, today's path); the same with the operands swapped (weights as the first
operand, so cuBLASLt tiles the long side) plus the transposing copy back; and the Triton
``fp8_skinny_gemm`` over a sweep of launch shapes (N tile, K tile, K splits, pipeline stages).
Each FP8 result's error is given against the float32 product of the dequantized operands.
``fp8_rowwise_gemm (as dispatched)`` is what the engine runs: the skinny kernel's default shape
up to SKINNY_MAX_ROWS, cuBLASLt above. Prints microseconds per GEMM and the weight
TB/s, the best shape per (projection, M), and per M the sum over a layer's four projections.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.models.fp8_kernels import (  # noqa: E402
    fp8_rowwise_gemm,
    fp8_skinny_gemm,
    quantize_per_token,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 8
# (block_n, block_k, split_k, num_stages, num_warps)
SWEEP = [
    (bn, bk, sk, st, 4)
    for bn, bk, sk, st in itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (3, 5))
] + [  # 512-wide K tiles, 8 warps, 32-row N tiles (twice the programs)
    (64, 512, 1, 2, 4), (64, 512, 1, 3, 4), (64, 256, 1, 5, 8), (128, 256, 1, 4, 8),
    (32, 256, 1, 5, 4), (32, 256, 2, 5, 4), (32, 512, 1, 3, 4),
]  # fmt: skip


def time_graph(fn: Callable[[int], object], replays: int = 20) -> float:
    """Microseconds per call of a graph of LAYERS calls fn(0..LAYERS-1)."""
    return time_graph_calls(lambda: [fn(i) for i in range(LAYERS)], LAYERS, replays)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn(), run once on a side stream first (as torch asks before a capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph_calls(
    fn: Callable[[], object], calls: int, replays: int = 20, warmup: int = 3, rounds: int = 5
) -> float:
    """Microseconds per call of a CUDA graph of fn(), which makes ``calls`` calls: the median
    of ``rounds`` timings of ``replays`` replays each, after ``warmup`` replays."""
    graph = capture_graph(fn)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / calls)
    return statistics.median(times)


def cublas(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's row-wise FP8 GEMM, as fp8_rowwise_gemm ran every M before the skinny kernel
    (it now dispatches small M to that kernel, so the column calls _scaled_mm itself)."""
    return torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16
    )


def swapped(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """_scaled_mm with the weights first: [N, M], then the copy to [M, N]."""
    out = torch._scaled_mm(
        w, xq.t(), scale_a=ws.reshape(-1, 1), scale_b=xs.reshape(1, -1), out_dtype=torch.bfloat16
    )
    return out.t().contiguous()


def bench_shape(name: str, n: int, k: int, m: int, sweep: list[tuple[int, ...]]) -> list[dict]:
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    ws = [w.float().abs().amax(1) / 448 for w in w16]
    w8 = [(w.float() / s[:, None]).to(torch.float8_e4m3fn) for w, s in zip(w16, ws, strict=True)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_per_token(x)
    ref = (xq.float() * xs) @ (w8[0].float() * ws[0][:, None]).T  # [M, N] float32
    rows = []

    def record(variant: str, us: float, weight_bytes: int, err: float | None = None) -> None:
        row = {"shape": name, "m": m, "variant": variant, "us": us,
               "tb_s": weight_bytes / us / 1e6, "max_rel_err": err}  # fmt: skip
        rows.append(row)

    record("bf16", time_graph(lambda i: x @ w16[i].T), 2 * n * k)
    err = (cublas(xq, xs, w8[0], ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
    record("scaled_mm", time_graph(lambda i: cublas(xq, xs, w8[i], ws[i])), n * k, err)
    us = time_graph(lambda i: fp8_rowwise_gemm(xq, xs, w8[i], ws[i], x.dtype))
    record("fp8_rowwise_gemm (as dispatched)", us, n * k)
    err = (swapped(xq, xs, w8[0], ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
    record("scaled_mm swapped", time_graph(lambda i: swapped(xq, xs, w8[i], ws[i])), n * k, err)
    for bn, bk, sk, st, nw in sweep:
        if k % (bk * sk):
            continue
        kwargs = dict(block_n=bn, block_k=bk, split_k=sk, num_stages=st, num_warps=nw)
        try:
            got = fp8_skinny_gemm(xq, xs, w8[0], ws[0], torch.bfloat16, **kwargs).float()
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            us = time_graph(
                lambda i, kw=kwargs: fp8_skinny_gemm(xq, xs, w8[i], ws[i], x.dtype, **kw)
            )
        except Exception as exc:  # out of shared memory: skip the shape
            print(f"  skip {kwargs}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        record(f"skinny n{bn} k{bk} s{sk} st{st} w{nw}", us, n * k, err)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--ms", default="64,16,128")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    results: list[dict[str, Any]] = []
    best_configs: dict[str, list[tuple[int, ...]]] = {}
    for m in (int(v) for v in args.ms.split(",")):
        for name, (n, k) in SHAPES.items():
            # The full sweep at the first M; later Ms try that M's five best shapes per projection.
            sweep = best_configs.get(name, SWEEP)
            rows = bench_shape(name, n, k, m, sweep)
            torch.cuda.empty_cache()  # the shape's weights are gone with its frame
            results += rows
            rows.sort(key=lambda r: r["us"])
            skinny = [r for r in rows if r["variant"].startswith("skinny")]
            if name not in best_configs:
                best_configs[name] = [parse(r["variant"]) for r in skinny[:5]]
            for r in rows[:6] + [r for r in rows if not r["variant"].startswith("skinny")]:
                err = "" if r["max_rel_err"] is None else f" err {r['max_rel_err']:.1e}"
                print(f"{name:8} M={m:<4} {r['variant']:32} {r['us']:7.1f} us "
                      f"{r['tb_s']:5.2f} TB/s{err}", flush=True)  # fmt: skip
        summarize(results, m)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def parse(variant: str) -> tuple[int, ...]:
    """'skinny n64 k128 s2 st3 w4' -> (64, 128, 2, 3, 4)."""
    return tuple(int(part.lstrip("nkstw")) for part in variant.split()[1:])


def summarize(results: list[dict[str, Any]], m: int) -> None:
    """Per M: a layer's four projections, each variant's sum (the best skinny shape each)."""
    mine = [r for r in results if r["m"] == m]
    totals = {}
    for variant in ("bf16", "scaled_mm", "scaled_mm swapped", "fp8_rowwise_gemm (as dispatched)"):
        totals[variant] = sum(r["us"] for r in mine if r["variant"] == variant)
    totals["skinny (best each)"] = sum(
        min(r["us"] for r in mine if r["shape"] == s and r["variant"].startswith("skinny"))
        for s in SHAPES
    )
    print(f"M={m} layer total: " + ", ".join(f"{k} {v:.1f} us" for k, v in totals.items()))


if __name__ == "__main__":
    main()
