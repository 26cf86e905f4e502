"""`mxfp4`: gpt-oss's MXFP4 expert GEMMs (one MoE layer's experts) against HBM, beside bf16.

    python -m benchmarks mxfp4 --tokens 64,2048

One MoE layer of the preset (default gpt-oss-20b: hidden 2880, width 2880, 32 experts, top 4),
random MXFP4 weights and uniform random routing, at each token count (64: a decode batch;
2,048: a prefill) three ways:

- ``mxfp4``: what a CUDA engine runs (engine_core/models/mxfp4_moe.py's choice by shape), and
  each of its paths forced: ``mxfp4 gemv`` (the decode kernels on CUDA cores, mxfp4_gemv.py,
  at the rule's tiles), ``mxfp4 tiled`` (the kernels that widen codes into tensor-core tiles,
  mxfp4_kernels.py) and ``mxfp4 dequantize`` (experts dequantized to bf16 in chunks, then
  bf16 grouped GEMMs, mxfp4_prefill.py);
- ``bf16``: the fused bf16 MoE of engine_core/models/fused_moe.py on the same shapes with the
  weights in bf16 (no biases, plain SwiGLU: the bf16 path of the other MoE models), 3.8x the
  bytes;
- ``torch``: the dequantize-each-expert reference (gpt_oss_moe.experts_reference), the path
  CUDA took before the kernels (``--no-torch`` skips it);
- with ``--sweep``, ``tiled MxNxK wW``: the tiled kernels at each tile of
  mxfp4_kernels.CANDIDATES (row block, columns, K step, warps), and ``gemv RxNxW sS wW``: the
  decode kernels at each of mxfp4_gemv.GEMV_CANDIDATES (rows, columns, words a K step, splits,
  warps), and ``dequantize MxNxK wW``: the prefill path's GEMMs at each of
  mxfp4_moe.DEQUANTIZE_CANDIDATES, and ``swapped RxSxK wW sS``: the kernels with the weights on
  the tensor cores' M side (mxfp4_swapped.py) at each of mxfp4_swapped.SWAPPED_CANDIDATES (weight
  rows, slots, K step, warps, stages; ``bits``: widened by their bits, not tl.dot_scaled). After
  the table, the fastest MXFP4 way at each token count
  as a line of mxfp4_moe.MEASURED, and the token count from which the dequantize path beat
  the others (the measured value of mxfp4_moe.DEQUANTIZE_TOKENS, among the counts given).

The table: µs a layer (median of 5 replays of a CUDA graph of 20 calls, divided by 20; the
torch way, which reads the host, 20 back-to-back calls), the bytes the layer must read (the
experts the routing touched: codes, scales and biases, or bf16 weights; the activations in and
out) over that time, that rate as a share of the HBM bandwidth given by ``--hbm`` (default 4.8
TB/s, the datasheet figure of the 141 GB HBM3e GPU these kernels were written for) and of the
copy bandwidth measured first (roofline.py), and the tensor-core rate (2 x slots x (hidden x 2
width + width x hidden) FLOPs). One layer's MXFP4 experts (422 MB at 20b's shape) exceed the L2
cache, so every call reads its weights from HBM.

``--device cpu`` (with TRITON_INTERPRET=1, and ``--shape`` small) only checks that the script
runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, fmt, format_table, write_json
from benchmarks.roofline import measure_bandwidth

CALLS = 20  # calls a timing


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-oss-20b", help="a gpt-oss preset")
    parser.add_argument("--tokens", default="64,2048", help="token counts (default: 64,2048)")
    parser.add_argument(
        "--shape", help="hidden,width,experts,top_k instead of the preset's (e.g. to check)"
    )
    parser.add_argument(
        "--hbm", type=float, default=4.8e12, help="HBM bytes/s to compare with (default 4.8e12)"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the kernels at each candidate tile"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to check the script")


def layer_shape(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(hidden, width, experts, top_k): ``--shape`` or the preset's."""
    if args.shape:
        hidden, width, experts, top_k = (int(v) for v in args.shape.split(","))
        return hidden, width, experts, top_k
    from engine_core.presets import hf_config

    hf = hf_config(args.model)
    return (
        hf["hidden_size"],
        hf["intermediate_size"],
        hf["num_local_experts"],
        hf["num_experts_per_tok"],
    )


def timed_us(call: Callable[[], Any], device: str, in_graph: bool = False) -> float:
    """µs a call: the median over 5 timings of CALLS back-to-back calls (on the CPU, one).
    ``in_graph``: the calls captured in one CUDA graph, so the host's launch cost (larger
    than a one-token layer's kernels) is not what is timed."""
    import torch

    if in_graph and device == "cuda":
        from benchmarks.w4a16 import graph_us

        return graph_us(lambda _: call(), 1, device)
    if device != "cuda":
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    for _ in range(3):
        call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def mxfp4_layer(shape: tuple[int, int, int, int], device: str) -> Any:
    """Random MXFP4 experts (scales of 2^-7) with zero biases, in bf16 where biases are kept."""
    import torch

    from engine_core.models.mxfp4 import BLOCK, Mxfp4Experts

    hidden, width, experts, _ = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def codes(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device)

    def scales(rows: int, cols: int) -> torch.Tensor:
        shape = (experts, rows, cols // BLOCK)
        return torch.full(shape, 120, dtype=torch.uint8, device=device)

    return Mxfp4Experts(
        codes(2 * width, hidden), scales(2 * width, hidden),
        torch.zeros(experts, 2 * width, dtype=dtype, device=device),
        codes(hidden, width), scales(hidden, width),
        torch.zeros(experts, hidden, dtype=dtype, device=device), limit=7.0, alpha=1.702,
    )  # fmt: skip


def expert_bytes(layer: Any) -> dict[str, int]:
    """Bytes of one expert in each form."""
    experts = layer.w13_blocks.shape[0]
    tensors = (layer.w13_blocks, layer.w13_scales, layer.b13, layer.w2_blocks, layer.w2_scales)
    mxfp4 = sum(t.numel() * t.element_size() for t in (*tensors, layer.b2)) // experts
    width2, hidden = layer.w13_blocks.shape[1], layer.w2_blocks.shape[1]
    return {"mxfp4": mxfp4, "bf16": 2 * (width2 * hidden + hidden * width2 // 2)}


def measure(
    shape: tuple[int, int, int, int], tokens: int, args: argparse.Namespace, copy_bw: float
) -> list[dict[str, Any]]:
    """The three ways at one token count: a row of figures each."""
    import torch

    from engine_core.models.fused_moe import fused_moe
    from engine_core.models.gpt_oss_moe import experts_reference, route_gpt_oss
    from engine_core.models.mxfp4 import dequantize
    from engine_core.models.mxfp4_gemv import GEMV_CANDIDATES, rule_tiles
    from engine_core.models.mxfp4_kernels import CANDIDATES, block_sizes
    from engine_core.models.mxfp4_moe import (
        DEQUANTIZE_CANDIDATES,
        Dequantize,
        multiprocessors,
        mxfp4_moe,
    )
    from engine_core.models.mxfp4_swapped import SWAPPED_CANDIDATES

    hidden, width, experts, top_k = shape
    device = args.device
    layer = mxfp4_layer(shape, device)
    dtype = layer.b13.dtype
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weights, ids = route_gpt_oss(torch.randn(tokens, experts, device=device, dtype=dtype), top_k)
    touched = int(torch.unique(ids).numel())
    per_expert = expert_bytes(layer)
    activations = 2 * tokens * hidden * x.element_size()
    flops = 2.0 * tokens * top_k * 3 * hidden * width
    ids = ids.int()
    slots, sms = tokens * top_k, multiprocessors(x.device)
    choices: dict[str, Any] = {
        "mxfp4": None,
        "mxfp4 gemv": rule_tiles(slots, experts, hidden, sms),
        "mxfp4 tiled": block_sizes(slots, experts),
        "mxfp4 dequantize": Dequantize(),
    }
    for b in CANDIDATES if args.sweep else ():
        choices[f"tiled {b.m}x{b.n}x{b.k} w{b.warps}"] = b
    for d in DEQUANTIZE_CANDIDATES if args.sweep else ():
        b = d.blocks
        choices[f"dequantize {b.m}x{b.n}x{b.k} w{b.warps}"] = d
    for t in GEMV_CANDIDATES if args.sweep else ():
        choices[f"gemv {t.rows}x{t.block_n}x{t.words} s{t.split_k} w{t.warps}"] = t
    for s in SWAPPED_CANDIDATES if args.sweep else ():
        widen = "" if s.scaled else " bits"
        choices[f"swapped {s.rows}x{s.slots}x{s.k} w{s.warps} s{s.stages}{widen}"] = s
    ways: dict[str, Callable[[], Any]] = {
        name: lambda c=c: mxfp4_moe(x, layer, weights, ids, c) for name, c in choices.items()
    }
    if device == "cuda":  # the bf16 fused MoE: weights of 3.8x the bytes
        w13 = dequantize(layer.w13_blocks, layer.w13_scales, dtype)
        w2 = dequantize(layer.w2_blocks, layer.w2_scales, dtype)
        ways["bf16"] = lambda: fused_moe(x, w13, w2, weights.float(), ids)
    if not args.no_torch:
        ways["torch"] = lambda: experts_reference(x, layer, weights, ids)
    rows = []
    for way, call in ways.items():
        us = timed_us(call, device, in_graph=way != "torch")
        read = touched * per_expert["bf16" if way == "bf16" else "mxfp4"] + activations
        rows.append(
            {"way": way, "tokens": tokens, "experts_touched": touched, "us": us}
            | {"choice": repr(choices[way]) if choices.get(way) is not None else None}
            | {"bytes": read, "gb_s": read / us / 1e3, "hbm_share": read / (us * 1e-6) / args.hbm}
            | {"copy_share": read / (us * 1e-6) / copy_bw, "tflops": flops / us / 1e6}
        )
    del ways
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv, device=None if args.device == "cuda" else "cpu")
    print(header.format())
    shape = layer_shape(args)
    copy_bw = measure_bandwidth(args.device)
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        results += measure(shape, tokens, args, copy_bw)
    hidden, width, experts, top_k = shape
    print(f"layer: hidden {hidden}, width {width}, {experts} experts, top {top_k}; HBM "
          f"{args.hbm / 1e12:.1f} TB/s, copy bandwidth {copy_bw / 1e12:.2f} TB/s\n")  # fmt: skip
    headers = ["tokens", "way", "experts read", "us", "MB read", "GB/s", "of HBM", "of copy"]
    headers.append("TFLOP/s")
    print(format_table(headers, table(results)))
    print(measured_lines(results, shape, "mxfp4_moe"))
    if args.json:
        figures = {"shape": shape, "hbm_bytes_s": args.hbm, "copy_bytes_s": copy_bw}
        write_json(args.json, header, figures | {"results": results})
    return 0


def table(results: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            str(r["tokens"]), r["way"], str(r["experts_touched"]), fmt(r["us"], ".1f"),
            fmt(r["bytes"] / 1e6, ",.1f"), fmt(r["gb_s"], ",.0f"),
            fmt(100 * r["hbm_share"], ".0f") + "%", fmt(100 * r["copy_share"], ".0f") + "%",
            fmt(r["tflops"], ".1f"),
        ]
        for r in results
    ]  # fmt: skip


def measured_lines(
    results: list[dict[str, Any]], shape: tuple[int, int, int, int], module: str
) -> str:
    """The fastest forced choice at each token count as lines of ``module``.MEASURED (mxfp4_moe,
    w4a16_moe), and the first token count at which a dequantize path beat every other."""
    hidden, width, experts, top_k = shape
    lines, crossover = [f"{module}.MEASURED (fastest forced choice by token count):"], None
    for tokens in sorted({r["tokens"] for r in results}):
        forced = [r for r in results if r["tokens"] == tokens and r.get("choice")]
        if not forced:
            continue
        best = min(forced, key=lambda r: r["us"])
        bucket = 1 << max(0, (tokens - 1).bit_length())
        key = (bucket, hidden, width, experts, top_k)
        lines.append(f"    {key}: {best['choice']},  # {best['us']:.1f} us, {best['way']}")
        if crossover is None and "dequantize" in best["way"]:
            crossover = tokens
    lines.append(
        f"DEQUANTIZE_TOKENS measured: {crossover}" if crossover else
        "DEQUANTIZE_TOKENS measured: dequantizing won at none of these token counts"
    )  # fmt: skip
    return "\n".join(lines)
