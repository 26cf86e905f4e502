"""`w4a16-moe`: one MoE layer's experts in W4A16 (the fused kernels) beside bf16, against HBM.

    python -m benchmarks w4a16-moe --tokens 1,64,2048

One MoE layer of the preset (default qwen3-30b-a3b: hidden 2048, width 768, 128 experts, top 8),
random weights and uniform random routing (softmax top-k of random logits), at each token count
(1: batch-1 decode; 64: a decode batch; 2,048: a prefill), each way:

- ``bf16``: the fused bf16 MoE (engine_core/models/fused_moe.py), what a bf16 checkpoint runs;
- ``w4a16 zeros``: the fused W4A16 kernels (engine_core/models/w4a16_moe_kernels.py), groups of
  128 columns with zero points (Qwen3-30B-A3B's AWQ and GPTQ-Int4 releases);
- ``w4a16 sym``: the same without zero points (compressed-tensors' symmetric W4A16);
- ``w4a16 zeros dequantize``: the prefill path (engine_core/models/w4a16_prefill.py): the
  experts dequantized into a scratch, then the bf16 GEMMs;
- with ``--sweep``, ``w4a16 zeros MxNxK wW``: the first form at each tile of
  w4a16_moe_kernels.CANDIDATES instead of block_sizes' choice, and ``dequantize MxNxK wW`` at
  each of w4a16_moe.DEQUANTIZE_CANDIDATES; then the fastest forced choice at each token count
  as lines of w4a16_moe.MEASURED to paste, and the token count from which dequantizing won.

The table is fp8-moe's (benchmarks/fp8_moe.py): µs a layer inside a CUDA graph, the bytes the
touched experts and the activations take over that time, as a share of ``--hbm`` and of the
measured copy bandwidth. ``--device cpu`` (with TRITON_INTERPRET=1 and ``--shape`` small) only
checks that the script runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from benchmarks.fp8_moe import RoutedBatch, free_cached, layer_shape
from benchmarks.fp8_moe import add_args as add_fp8_moe_args
from benchmarks.mxfp4 import measured_lines, table
from benchmarks.report import Provenance, format_table, write_json
from benchmarks.roofline import measure_bandwidth

GROUP = 128


def add_args(parser: argparse.ArgumentParser) -> None:
    add_fp8_moe_args(parser)


def w4a16_layers(shape: tuple[int, int, int, int], device: str) -> dict[str, Any]:
    """The layer's experts: bf16 (w13, w2), and W4A16 with and without zero points (random
    nibbles, scales giving weights of about the bf16 ones' size)."""
    import torch

    from engine_core.models.w4a16 import PACK, W4A16Experts

    hidden, width, experts, _ = shape
    group = min(GROUP, hidden, width)  # a --shape narrower than a group: one group
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w13 = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02

    def words(rows: int, cols: int) -> torch.Tensor:
        high = 2**31
        return torch.randint(-high, high, (experts, rows, cols // PACK), device=device).int()

    def per_group(rows: int, cols: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((experts, cols // group, rows), fill, device=device, dtype=dtype)

    def w4a16(zeros: bool) -> W4A16Experts:
        def zero(rows: int, cols: int) -> torch.Tensor | None:
            return per_group(rows, cols, 8, torch.uint8) if zeros else None

        return W4A16Experts(
            words(2 * width, hidden), per_group(2 * width, hidden, 0.01, torch.float32),
            zero(2 * width, hidden), words(hidden, width),
            per_group(hidden, width, 0.01, torch.float32), zero(hidden, width), (group, group),
        )  # fmt: skip

    return {"bf16": (w13, w2), "w4a16 zeros": w4a16(True), "w4a16 sym": w4a16(False)}


def layer_bytes(layer: Any) -> int:
    """Bytes of all the layer's experts in one form."""
    if isinstance(layer, tuple):
        tensors = list(layer)
    else:
        tensors = [layer.w13_qweight, layer.w13_scales, layer.w13_zeros,
                   layer.w2_qweight, layer.w2_scales, layer.w2_zeros]  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(
    shape: tuple[int, int, int, int], tokens: int, args: argparse.Namespace, copy_bw: float
) -> list[dict[str, Any]]:
    """Each way at one token count: a row of figures each."""

    from engine_core.models.fused_moe import fused_moe
    from engine_core.models.w4a16_moe import DEQUANTIZE_CANDIDATES, Dequantize, Tiled, w4a16_moe
    from engine_core.models.w4a16_moe_kernels import CANDIDATES, fused_moe_w4a16

    device = args.device
    layers = w4a16_layers(shape, device)
    w13, w2 = layers["bf16"]
    batch = RoutedBatch.random(shape, tokens, device, w13.dtype)
    x, weights, ids = batch.x, batch.weights, batch.ids
    zeros, sym = layers["w4a16 zeros"], layers["w4a16 sym"]
    ways: dict[str, tuple[Callable[[], Any], str]] = {
        "bf16": (lambda: fused_moe(x, w13, w2, weights, ids), "bf16"),
        "w4a16 zeros": (lambda: fused_moe_w4a16(x, zeros, weights, ids), "w4a16 zeros"),
        "w4a16 sym": (lambda: fused_moe_w4a16(x, sym, weights, ids), "w4a16 sym"),
    }
    choices: dict[str, Any] = {"w4a16 zeros": Tiled(), "w4a16 zeros dequantize": Dequantize()}
    for b in CANDIDATES if args.sweep else ():
        choices[f"w4a16 zeros {b.m}x{b.n}x{b.k} w{b.warps}"] = Tiled(b)
    for d in DEQUANTIZE_CANDIDATES if args.sweep else ():
        b = d.blocks
        choices[f"dequantize {b.m}x{b.n}x{b.k} w{b.warps}"] = d
    for name, c in choices.items():
        ways[name] = (lambda c=c: w4a16_moe(x, zeros, weights, ids, c), "w4a16 zeros")
    rows = batch.figures(ways, {k: layer_bytes(v) for k, v in layers.items()}, args, copy_bw)
    return [r | {"choice": repr(choices[r["way"]]) if r["way"] in choices else None} for r in rows]


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv, device=None if args.device == "cuda" else "cpu")
    print(header.format())
    shape = layer_shape(args)
    copy_bw = measure_bandwidth(args.device)
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        results += measure(shape, tokens, args, copy_bw)
        free_cached(args.device)  # the layer's weights, before the next token count's
    hidden, width, experts, top_k = shape
    print(f"layer: hidden {hidden}, width {width}, {experts} experts, top {top_k}, groups of "
          f"{min(GROUP, hidden, width)}; HBM {args.hbm / 1e12:.1f} TB/s, copy bandwidth "
          f"{copy_bw / 1e12:.2f} TB/s\n")  # fmt: skip
    headers = ["tokens", "way", "experts read", "us", "MB read", "GB/s", "of HBM", "of copy"]
    print(format_table([*headers, "TFLOP/s"], table(results)))
    print(measured_lines(results, shape, "w4a16_moe"))
    if args.json:
        figures = {"shape": shape, "hbm_bytes_s": args.hbm, "copy_bytes_s": copy_bw}
        write_json(args.json, header, figures | {"results": results})
    return 0
