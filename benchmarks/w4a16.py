"""`w4a16`: the W4A16 GEMM's tile configurations swept on a GPU, beside bf16.

    python -m benchmarks w4a16 --model llama-8b --rows 1,8,32,64,256,2048

For each projection of the preset (qkv, o, gate/up, down) and each row count M: µs a call of
bf16 (cuBLAS, ``x @ W.T``), the engine's choice (``choose_tiles``), the dequantize-then-cuBLAS
path, and the GEMM kernel at each tile
configuration of a small grid (column tile, warps, pipelining stages, K split), with each one's
largest error relative to the output's largest value against the dequantized reference. Groups
of 128 columns, no zero points (as most GPTQ checkpoints), float32 scales as layers hold them.

Each call is timed inside a CUDA graph of 20 calls (the decode steps replay graphs, so launch
gaps are not counted), cycling through copies of the weights that exceed the L2, median of 5
replays. A configuration that fails to compile or run is printed and skipped. ``--budget``
(seconds, default 170) stops the grid early, keeping the fixed columns, so the sweep stays
under about 4 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gemm import projection_shapes
from benchmarks.report import Provenance, fmt, format_table, write_json

GROUP = 128
CALLS_PER_GRAPH = 20


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset (default: llama-8b)")
    parser.add_argument("--rows", default="1,8,32,64,256,2048", help="row counts M")
    parser.add_argument("--projections", default="gate_up,down,qkv,o", help="which projections")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the grid")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu only to check the script (TRITON_INTERPRET=1)"
    )


# ---- timing -------------------------------------------------------------------------------------


def graph_us(call: Callable[[int], Any], copies: int, device: str) -> float:
    """µs per call of ``call(i)``, captured CALLS_PER_GRAPH times (copy i % copies) in one CUDA
    graph: the median of 5 replays over the calls (on the CPU: one call's wall time)."""
    import torch

    if device == "cpu":
        start = time.perf_counter()
        call(0)
        return (time.perf_counter() - start) * 1e6

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            call(i % copies)  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(i % copies)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(times)


def relative_error(got: Any, expected: Any) -> float:
    return float((got.float() - expected).abs().max() / expected.abs().max())


# ---- one projection -----------------------------------------------------------------------------


class Projection:
    """One [N, K] weight in each form, copied past the L2, and its dequantized reference."""

    def __init__(self, n: int, k: int, device: str) -> None:
        import torch

        from engine_core.models.w4a16 import dequantize, pack_int4, tile_qweight

        self.n, self.k, self.device = n, k, device
        self.group = GROUP if k % GROUP == 0 else 64  # smollm2's K = 576
        l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
        loaded = pack_int4(torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8))
        scales = torch.rand(k // self.group, n, device=device) * 0.002 + 0.001
        self.reference_weight = dequantize(loaded, scales, None, self.group).bfloat16().float()
        tiled = tile_qweight(loaded)
        w4_bytes = loaded.numel() * 4 + scales.numel() * 4
        self.copies_w4 = max(1, -(-2 * l2 // w4_bytes))
        self.tiled = [tiled] + [tiled.clone() for _ in range(self.copies_w4 - 1)]
        self.scales = [scales] + [scales.clone() for _ in range(self.copies_w4 - 1)]
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        self.copies_bf16 = max(1, -(-2 * l2 // (n * k * 2)))
        self.dense = [dense] + [dense.clone() for _ in range(self.copies_bf16 - 1)]


def fixed_forms(p: Projection, x: Any, sms: int) -> dict[str, Callable[[int], Any]]:
    """The columns every row count gets: bf16, the engine's choice, the dequantize-then-cuBLAS
    path."""
    from engine_core.models import w4a16_kernels as wk

    chosen = wk.choose_tiles(x.shape[0], p.n, p.k, p.group, sms)
    return {
        "bf16": lambda i: x @ p.dense[i].t(),
        f"engine {describe(chosen)}": lambda i: wk.run_w4a16(
            x, p.tiled[i], p.scales[i], None, p.group, chosen
        ),
        "dequantize+cuBLAS": lambda i: wk.run_w4a16(
            x, p.tiled[i], p.scales[i], None, p.group, None
        ),
    }


def grid(m: int, k: int) -> list[Any]:
    """The kernel configurations swept at M rows: the row tile M needs, column tiles of 32-128,
    4 or 8 warps, 1-3 stages, and for decode K splits up to 16."""
    from engine_core.models.w4a16_kernels import TILE_K, Tiles

    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    blocks = -(-k // TILE_K)
    splits = [s for s in (1, 2, 4, 8, 16) if s <= blocks // 2 or s == 1] if m <= 64 else [1]
    shapes = [(32, 4, 2), (64, 4, 2), (64, 4, 1), (64, 4, 3), (128, 4, 2), (128, 8, 2)]
    return [
        Tiles(block_m, block_n, split, warps, stages)
        for (block_n, warps, stages), split in itertools.product(shapes, splits)
    ]


def describe(tiles: Any) -> str:
    if tiles is None:
        return "dequantize+cuBLAS"
    return f"m{tiles.block_m} n{tiles.block_n} s{tiles.split_k} w{tiles.warps} st{tiles.stages}"


def measure(name: str, p: Projection, m: int, sms: int, deadline: float) -> list[dict[str, Any]]:
    """Every form and configuration at M rows of one projection; failures printed, skipped."""
    import torch

    from engine_core.models import w4a16_kernels as wk

    x = torch.randn(m, p.k, device=p.device, dtype=torch.bfloat16)
    expected = x.float() @ p.reference_weight.t()
    forms = fixed_forms(p, x, sms)
    if time.monotonic() < deadline:
        for tiles in grid(m, p.k):
            forms[f"kernel {describe(tiles)}"] = lambda i, t=tiles: wk.run_w4a16(
                x, p.tiled[i], p.scales[i], None, p.group, t
            )
    results = []
    for form, call in forms.items():
        if form.startswith("kernel ") and time.monotonic() > deadline:
            print(f"  {name} M={m}: budget spent, the rest of the grid skipped", flush=True)
            break
        copies = p.copies_bf16 if form == "bf16" else p.copies_w4
        try:
            error = relative_error(call(0), expected) if form != "bf16" else None
            us = graph_us(call, copies, p.device)
        except Exception as exc:  # one configuration failing must not end the sweep
            print(f"  FAILED {name} M={m} {form}: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        row = {"projection": name, "n": p.n, "k": p.k, "rows": m, "form": form, "us": us}
        results.append(row | {"error": error})
        print(f"  {name} M={m} {form}: {us:.1f} us, error {fmt(error, '.1e')}", flush=True)
    return results


# ---- the report ---------------------------------------------------------------------------------


def summary(results: list[dict[str, Any]]) -> list[list[str]]:
    """One line per projection and row count: the fixed columns and the grid's best."""
    lines = []
    keys = sorted({(r["projection"], r["rows"]) for r in results}, key=lambda t: (t[1], t[0]))
    for projection, m in keys:
        rows = [r for r in results if r["projection"] == projection and r["rows"] == m]
        by_form = {r["form"]: r for r in rows}
        engine = next((r for r in rows if r["form"].startswith("engine ")), None)
        swept = [r for r in rows if r["form"].startswith("kernel ")]
        best = min(swept, key=lambda r: r["us"]) if swept else None
        bf16 = by_form.get("bf16", {}).get("us")
        lines.append(
            [
                projection, str(m), fmt(bf16, ".1f"),
                fmt(engine and engine["us"], ".1f"), engine["form"][7:] if engine else "-",
                fmt(by_form.get("dequantize+cuBLAS", {}).get("us"), ".1f"),
                fmt(best and best["us"], ".1f"), best["form"][7:] if best else "-",
                fmt(bf16 / engine["us"] if engine and bf16 else None, ".2f"),
                fmt(max((r["error"] for r in rows if r["error"] is not None), default=None), ".1e"),
            ]
        )  # fmt: skip
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    print(Provenance.here(args.argv).format(), flush=True)
    deadline = time.monotonic() + args.budget
    sms = torch.cuda.get_device_properties(0).multi_processor_count if args.device == "cuda" else 4
    rows = [int(r) for r in args.rows.split(",")]
    shapes = projection_shapes(args.model)
    results = []
    for name in args.projections.split(","):
        projection = Projection(*shapes[name], args.device)
        for m in rows:
            results += measure(name, projection, m, sms, deadline)
        del projection
        if args.device == "cuda":
            torch.cuda.empty_cache()
    headers = ["projection", "M", "bf16 us", "engine us", "engine tiles", "deq+cuBLAS",
               "best us", "best tiles", "bf16/engine", "max error"]  # fmt: skip
    print()
    print(format_table(headers, summary(results)))
    if args.json:
        write_json(args.json, Provenance.here(args.argv), {"results": results})
    return 0
