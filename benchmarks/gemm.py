"""`gemm`: one linear layer's product at a preset's projection shapes: bf16, W4A16 and W8A8, and
a sweep of the Triton W8A8 GEMM's tiles.

    python -m benchmarks gemm --model llama-8b --rows 1,16,64,2048
    python -m benchmarks gemm --rows 1,16,64,256,2048 --sweep    # and the W8A8 tile grid

For each projection of the preset (qkv, o, gate/up, down) and each row count M, the time of
``x [M, K] @ W.T`` four ways: bf16 (cuBLAS), W4A16 (the Triton kernel of
engine_core/models/w4a16_kernels.py, groups of 128), and W8A8 (per-token int8 activations by the
Triton quantizer of engine_core/models/w8a8_kernels.py, then either cuBLASLt's int8 product and
the scaling after it, ``w8a8 cuBLASLt``, or the Triton int8 GEMM with the scales in its epilogue,
``w8a8 triton``, at the tiles ``MEASURED`` holds for the shape, else the rule's). With ``--peer``
(vLLM importable, e.g. its install first on PYTHONPATH), two more forms time the peer's kernels
on the same shapes: ``vllm marlin`` (its W4A16 GEMM, the same symmetric groups of 128, weights
repacked by vLLM's own test utility) and ``vllm cutlass`` (its per-token int8 quantizer, then
CUTLASS's scaled int8 GEMM). Each call is
timed inside a CUDA graph of ``--iters`` calls (the engine replays graphs, so launch gaps are not
counted), median of 5 replays, cycling through copies of the weights that exceed the L2, so
every call reads its weights from HBM as in a model. The table: microseconds a call, the bytes a
call must read (weights, scales and zero points, activations) over that time, that rate as a
share of the measured copy bandwidth (roofline.py), and the call's speed against bf16's.

``--sweep`` adds the Triton W8A8 GEMM at every tile configuration of its grid (``--budget``
seconds in all, shared by the shapes, what one leaves going to the next; a configuration that
fails to compile or run, or whose output differs from cuBLASLt's bits, is printed and skipped)
and prints the lines of ``w8a8_kernels.MEASURED`` that make the engine take the fastest: tiles,
or None where cuBLASLt won. One GPU call tunes and measures; nothing is tuned at run time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.report import Provenance, fmt, format_table, write_json
from benchmarks.roofline import measure_bandwidth

if TYPE_CHECKING:
    from engine_core.models.w8a8_kernels import Tiles

GROUP = 128
CALLS_PER_GRAPH = 20
FORMS = ("bf16", "w4a16", "w8a8 cuBLASLt", "w8a8 triton")
PEER_FORMS = ("vllm marlin", "vllm cutlass")
FORM_ORDER = {form: i for i, form in enumerate(FORMS + PEER_FORMS)}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset (default: llama-8b)")
    parser.add_argument(
        "--rows", default="1,16,64,2048", help="row counts M (default: 1,16,64,2048)"
    )
    parser.add_argument(
        "--iters", type=int, default=CALLS_PER_GRAPH, help="calls in each timed CUDA graph"
    )
    parser.add_argument("--projections", default="qkv,o,gate_up,down", help="which projections")
    parser.add_argument("--sweep", action="store_true", help="also time the W8A8 GEMM's tiles")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the sweep")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--peer",
        action="store_true",
        help="also time vLLM's Marlin (W4A16) and CUTLASS (W8A8) kernels (vllm importable)",
    )


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the preset's attention and MLP products."""
    from engine_core.presets import hf_config

    hf = hf_config(model)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    kv = hf.get("num_key_value_heads", heads)
    inter = hf["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def median_us(call: Callable[[int], Any], copies: int, iters: int) -> float:
    """Median CUDA-event time of ``call(i)`` over ``iters`` eager calls cycling through the
    copies (launch gaps included)."""
    import torch

    for i in range(3):
        call(i % copies)
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(i % copies)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def graph_us(
    call: Callable[[int], Any], copies: int, device: str, calls: int = CALLS_PER_GRAPH
) -> float:
    """µs per call of ``call(i)``, captured ``calls`` times (copy i % copies) in one CUDA graph:
    the median of 5 replays over the calls (on the CPU: one call's wall time)."""
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
        for i in range(calls):
            call(i % copies)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


# ---- the weights and the products ----------------------------------------------------------------


def weights(n: int, k: int) -> dict[str, Any]:
    """One random weight of [N, K] in each of the three formats."""
    import torch

    from engine_core.models.int8 import quantize_rows
    from engine_core.models.w4a16 import pack_int4, tile_qweight

    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
    int8_weight, int8_scale = quantize_rows(dense.float())
    return {
        "bf16": dense,
        "w4a16": (
            tile_qweight(pack_int4(codes)),  # held on CUDA in the kernel's layout
            torch.rand(k // GROUP, n, device="cuda") * 0.01,  # float32, as layers hold them
            None,  # symmetric, as GPTQ checkpoints mostly are
        ),
        "w8a8": (int8_weight, int8_scale),
    }


def marlin_weight(dense: Any) -> tuple[Any, Any, Any]:
    """vLLM's Marlin layout of ``dense`` [N, K] in symmetric 4 bits (uint4b8), groups of 128, as
    its own tests build it: (words, scales, the dequantized weight [K, N] they mean)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
    from vllm.scalar_type import scalar_types

    meant, words, scales, _, _, _ = marlin_quantize(
        dense.t().contiguous(), scalar_types.uint4b8, GROUP, False
    )
    return words, scales, meant


def relative_error(got: Any, want: Any) -> float:
    """The largest difference from ``want`` over ``want``'s largest value."""
    return float((got.float() - want).abs().max() / want.abs().max())


def peer_stacks(one: dict[str, Any]) -> dict[str, tuple[list[Any], Any]]:
    """The peer's weights, copied past the L2, by form, with the dequantized weight [K, N] each
    means (None: the int8 product cuBLASLt gives); empty, with the reason printed, where vLLM
    cannot be imported."""
    try:
        words, scales, marlin_meant = marlin_weight(one["bf16"])
    except Exception as exc:  # not installed, or built for another torch: ours are still timed
        print(f"  --peer: vLLM's kernels unavailable ({type(exc).__name__}: {exc})", flush=True)
        return {}
    w8, scale = one["w8a8"]  # CUTLASS takes the row scales as a column
    return {
        "vllm marlin": (copies_past_l2((words, scales)), marlin_meant),
        "vllm cutlass": (copies_past_l2((w8, scale.reshape(-1, 1).contiguous())), None),
    }


def peer_product(form: str, n: int, k: int) -> Callable[[Any, Any], Any]:
    """vLLM's kernel for ``form``, called as its linear layers call it."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_workspace_new,
    )
    from vllm.scalar_type import scalar_types

    if form == "vllm cutlass":

        def cutlass(x: Any, w: Any) -> Any:
            x_q, x_scale, _ = ops.scaled_int8_quant(x)
            return ops.cutlass_scaled_mm(x_q, w[0].t(), x_scale, w[1], x.dtype)

        return cutlass
    workspace = marlin_make_workspace_new(torch.device("cuda"))
    no_order = torch.empty(0, dtype=torch.int, device="cuda")

    def marlin(x: Any, w: Any) -> Any:
        return ops.marlin_gemm(
            x, None, w[0], None, w[1], None, None, None, no_order, no_order, workspace,
            scalar_types.uint4b8, size_m=x.shape[0], size_n=n, size_k=k, is_k_full=True,
            use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False,
        )  # fmt: skip

    return marlin


def weight_bytes(w: Any) -> int:
    tensors = [t for t in w if t is not None] if isinstance(w, tuple) else [w]
    return sum(t.numel() * t.element_size() for t in tensors)


def copies_past_l2(w: Any) -> list[Any]:
    """``w`` and enough copies of it that the set is twice the L2: none is still cached when it
    comes round again."""
    import torch

    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(1, -(-2 * l2_bytes // weight_bytes(w)))
    return [w] + [_copy(w) for _ in range(copies - 1)]


def _copy(w: Any) -> Any:
    if not isinstance(w, tuple):
        return w.clone()
    return tuple(None if t is None else t.clone() for t in w)


def product(form: str, tiles: Any = None) -> Callable[[Any, Any], Any]:
    """``form``'s product of activations x and a weight in its format; ``tiles`` fixes the
    Triton W8A8 GEMM's launch (default: MEASURED's for the shape, else the rule's)."""
    import torch
    import torch.nn.functional as F

    from engine_core.models import w8a8_kernels as wk
    from engine_core.models.int8 import int_mm_product
    from engine_core.models.w4a16_kernels import w4a16_gemm

    if form == "bf16":
        return lambda x, w: F.linear(x, w)
    if form == "w4a16":
        return lambda x, w: w4a16_gemm(x, w[0], w[1], w[2], GROUP)
    if form == "w8a8 cuBLASLt":
        return lambda x, w: int_mm_product(*wk.quantize_per_token(x), w[0], w[1], x.dtype)

    def triton_w8a8(x: Any, w: Any) -> Any:
        (m, k), n = x.shape, w[0].shape[0]
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        launch = tiles or wk.choose_tiles(m, n, k, sms) or wk.rule_tiles(m, n, k, sms)
        return wk.int8_gemm(*wk.quantize_per_token(x), w[0], w[1], x.dtype, None, launch)

    return triton_w8a8


def sweep_grid(m: int, n: int, k: int, sms: int) -> list[Any]:
    """The Triton W8A8 GEMM's configurations at M rows. Decode rows: the row tile M needs (16, 32
    or 64), 32-256 weight rows and 128 or 256 columns of K a program, deep pipelines (the weights
    stream), K splits of 1-8 while a split keeps 2 K steps, nearest the rule's split first (so a
    budget that runs out has timed the likeliest). Prefill rows: first the persistent TMA kernel
    (a program a multiprocessor walking the tiles) at the large tiles, with its K loop
    warp-specialized and without, so a budget that runs out has timed the new form; then 64-256
    x 64-256 tiles, 64 or 128 columns of K, 3-5 stages as fit the shared memory (at most 200
    KiB), 4 or 8 warps, each with its tiles loaded by pointers and by TMA descriptors."""
    from engine_core.models.w8a8_kernels import Tiles, rule_tiles

    if m > 64:
        # Triton 3.6 warp-specializes on sm_90 at 4 warps only (a producer warp group and two
        # consumer groups: 12 warps run), and those tiles spill without it; 8 warps for the
        # persistent form without (benchmarks w8a8-compile: registers and shared memory).
        # Only the tiles measured exact on a GPU: a 64-column K tile gave wrong sums
        # (docs/design/quantization.md, "Warp specialization on Triton 3.6").
        ws = [(128, 256, 128, 4, 3), (128, 256, 128, 4, 4), (128, 128, 128, 4, 4)]
        plain = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4),
                 (128, 128, 128, 4, 4)]  # fmt: skip
        shapes = [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4),
                  (128, 256, 64, 8, 4), (64, 256, 128, 8, 3), (256, 128, 128, 8, 3),
                  (128, 128, 64, 4, 5), (64, 128, 128, 4, 4), (256, 256, 64, 8, 3)]  # fmt: skip
        return (
            [Tiles(*s, tma=True, persistent=True, ws=True) for s in ws]
            + [Tiles(*s, tma=True, persistent=True) for s in plain]
            + [Tiles(*s, tma=tma) for s in shapes for tma in (False, True)]
        )
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    shapes = [(64, 256, 4, 4), (64, 256, 4, 6), (128, 128, 4, 4), (128, 256, 4, 3),
              (128, 256, 8, 4), (256, 128, 8, 4), (32, 256, 4, 6)]  # fmt: skip
    configs = [
        Tiles(block_m, block_n, block_k, warps, stages, split_k=split, tma=tma)
        for block_n, block_k, warps, stages in shapes
        for split in (1, 2, 4, 8)
        for tma in (False, True)
        if k >= 2 * split * block_k
    ]
    rule = rule_tiles(m, n, k, sms).split_k
    return sorted(configs, key=lambda t: abs(t.split_k.bit_length() - rule.bit_length()))


def describe(tiles: Any) -> str:
    return (
        f"m{tiles.block_m} n{tiles.block_n} k{tiles.block_k} w{tiles.warps} st{tiles.stages}"
        f" g{tiles.group_m} s{tiles.split_k}{' tma' if tiles.tma else ''}"
        f"{' persistent' if tiles.persistent else ''}{' ws' if tiles.ws else ''}"
    )


# ---- measuring -----------------------------------------------------------------------------------


class Budget:
    """The sweep's seconds, shared by the shapes still to sweep: what one leaves (a grid whose
    kernels an earlier shape compiled runs faster) goes to the rest."""

    def __init__(self, seconds: float, shapes: int) -> None:
        self.seconds, self.shapes = seconds, shapes

    def deadline(self) -> float:
        """The next shape's deadline (time.monotonic), counted from now."""
        return time.monotonic() + self.seconds / max(1, self.shapes)

    def spent(self, seconds: float) -> None:
        self.seconds, self.shapes = max(0.0, self.seconds - seconds), self.shapes - 1


def measure(
    name: str,
    shape: tuple[int, int],
    rows: list[int],
    args: argparse.Namespace,
    hbm: float,
    budget: Budget,
) -> list[dict[str, Any]]:
    """Every form, and with ``--sweep`` every tile configuration, at every row count for one
    [N, K] weight."""
    import torch

    n, k = shape
    one = weights(n, k)
    stacks = {kind: copies_past_l2(one[kind]) for kind in ("bf16", "w4a16", "w8a8")}
    peer = peer_stacks(one) if args.peer else {}
    results = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        calls = {form: (product(form), stacks[form.split()[0]]) for form in FORMS}
        reference = product("w8a8 cuBLASLt")(x, stacks["w8a8"][0])
        for form, (stack, meant) in peer.items():  # a wrong call could be fast: show each right
            want = x.float() @ meant.float() if meant is not None else reference.float()
            try:
                call = peer_product(form, n, k)
                error = relative_error(call(x, stack[0]), want)
            except Exception as exc:  # the peer failing must not end our measurement
                print(f"  FAILED {name} M={m} {form}: {type(exc).__name__}: {exc}"[:400])
                continue
            calls[form] = (call, stack)
            print(f"  {name} M={m} {form}: error {error:.1e} against what it means", flush=True)
        for form, (call, stack) in calls.items():
            try:
                row = timed(form, call, stack, x, n, args.iters, hbm)
            except Exception as exc:
                if form not in PEER_FORMS:
                    raise
                print(f"  FAILED {name} M={m} {form}: {type(exc).__name__}: {exc}"[:400])
                continue  # the peer failing in its graph must not end our measurement
            results.append(row | {"tiles": None})
            print(f"  {name} M={m} {form}: {row['us']:.1f} us", flush=True)
        if args.sweep:
            results += sweep(name, x, stacks["w8a8"], reference, budget, args.iters, hbm)
        torch.cuda.empty_cache()
    return [r | {"projection": name} for r in results]


def timed(
    form: str, call: Callable[[Any, Any], Any], stack: list[Any], x: Any, n: int, iters: int,
    hbm: float,
) -> dict[str, Any]:  # fmt: skip
    """One form's time at x's rows, and the bytes a call reads over it."""
    m, k = x.shape
    us = graph_us(lambda i: call(x, stack[i]), len(stack), "cuda", iters)
    read = weight_bytes(stack[0]) + x.numel() * 2 + m * n * 2
    return {"form": form, "n": n, "k": k, "rows": m, "us": us, "gb_s": read / us / 1e3} | {
        "hbm_share": read / (us * 1e-6) / hbm
    }


def sweep(
    name: str, x: Any, stack: list[Any], reference: Any, budget: Budget, iters: int, hbm: float
) -> list[dict[str, Any]]:
    """The Triton W8A8 GEMM at each configuration of the grid at x's rows, within this shape's
    share of the budget; a configuration that fails, or differs from cuBLASLt's bits, is
    printed and skipped."""
    import torch

    start, deadline = time.monotonic(), budget.deadline()
    (m, k), n = x.shape, stack[0][0].shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    results = []
    for tiles in sweep_grid(m, n, k, sms):
        if time.monotonic() > deadline:
            print(f"  {name} M={m}: budget spent, the rest of the grid skipped", flush=True)
            break
        call = product("w8a8 triton", tiles)
        label = f"{name} M={m} {describe(tiles)}"
        try:
            exact = torch.equal(call(x, stack[0]), reference)
            row = timed("w8a8 " + describe(tiles), call, stack, x, n, iters, hbm)
        except Exception as exc:  # one configuration failing must not end the sweep
            print(f"  FAILED {label}: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        if not exact:
            print(f"  WRONG {label}: output differs from cuBLASLt's", flush=True)
            continue
        print(f"  {label}: {row['us']:.1f} us", flush=True)
        results.append(row | {"tiles": tiles})
    budget.spent(time.monotonic() - start)
    return results


# ---- the report ----------------------------------------------------------------------------------


def measured_table(results: list[dict[str, Any]]) -> list[str]:
    """The sweep's fastest choice as lines of ``w8a8_kernels.MEASURED`` by (row bucket, N, K):
    the fastest tiles, or None where cuBLASLt beat them."""
    from engine_core.models.w8a8_kernels import row_bucket

    lines = []
    for n, k, m in sorted({(r["n"], r["k"], r["rows"]) for r in results}):
        rows = [r for r in results if (r["n"], r["k"], r["rows"]) == (n, k, m)]
        swept = [r for r in rows if r["tiles"] is not None]
        cublaslt = next((r for r in rows if r["form"] == "w8a8 cuBLASLt"), None)
        if not swept or cublaslt is None:
            continue
        best = min(swept, key=lambda r: r["us"])
        key = f"({row_bucket(m)}, {n}, {k})"
        if cublaslt["us"] < best["us"]:
            us = f"cuBLASLt {cublaslt['us']:.1f} us, the tiles' {best['us']:.1f}"
            lines.append(f"    {key}: None,  # {us}")
        else:
            lines.append(f"    # {best['us']:.1f} us")
            lines.append(f"    {key}: {tiles_source(best['tiles'])},")
    return lines


def tiles_source(tiles: Tiles) -> str:
    """``tiles`` as MEASURED's source writes it: the block shape, then only the fields that
    differ from their defaults (a line within the project's width)."""
    import dataclasses

    rest = [
        f"{field.name}={getattr(tiles, field.name)!r}"
        for field in dataclasses.fields(tiles)[3:]
        if getattr(tiles, field.name) != field.default
    ]
    return (
        f"Tiles({', '.join([str(tiles.block_m), str(tiles.block_n), str(tiles.block_k), *rest])})"
    )


def table(results: list[dict[str, Any]]) -> list[list[str]]:
    bf16 = {(r["projection"], r["rows"]): r["us"] for r in results if r["form"] == "bf16"}
    fixed = [r for r in results if r["tiles"] is None]
    return [
        [
            r["projection"], f"{r['n']} x {r['k']}", str(r["rows"]), r["form"],
            fmt(r["us"], ".1f"), fmt(r["gb_s"], ",.0f"), fmt(100 * r["hbm_share"], ".0f") + "%",
            fmt(bf16[(r["projection"], r["rows"])] / r["us"], ".2f") + "x",
        ]
        for r in sorted(fixed, key=lambda r: (r["rows"], r["projection"], FORM_ORDER[r["form"]]))
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv)
    print(header.format(), flush=True)
    hbm = measure_bandwidth("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    shapes = projection_shapes(args.model)
    names = args.projections.split(",")
    budget = Budget(args.budget, len(names) * len(rows))
    results = []
    for name in names:
        results += measure(name, shapes[name], rows, args, hbm, budget)
    print(f"\ncopy bandwidth: {hbm / 1e9:,.0f} GB/s\n")
    headers = ["projection", "N x K", "M", "form", "us", "GB/s", "of HBM", "bf16 / form"]
    print(format_table(headers, table(results)))
    if args.sweep:
        print("\nw8a8_kernels.MEASURED, from this sweep:")
        print("\n".join(measured_table(results)))
    if args.json:
        for r in results:
            r["tiles"] = describe(r["tiles"]) if r["tiles"] is not None else None
        write_json(args.json, header, {"hbm_bytes_s": hbm, "results": results})
    return 0
