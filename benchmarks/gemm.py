"""`gemm`: one linear layer's product at a preset's projection shapes, bf16 against W4A16 and W8A8.

    python -m benchmarks gemm --model llama-8b --rows 1,16,64,2048

For each projection of the preset (qkv, o, gate/up, down) and each row count M, the time of
``x [M, K] @ W.T`` three ways: bf16 (cuBLAS), W4A16 (the Triton kernel of
engine_core/models/w4a16_kernels.py, groups of 128) and W8A8 (per-token int8 activations and
cuBLAS's int8 product, engine_core/models/int8.py). Each way cycles through enough copies of
the weights to exceed the L2 cache, so every call reads its weights from HBM as in a model.
The table: microseconds a call (median of CUDA-event timings), the bytes a call must read
(weights, scales and zero points, activations) over that time, and that rate as a share of
the measured copy bandwidth (roofline.py): decode products should sit near it.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, fmt, format_table, write_json
from benchmarks.roofline import measure_bandwidth

GROUP = 128


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset (default: llama-8b)")
    parser.add_argument(
        "--rows", default="1,16,64,2048", help="row counts M (default: 1,16,64,2048)"
    )
    parser.add_argument("--iters", type=int, default=50, help="timed calls each (default: 50)")
    parser.add_argument("--json", type=Path, help="write the figures here")


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
    """Median CUDA-event time of ``call(i)`` over ``iters`` calls cycling through the copies."""
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


def weights(n: int, k: int) -> dict[str, Any]:
    """One random weight of [N, K] in each of the three forms."""
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


def weight_bytes(form: str, w: Any) -> int:
    tensors = [w] if form == "bf16" else [t for t in w if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def product(form: str) -> Callable[[Any, Any], Any]:
    import torch.nn.functional as F

    from engine_core.models.int8 import int8_linear_cuda
    from engine_core.models.w4a16_kernels import w4a16_gemm

    if form == "bf16":
        return lambda x, w: F.linear(x, w)
    if form == "w4a16":
        return lambda x, w: w4a16_gemm(x, w[0], w[1], w[2], GROUP)
    return lambda x, w: int8_linear_cuda(x, w[0], w[1])


def measure(n: int, k: int, rows: list[int], iters: int, hbm: float) -> list[dict[str, Any]]:
    """Every form at every row count for one [N, K] weight."""
    import torch

    one = weights(n, k)
    results = []
    for form in ("bf16", "w4a16", "w8a8"):
        results += measure_form(form, one[form], (n, k), rows, iters, hbm)
        torch.cuda.empty_cache()
    return results


def measure_form(
    form: str, weight: Any, shape: tuple[int, int], rows: list[int], iters: int, hbm: float
) -> list[dict[str, Any]]:
    """One form's product of an [N, K] weight at every row count, cycling through copies that
    exceed the L2."""
    import torch

    n, k = shape
    per_copy = weight_bytes(form, weight)
    # Twice the L2's bytes in copies: none is still cached when it comes round again.
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(1, -(-2 * l2_bytes // per_copy))
    stack = [weight] + [_copy(weight) for _ in range(copies - 1)]
    run = product(form)
    results = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        us = median_us(lambda i: run(x, stack[i]), copies, iters)  # noqa: B023
        read = per_copy + x.numel() * 2 + m * n * 2
        results.append(
            {"form": form, "n": n, "k": k, "rows": m, "us": us, "gb_s": read / us / 1e3}
            | {"hbm_share": read / (us * 1e-6) / hbm}
        )
    return results


def _copy(w: Any) -> Any:
    if not isinstance(w, tuple):
        return w.clone()
    return tuple(None if t is None else t.clone() for t in w)


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv)
    print(header.format())
    hbm = measure_bandwidth("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in projection_shapes(args.model).items():
        results += [r | {"projection": name} for r in measure(n, k, rows, args.iters, hbm)]
    print(f"copy bandwidth: {hbm / 1e9:,.0f} GB/s\n")
    headers = ["projection", "N x K", "M", "form", "us", "GB/s", "of HBM"]
    print(format_table(headers, table(results)))
    if args.json:
        write_json(args.json, header, {"hbm_bytes_s": hbm, "results": results})
    return 0


def table(results: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            r["projection"], f"{r['n']} x {r['k']}", str(r["rows"]), r["form"],
            fmt(r["us"], ".1f"), fmt(r["gb_s"], ",.0f"), fmt(100 * r["hbm_share"], ".0f") + "%",
        ]
        for r in sorted(results, key=lambda r: (r["rows"], r["projection"], r["form"]))
    ]  # fmt: skip
