"""Paged decode attention on the GPU: how close ``paged_decode_attention`` reads the KV cache to
the HBM bandwidth, over head sizes, batch sizes and context lengths.

    python scripts/device/decode_attention_bench.py [--baseline FILE] [--sweep] [--json OUT]

Each point builds a paged cache (block size 16, bf16 and FP8 e4m3) whose blocks are handed to
the sequences in random order, every sequence ``context`` tokens long, and block tables as wide
as an engine with ``max_model_len = max(4096, context)`` gives its CUDA graphs (the split count
is chosen from that width, as in the engine). It captures a CUDA graph of many calls, each with
its own block table over one large cache, so that the calls of one replay read at least
``--working-set-mib`` of distinct cache bytes (more than the 50 MB L2) like a model's layers do,
and reports the time per call and

    GB/s = (K and V bytes of the context + q + out bytes) / time,

with its share of the bandwidth of a large device-to-device copy measured in the same run.
(Calls that read only a few MB are latency-bound: their GB/s says how far they are from
streaming, not that HBM is slow.)

``--baseline FILE`` loads another copy of engine_core/attention/triton_kernels.py (for example
``git show HEAD:engine_core/attention/triton_kernels.py``) and times it on the same caches, side
by side. ``--sweep`` times launch shapes (tokens per iteration, kv heads per program, warps,
pipeline stages) and forced split counts at a few points, to tune ``_DECODE_TILES`` and the
split policy (``--no-grid`` skips the grid).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.attention import triton_kernels as new_kernels  # noqa: E402
from engine_core.attention.triton_kernels import DecodeTile  # noqa: E402

# (query heads, kv heads, head dim) of the benchmark presets (DESIGN.md).
MODELS = {"llama-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
BATCHES = [1, 32, 64, 256]
CONTEXTS = [128, 512, 2048, 4096]
LONG_CONTEXT, LONG_CONTEXT_MAX_BATCH = 8192, 32
PAGE = 16  # EngineConfig.block_size's default
SCALES = (0.5, 2.0)  # FP8 k_scale, v_scale

SWEEP_POINTS = [(64, 512), (256, 512), (64, 2048), (32, 4096), (1, 8192)]  # (batch, context)
SWEEP_MODELS = ["llama-1b", "llama-8b"]
# (tokens per iteration, kv heads per program); (num_warps, num_stages); forced split counts.
SWEEP_TILE_ROWS = [(64, 1), (128, 1), (16, 4), (32, 2), (64, 2), (128, 2), (32, 4), (64, 4)]
SWEEP_SHAPES = [(2, 3), (4, 2), (4, 3)]
SWEEP_SPLITS = [1, 2, 4, 16, 64]


@dataclass
class Point:
    model: str
    dtype: str
    batch: int
    context: int
    kv_bytes: int  # K and V bytes one call reads
    io_bytes: int  # q and out bytes
    calls: int  # calls per graph replay (distinct block tables)


@dataclass
class Timing:
    kernel: str  # "old", "new" or a sweep label
    us: float  # per call
    gb_s: float
    pct_bw: float
    num_splits: int | None = None
    max_err: float | None = None  # against the baseline's output, when there is one


class PagedCase:
    """One point's cache, block tables, queries and outputs on the GPU."""

    def __init__(self, model: str, dtype: str, batch: int, context: int, args: Any) -> None:
        heads, kv_heads, head_dim = MODELS[model]
        self.elem = torch.empty(0, dtype=DTYPES[dtype]).element_size()
        blocks_per_seq = -(-context // PAGE)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * self.elem
        working_set = args.working_set_mib * 2**20
        self.tables = max(1, min(args.max_tables, -(-working_set // kv_bytes)))
        num_blocks = self.tables * batch * blocks_per_seq
        width = -(-max(context, args.table_tokens) // PAGE)
        self.k_cache = random_cache((num_blocks, PAGE, kv_heads, head_dim), DTYPES[dtype])
        self.v_cache = random_cache((num_blocks, PAGE, kv_heads, head_dim), DTYPES[dtype])
        order = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
        self.block_tables = torch.zeros(
            (self.tables, batch, width), dtype=torch.int32, device="cuda"
        )  # [tables, B, width]
        self.block_tables[:, :, :blocks_per_seq] = order.view(self.tables, batch, blocks_per_seq)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")  # [B]
        qshape = (self.tables, batch, heads, head_dim)
        self.q = torch.randn(qshape, dtype=torch.bfloat16, device="cuda")  # [tables, B, H, D]
        self.out = torch.empty_like(self.q)  # [tables, B, H, D]
        self.scale = head_dim**-0.5
        self.scales = SCALES if dtype == "fp8" else (1.0, 1.0)
        calls = max(self.tables, args.min_calls)
        io_bytes = 2 * batch * heads * head_dim * 2
        self.point = Point(model, dtype, batch, context, kv_bytes, io_bytes, calls)

    def call(self, module: ModuleType, i: int, **kwargs: Any) -> None:
        t = i % self.tables
        module.paged_decode_attention(
            self.q[t],
            self.k_cache,
            self.v_cache,
            self.block_tables[t],
            self.seq_lens,
            self.scale,
            out=self.out[t],
            k_scale=self.scales[0],
            v_scale=self.scales[1],
            **kwargs,
        )


def random_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache [num_blocks, PAGE, kv_heads, head_dim] of unit normals in ``dtype``."""
    if dtype == torch.bfloat16:
        return torch.empty(shape, dtype=dtype, device="cuda").normal_()
    cache = torch.empty(shape, dtype=dtype, device="cuda")
    for chunk in cache.split(4096):  # e4m3 through a bf16 temporary a slice at a time
        chunk.copy_(torch.empty(chunk.shape, dtype=torch.bfloat16, device="cuda").normal_())
    return cache


def time_graph(case: PagedCase, fn: Callable[[int], None], budget_s: float) -> float:
    """Microseconds per call: a CUDA graph of ``calls`` calls (one per block table), replayed."""
    fn(0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(case.point.calls):  # warm the graph pool's allocations
            fn(i)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(case.point.calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    first_ms = max(start.elapsed_time(end), 1e-3)
    replays = max(3, min(200, int(budget_s * 1e3 / first_ms)))
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * case.point.calls))
    del graph
    return statistics.median(samples)


def timing(case: PagedCase, label: str, us: float, bandwidth: float, splits: int | None) -> Timing:
    gb_s = (case.point.kv_bytes + case.point.io_bytes) / (us * 1e-6) / 1e9
    return Timing(label, us, gb_s, 100 * gb_s * 1e9 / bandwidth, splits)


def default_splits(module: ModuleType, case: PagedCase) -> int:
    """The split count the module picks for this point's shapes (before this change one program
    took one kv head; now the tuned tile says how many)."""
    p = case.point
    heads, kv_heads, head_dim = MODELS[p.model]
    programs = kv_heads
    if hasattr(module, "decode_tile"):
        grid = []  # the batch-dependent tile, where the module has one
        if hasattr(module, "decode_grid"):
            grid = [module.decode_grid(p.batch, kv_heads, torch.device("cuda")), kv_heads]
        elif hasattr(module, "is_wide_grid"):  # a baseline from before the sparse tile
            grid = [module.is_wide_grid(p.batch, kv_heads, torch.device("cuda"))]
        tile = module.decode_tile(head_dim, p.dtype == "fp8", *grid)
        programs //= module._kv_per_program(tile.kv_per_program, kv_heads, heads // kv_heads)
    width = case.block_tables.shape[2] * PAGE
    device = torch.device("cuda")
    if not hasattr(module, "default_min_split"):  # a baseline from before the starved minimum
        return module.choose_num_splits(p.batch, programs, width, device)
    min_split = module.default_min_split(p.batch, programs, device)
    return module.choose_num_splits(p.batch, programs, width, device, min_split)


def measure_bandwidth() -> float:
    """Bytes per second (read + written) of a 2 GiB device-to-device copy, median of 10."""
    n = 2 * 2**30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def load_baseline(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # triton.jit reads the source through the module
    spec.loader.exec_module(module)
    return module


def grid_points(models: list[str], dtypes: list[str]) -> list[tuple[str, str, int, int]]:
    points = []
    for model, dtype, batch in itertools.product(models, dtypes, BATCHES):
        contexts = [*CONTEXTS, LONG_CONTEXT] if batch <= LONG_CONTEXT_MAX_BATCH else CONTEXTS
        points += [(model, dtype, batch, context) for context in contexts]
    return points


def run_grid(args: Any, bandwidth: float, baseline: ModuleType | None) -> list[dict[str, Any]]:
    """Old (when given) and new kernel at every point of the grid, on the same caches."""
    rows = []
    for model, dtype, batch, context in grid_points(args.models, args.dtypes):
        case = PagedCase(model, dtype, batch, context, args)
        timings = []
        if baseline is not None:
            us = time_graph(case, functools.partial(case.call, baseline), args.budget_s)
            ref = case.out.clone()
            timings.append(timing(case, "old", us, bandwidth, default_splits(baseline, case)))
        us = time_graph(case, functools.partial(case.call, new_kernels), args.budget_s)
        new = timing(case, "new", us, bandwidth, default_splits(new_kernels, case))
        if baseline is not None:
            new.max_err = (case.out.float() - ref.float()).abs().max().item()
        timings.append(new)
        rows.append({"point": asdict(case.point), "timings": [asdict(t) for t in timings]})
        print(format_row(case.point, timings), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def sweep_tiles() -> list[DecodeTile]:
    return [
        DecodeTile(block_n, warps, stages, kpp)
        for block_n, kpp in SWEEP_TILE_ROWS
        for warps, stages in SWEEP_SHAPES
    ]


def run_sweep(args: Any, bandwidth: float, baseline: ModuleType | None) -> list[dict[str, Any]]:
    """Every sweep tile at every forced split count that leaves each split >= block_n tokens;
    the baseline (when given) and the new defaults at each point for comparison."""
    rows, started = [], time.perf_counter()
    for model, dtype, (batch, context) in itertools.product(
        args.sweep_models, args.dtypes, args.sweep_points
    ):
        case = PagedCase(model, dtype, batch, context, args)
        _, kv_heads, _ = MODELS[model]
        for label, module in (("old", baseline), ("new", new_kernels)):
            if module is not None:
                us = time_graph(case, functools.partial(case.call, module), args.budget_s)
                t = timing(case, label, us, bandwidth, default_splits(module, case))
                rows.append({"point": asdict(case.point), "timing": asdict(t)})
        for tile in sweep_tiles():
            for splits in SWEEP_SPLITS:
                too_many = batch * kv_heads * splits > 16384 or context // splits < tile.block_n
                if too_many or time.perf_counter() - started > args.sweep_budget_s:
                    continue
                kwargs = {"tile": tile, "num_splits": splits, "min_split_tokens": tile.block_n}
                try:
                    fn = functools.partial(case.call, new_kernels, **kwargs)
                    us = time_graph(case, fn, args.budget_s / 3)
                except Exception as exc:  # out of shared memory or registers: skip the shape
                    print(f"  skip {tile} S={splits}: {type(exc).__name__}", flush=True)
                    break
                label = tile_label(tile)
                t = timing(case, label, us, bandwidth, splits)
                rows.append({"point": asdict(case.point), "timing": asdict(t)})
        print_sweep_point(case.point, rows)
        del case
        torch.cuda.empty_cache()
    print(f"sweep took {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def tile_label(tile: DecodeTile) -> str:
    return f"n{tile.block_n}k{tile.kv_per_program}w{tile.num_warps}s{tile.num_stages}"


def print_sweep_point(point: Point, rows: list[dict[str, Any]]) -> None:
    mine = [r["timing"] for r in rows if r["point"] == asdict(point)]
    mine.sort(key=lambda t: -t["gb_s"])
    best_by_splits: dict[int, dict[str, Any]] = {}
    for t in mine:
        best_by_splits.setdefault(t["num_splits"], t)
    head = f"{point.model} {point.dtype} B={point.batch} ctx={point.context}"
    for t in mine:
        if t["kernel"] in ("old", "new"):
            head += f" | {t['kernel']} S={t['num_splits']} {t['us']:.1f} us {t['pct_bw']:.0f}%"
    top = ", ".join(f"{t['kernel']}/S{t['num_splits']} {t['pct_bw']:.0f}%" for t in mine[:5])
    per_s = ", ".join(
        f"S{s}:{t['pct_bw']:.0f}%({t['kernel']})" for s, t in sorted(best_by_splits.items())
    )
    print(f"{head}\n  top: {top}\n  by splits: {per_s}", flush=True)


def summarize_sweep(rows: list[dict[str, Any]]) -> None:
    """Per (head dim, dtype): each tile's geometric mean over the points of its best split's
    share of the point's best, so one tile can be picked for all points."""
    groups: dict[tuple[str, str], dict[tuple[int, int], dict[str, float]]] = {}
    for r in rows:
        p, t = r["point"], r["timing"]
        key = (p["model"], p["dtype"])
        best = groups.setdefault(key, {}).setdefault((p["batch"], p["context"]), {})
        best[t["kernel"]] = max(best.get(t["kernel"], 0.0), t["gb_s"])
    for (model, dtype), points in groups.items():
        tiles = set.intersection(*(set(b) for b in points.values()))
        scores = {
            tile: math.exp(
                statistics.mean(math.log(b[tile] / max(b.values())) for b in points.values())
            )
            for tile in tiles
        }
        ranked = sorted(scores.items(), key=lambda kv: -kv[1])
        print(f"{model} {dtype}: " + ", ".join(f"{k} {v:.3f}" for k, v in ranked))


def format_row(point: Point, timings: list[Timing]) -> str:
    cells = " | ".join(
        f"{t.us:8.1f} us {t.gb_s:6.0f} GB/s {t.pct_bw:4.0f}% S={t.num_splits}" for t in timings
    )
    ratio = f" | x{timings[0].us / timings[-1].us:.2f}" if len(timings) > 1 else ""
    err = f" | err {timings[-1].max_err:.1e}" if timings[-1].max_err is not None else ""
    return (
        f"{point.model:13s} {point.dtype:4s} B={point.batch:<4d} ctx={point.context:<5d} "
        f"{point.kv_bytes / 2**20:8.1f} MiB | {cells}{ratio}{err}"
    )


def print_table(rows: list[dict[str, Any]], bandwidth: float) -> None:
    """The grid as a Markdown table: old and new GB/s and % of the copy bandwidth."""
    has_old = len(rows[0]["timings"]) > 1
    print(f"\n{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    cols = "us | GB/s (%)"
    if has_old:
        cols = "old us | old GB/s (%) | new us | new GB/s (%) | speed-up"
    print(f"| model | KV | batch | context | KV MiB | {cols} |")
    print("|---|---|---:|---:|---:|" + "---:|" * (5 if has_old else 2))
    for r in rows:
        p, ts = r["point"], r["timings"]
        cells = [f"{t['us']:.1f} | {t['gb_s']:.0f} ({t['pct_bw']:.0f}%)" for t in ts]
        if has_old:
            cells.append(f"{ts[0]['us'] / ts[1]['us']:.2f}x")
        print(
            f"| {p['model']} | {p['dtype']} | {p['batch']} | {p['context']} "
            f"| {p['kv_bytes'] / 2**20:.1f} | " + " | ".join(cells) + " |"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, default=None, help="old triton_kernels.py")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--sweep", action="store_true", help="tune tiles and split counts")
    parser.add_argument("--no-grid", dest="grid", action="store_false")
    parser.add_argument("--sweep-budget-s", type=float, default=240.0)
    parser.add_argument(
        "--sweep-points",
        default=",".join(f"{b}x{c}" for b, c in SWEEP_POINTS),
        help="BATCHxCONTEXT,... the sweep times (default: %(default)s)",
    )
    parser.add_argument("--sweep-models", default=",".join(SWEEP_MODELS))
    parser.add_argument("--budget-s", type=float, default=0.03, help="timed replays per sample")
    parser.add_argument("--working-set-mib", type=int, default=256)
    parser.add_argument("--max-tables", type=int, default=128)
    parser.add_argument("--min-calls", type=int, default=8)
    parser.add_argument("--table-tokens", type=int, default=4096, help="block table width")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.dtypes = args.dtypes.split(",")
    args.sweep_models = args.sweep_models.split(",")
    args.sweep_points = [
        tuple(int(v) for v in point.split("x")) for point in args.sweep_points.split(",")
    ]
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    bandwidth = measure_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    result: dict[str, Any] = {"argv": sys.argv, "bandwidth": bandwidth}
    result["device"] = torch.cuda.get_device_name()
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.sweep:
        result["sweep"] = run_sweep(args, bandwidth, baseline)
        summarize_sweep(result["sweep"])
    if args.grid:
        result["grid"] = run_grid(args, bandwidth, baseline)
        print_table(result["grid"], bandwidth)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
