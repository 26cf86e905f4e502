"""`w4a16`: the W4A16 products beside bf16 on a GPU, and a sweep of their tiles.

    python -m benchmarks w4a16                      # llama-8b, M = 1, 16, 64
    python -m benchmarks w4a16 --sweep              # the same, and each kernel's tile grid

For each projection of the preset (qkv, o, gate/up, down) and each row count M: µs a call of
bf16 (cuBLAS, ``x @ W.T``), the tensor-core kernel at the tiles its rule picks (the decode
path before the CUDA-core kernel), the engine's choice (``choose_tiles``: the CUDA-core kernel
up to GEMV_ROWS rows), the dequantize-then-cuBLAS path, and the engine's bytes per second (the
packed words, scales and zeros a call reads) against ``--hbm-tb-s`` (default 4.8). Groups of 128
columns with zero points (AWQ's and asymmetric GPTQ's; the most bytes), float32 scales as
layers hold them. Each form's largest error relative to the output's largest value against the
dequantized reference is printed beside it.

``--sweep`` adds every configuration of both kernels' grids (column tile, row tile, warps,
pipelining stages, K split) and prints the fastest per shape, then the lines of
``w4a16_kernels.MEASURED`` that would make the engine pick them: one GPU call tunes and measures.

Each call is timed inside a CUDA graph of 20 calls (the decode steps replay graphs, so launch
gaps are not counted), cycling through copies of the weights that exceed the L2, median of 5
replays. A configuration that fails to compile or run is printed and skipped. ``--budget``
(seconds, default 170), shared evenly by the shapes, stops each shape's grid early, keeping the
fixed columns, so the sweep stays under about 4 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gemm import graph_us, projection_shapes, relative_error
from benchmarks.report import Provenance, fmt, format_table, write_json

GROUP = 128


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset (default: llama-8b)")
    parser.add_argument("--rows", default="1,16,64", help="row counts M")
    parser.add_argument("--sweep", action="store_true", help="also time each kernel's tile grid")
    parser.add_argument(
        "--hbm-tb-s", type=float, default=4.8, help="the memory bandwidth to compare against"
    )
    parser.add_argument("--projections", default="gate_up,down,qkv,o", help="which projections")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the grid")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu only to check the script (TRITON_INTERPRET=1)"
    )


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
        groups = k // self.group
        scales = torch.rand(groups, n, device=device) * 0.002 + 0.001
        zeros = torch.randint(0, 16, (groups, n), device=device, dtype=torch.uint8)
        self.reference_weight = dequantize(loaded, scales, zeros, self.group).bfloat16().float()
        tiled = tile_qweight(loaded)
        self.w4_bytes = tiled.numel() * 4 + scales.numel() * 4 + zeros.numel()
        self.copies_w4 = max(1, -(-2 * l2 // self.w4_bytes))
        self.tiled = [tiled] + [tiled.clone() for _ in range(self.copies_w4 - 1)]
        self.scales = [scales] + [scales.clone() for _ in range(self.copies_w4 - 1)]
        self.zeros = [zeros] + [zeros.clone() for _ in range(self.copies_w4 - 1)]
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        self.copies_bf16 = max(1, -(-2 * l2 // (n * k * 2)))
        self.dense = [dense] + [dense.clone() for _ in range(self.copies_bf16 - 1)]

    def product(self, x: Any, tiles: Any) -> Callable[[int], Any]:
        """The W4A16 product of copy i at the given tiles (None: dequantize, then cuBLAS)."""
        from engine_core.models import w4a16_kernels as wk

        return lambda i: wk.run_w4a16(
            x, self.tiled[i], self.scales[i], self.zeros[i], self.group, tiles
        )


def tensor_core_tiles(m: int, n: int, k: int, sms: int) -> Any:
    """The tensor-core kernel's tiles by its rule: the decode path before the CUDA-core one."""
    from engine_core.models import w4a16_kernels as wk

    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return wk.Tiles(block_m, 128, wk.split_k(m, n, k, block_m, 128, sms))


def fixed_forms(p: Projection, x: Any, sms: int) -> dict[str, Callable[[int], Any]]:
    """The columns every row count gets: bf16, the tensor-core kernel, the engine's choice, the
    dequantize-then-cuBLAS path."""
    from engine_core.models import w4a16_kernels as wk

    m = x.shape[0]
    chosen = wk.choose_tiles(m, p.n, p.k, p.group, sms)
    forms = {"bf16": lambda i: x @ p.dense[i].t()}
    if m < wk.DEQUANTIZE_ROWS:
        forms["tensor cores"] = p.product(x, tensor_core_tiles(m, p.n, p.k, sms))
    forms[f"engine {describe(chosen)}"] = p.product(x, chosen)
    forms["dequantize+cuBLAS"] = p.product(x, None)
    return forms


def grid(m: int, n: int, k: int, sms: int) -> list[Any]:
    """The configurations swept at M rows, nearest the rule's K split first (so a budget that runs
    out has timed the likeliest). The tensor-core kernel (under 128 rows): the row tile M needs,
    column tiles of 32-256, 4 or 8 warps, 1-3 stages, the weights as the left operand (swapped) or
    the right, or the slices joined into one product a block (``Tiles.joined``; first, so that a
    budget running out has timed it). The CUDA-core kernel (up to 8 rows): a program per row or a
    row tile of all M, column tiles of 64-256 (fewer for a row tile: its registers grow with rows x
    columns), 4 or 8 warps, 1 or 2 stages. Both with K splits up to 16 while a split keeps 2
    blocks."""
    from engine_core.models.w4a16_kernels import TILE_K, GemvTiles, Tiles, row_bucket, rule_tiles

    blocks = -(-k // TILE_K)
    splits = [s for s in (1, 2, 4, 8, 16) if s <= blocks // 2 or s == 1] if m <= 64 else [1]
    configs: list[Any] = []
    if m <= 8:
        configs += [
            GemvTiles(block_m, block_n, split, warps, stages)
            for block_m, block_n, warps, stages, split in itertools.product(
                sorted({1, row_bucket(m)}), (64, 128, 256), (4, 8), (1, 2), splits
            )
            if block_m * block_n <= 256
        ]
    if m < 128:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        # The joined kernel first, so a budget that runs out has timed it (its column tile:
        # 64 a warp group of 4 warps, where the weights stay in registers).
        joined = [(64, 4, 2, True, True), (64, 4, 3, True, True), (128, 8, 2, True, True),
                  (128, 8, 3, True, True)]  # fmt: skip
        swapped = [(32, 4, 2), (64, 4, 2), (64, 4, 1), (64, 4, 3), (128, 4, 2), (128, 8, 2)]
        plain = [(64, 4, 2), (128, 4, 2), (128, 8, 3), (256, 8, 2)]
        shapes = joined + [(*s, True, False) for s in swapped] + [(*s, False, False) for s in plain]
        configs += [
            Tiles(block_m, block_n, split, warps, stages, swap, joined)
            for (block_n, warps, stages, swap, joined), split in itertools.product(shapes, splits)
        ]
    rule = rule_tiles(m, n, k, sms).split_k
    return sorted(configs, key=lambda t: abs(t.split_k.bit_length() - rule.bit_length()))


def describe(tiles: Any) -> str:
    if tiles is None:
        return "dequantize+cuBLAS"
    if type(tiles).__name__ == "GemvTiles":
        kind = "gemv"
    else:
        kind = "mma-joined" if tiles.joined else "mma" if tiles.swap else "mma-ab"
    return (
        f"{kind} m{tiles.block_m} n{tiles.block_n} s{tiles.split_k} w{tiles.warps} st{tiles.stages}"
    )


def measure(
    name: str, p: Projection, m: int, sms: int, deadline: float, sweep: bool
) -> list[dict[str, Any]]:
    """Every form (and, with ``sweep``, configuration) at M rows of one projection; failures
    printed, skipped."""
    import torch

    x = torch.randn(m, p.k, device=p.device, dtype=torch.bfloat16)
    expected = x.float() @ p.reference_weight.t()
    forms = fixed_forms(p, x, sms)
    tiles_of = {}
    if sweep:
        for tiles in grid(m, p.n, p.k, sms):
            form = f"kernel {describe(tiles)}"
            forms[form], tiles_of[form] = p.product(x, tiles), tiles
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
        results.append(row | {"error": error, "tiles": tiles_of.get(form)})
        print(f"  {name} M={m} {form}: {us:.1f} us, error {fmt(error, '.1e')}", flush=True)
    return results


# ---- the report ---------------------------------------------------------------------------------


def summary(
    results: list[dict[str, Any]], w4_bytes: dict[str, int], hbm_bytes_s: float
) -> list[list[str]]:
    """One line per projection and row count: the fixed columns, the engine's bytes per second,
    and the grid's best."""
    lines = []
    keys = sorted({(r["projection"], r["rows"]) for r in results}, key=lambda t: (t[1], t[0]))
    for projection, m in keys:
        rows = [r for r in results if r["projection"] == projection and r["rows"] == m]
        by_form = {r["form"]: r for r in rows}
        engine = next((r for r in rows if r["form"].startswith("engine ")), None)
        best = fastest(rows)
        bf16 = by_form.get("bf16", {}).get("us")
        gbs = w4_bytes[projection] / engine["us"] / 1e3 if engine else None
        lines.append(
            [
                projection, str(m), fmt(bf16, ".1f"),
                fmt(by_form.get("tensor cores", {}).get("us"), ".1f"),
                fmt(engine and engine["us"], ".1f"), engine["form"][7:] if engine else "-",
                fmt(gbs, ",.0f"), fmt(gbs and gbs * 1e9 / hbm_bytes_s, ".0%"),
                fmt(bf16 / engine["us"] if engine and bf16 else None, ".2f"),
                fmt(by_form.get("dequantize+cuBLAS", {}).get("us"), ".1f"),
                fmt(best and best["us"], ".1f"), best["form"][7:] if best else "-",
                fmt(max((r["error"] for r in rows if r["error"] is not None), default=None), ".1e"),
            ]
        )  # fmt: skip
    return lines


def fastest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    swept = [r for r in rows if r["tiles"] is not None]
    return min(swept, key=lambda r: r["us"]) if swept else None


def measured_table(results: list[dict[str, Any]]) -> list[str]:
    """The sweep's fastest choice as lines of ``w4a16_kernels.MEASURED``, by (row bucket, N, K):
    the fastest tiles, or None where dequantizing, then cuBLAS beat them."""
    from engine_core.models.w4a16_kernels import row_bucket

    lines = []
    for n, k, m in sorted({(r["n"], r["k"], r["rows"]) for r in results}):
        rows = [r for r in results if (r["n"], r["k"], r["rows"]) == (n, k, m)]
        best = fastest(rows)
        dequantized = next((r for r in rows if r["form"] == "dequantize+cuBLAS"), None)
        key = f"({row_bucket(m)}, {n}, {k})"
        if dequantized is not None and (best is None or dequantized["us"] < best["us"]):
            tiles = f" against the tiles' {best['us']:.1f}" if best else ""
            lines.append(f"    {key}: None,  # dequantize+cuBLAS {dequantized['us']:.1f} us{tiles}")
        elif best is not None:
            lines.append(f"    {key}: {best['tiles']!r},")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    print(Provenance.here(args.argv).format(), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if args.device == "cuda" else 4
    rows = [int(r) for r in args.rows.split(",")]
    shapes = projection_shapes(args.model)
    names = args.projections.split(",")
    per_shape = args.budget / (len(names) * len(rows))  # the grid's time for each shape
    results, w4_bytes = [], {}
    for name in names:
        projection = Projection(*shapes[name], args.device)
        w4_bytes[name] = projection.w4_bytes
        for m in rows:
            deadline = time.monotonic() + per_shape
            results += measure(name, projection, m, sms, deadline, args.sweep)
        del projection
        if args.device == "cuda":
            torch.cuda.empty_cache()
    headers = ["projection", "M", "bf16 us", "tensor-core us", "engine us", "engine tiles",
               "engine GB/s", "of HBM", "bf16/engine", "deq+cuBLAS", "best us",
               "best tiles", "max error"]  # fmt: skip
    print()
    print(format_table(headers, summary(results, w4_bytes, args.hbm_tb_s * 1e12)))
    if args.sweep:
        print("\nw4a16_kernels.MEASURED, from this sweep:")
        print("\n".join(measured_table(results)))
    if args.json:
        for r in results:
            r["tiles"] = describe(r["tiles"]) if r["tiles"] is not None else None
        write_json(args.json, Provenance.here(args.argv), {"results": results})
    return 0
