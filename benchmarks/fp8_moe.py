"""`fp8-moe`: one MoE layer's experts in FP8 (the fused kernels) beside bf16, against HBM.

    python -m benchmarks fp8-moe --tokens 1,64,2048

One MoE layer of the preset (default qwen3-30b-a3b: hidden 2048, width 768, 128 experts, top 8),
random weights and uniform random routing (softmax top-k of random logits), at each token count
(1: batch-1 decode; 64: a decode batch; 2,048: a prefill), each way:

- ``bf16``: the fused bf16 MoE (engine_core/models/fused_moe.py), what a bf16 checkpoint runs;
- ``fp8 block``: the fused FP8 kernels (engine_core/models/fp8_moe_kernels.py) with 128 x 128
  scale blocks and per-token, per-128-column activation scales (Qwen3-30B-A3B-FP8's scheme),
  activation quantizers included;
- ``fp8 row``: the same kernels with a scale per weight row and per-token activations (a
  per-channel checkpoint, or ``--quantization fp8``);
- with ``--sweep``, ``fp8 block MxNxK wW``: the block form at each tile of
  fp8_moe_kernels.CANDIDATES instead of block_sizes' choice.

The table: µs a layer (median of 5 replays of a CUDA graph of 20 calls, divided by 20: a
one-token layer's kernels are shorter than the host's launches), the bytes the layer must read
(the experts the routing touched, weights and scales; the activations in and out) over that
time, and that rate as a share of ``--hbm`` (default 4.8 TB/s, the datasheet figure of the 141
GB HBM3e GPU these kernels were written for) and of the copy bandwidth measured first
(roofline.py). One layer's experts (604 MB in FP8 at qwen3-30b-a3b's shape) exceed the L2
cache.

``--device cpu`` (with TRITON_INTERPRET=1 and ``--shape`` small) only checks that the script
runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.mxfp4 import table, timed_us
from benchmarks.report import Provenance, format_table, write_json
from benchmarks.roofline import measure_bandwidth

BLOCK = (128, 128)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a Qwen3-MoE preset")
    parser.add_argument("--tokens", default="1,64,2048", help="token counts (default: 1,64,2048)")
    parser.add_argument(
        "--shape", help="hidden,width,experts,top_k instead of the preset's (e.g. to check)"
    )
    parser.add_argument(
        "--hbm", type=float, default=4.8e12, help="HBM bytes/s to compare with (default 4.8e12)"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time the block form at each candidate tile"
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
    width = hf["moe_intermediate_size"]
    return hf["hidden_size"], width, hf["num_experts"], hf["num_experts_per_tok"]


def fp8_layers(shape: tuple[int, int, int, int], device: str) -> dict[str, Any]:
    """The layer's experts: bf16 (w13, w2), and FP8 with block and with row scales."""
    import torch

    from engine_core.models.fp8 import FP8_DTYPE, Fp8Experts

    hidden, width, experts, _ = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w13 = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02

    def fp8(block: tuple[int, int] | None) -> Fp8Experts:
        def scales(rows: int, cols: int) -> torch.Tensor:
            shape = (experts, rows) if block is None else (
                experts, -(-rows // block[0]), -(-cols // block[1]))  # fmt: skip
            return torch.full(shape, 0.02 / 64, device=device)

        def weight(w: torch.Tensor) -> torch.Tensor:
            return (w * 64 / 0.02).clamp(-448, 448).to(FP8_DTYPE)

        return Fp8Experts(
            weight(w13), scales(2 * width, hidden), weight(w2), scales(hidden, width), block
        )

    return {"bf16": (w13, w2), "fp8 block": fp8(BLOCK), "fp8 row": fp8(None)}


def layer_bytes(layer: Any) -> int:
    """Bytes of all the layer's experts in one form."""
    tensors = layer if isinstance(layer, tuple) else (
        layer.w13, layer.w13_scale, layer.w2, layer.w2_scale)  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(
    shape: tuple[int, int, int, int], tokens: int, args: argparse.Namespace, copy_bw: float
) -> list[dict[str, Any]]:
    """Each way at one token count: a row of figures each."""

    from engine_core.models.fp8_moe_kernels import CANDIDATES, fused_moe_fp8
    from engine_core.models.fused_moe import fused_moe

    device = args.device
    layers = fp8_layers(shape, device)
    w13, w2 = layers["bf16"]
    batch = RoutedBatch.random(shape, tokens, device, w13.dtype)
    x, weights, ids = batch.x, batch.weights, batch.ids
    block, row = layers["fp8 block"], layers["fp8 row"]
    ways: dict[str, tuple[Callable[[], Any], str]] = {
        "bf16": (lambda: fused_moe(x, w13, w2, weights, ids), "bf16"),
        "fp8 block": (lambda: fused_moe_fp8(x, block, weights, ids), "fp8 block"),
        "fp8 row": (lambda: fused_moe_fp8(x, row, weights, ids), "fp8 row"),
    }
    for b in CANDIDATES if args.sweep else ():
        tiled = (lambda b=b: fused_moe_fp8(x, block, weights, ids, b), "fp8 block")
        ways[f"fp8 block {b.m}x{b.n}x{b.k} w{b.warps}"] = tiled
    return batch.figures(ways, {k: layer_bytes(v) for k, v in layers.items()}, args, copy_bw)


@dataclass(frozen=True)
class RoutedBatch:
    """One token count's inputs to an MoE layer of ``shape`` (hidden, width, experts, top_k):
    random activations routed to random experts (renormalized top-k), and what the figures
    count: the experts touched, the activations' bytes in and out, the three products' FLOPs."""

    x: Any
    weights: Any
    ids: Any
    experts: int
    touched: int
    activation_bytes: int
    flops: float

    @classmethod
    def random(
        cls, shape: tuple[int, int, int, int], tokens: int, device: str, dtype: Any
    ) -> RoutedBatch:
        import torch

        from engine_core.models.moe import route

        hidden, width, experts, top_k = shape
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        weights, ids = route(torch.randn(tokens, experts, device=device), top_k, renormalize=True)
        touched = int(torch.unique(ids).numel())
        activation_bytes = 2 * tokens * hidden * x.element_size()
        flops = 2.0 * tokens * top_k * 3 * hidden * width
        return cls(x, weights, ids.int(), experts, touched, activation_bytes, flops)

    def figures(
        self, ways: dict[str, tuple[Callable[[], Any], str]], form_bytes: dict[str, int],
        args: argparse.Namespace, copy_bw: float,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """A row for each way (its call and its weights' form), timed inside a CUDA graph:
        the bytes it reads (the touched experts' share of its form's and the activations')
        against HBM and the copy bandwidth, and its TFLOP/s."""
        rows = []
        tokens = self.x.shape[0]
        for way, (call, form) in ways.items():
            us = timed_us(call, args.device, in_graph=True)
            read = self.touched * form_bytes[form] // self.experts + self.activation_bytes
            rows.append(
                {"way": way, "tokens": tokens, "experts_touched": self.touched, "us": us}
                | {
                    "bytes": read,
                    "gb_s": read / us / 1e3,
                    "hbm_share": read / (us * 1e-6) / args.hbm,
                }
                | {"copy_share": read / (us * 1e-6) / copy_bw, "tflops": self.flops / us / 1e6}
            )
        return rows


def free_cached(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


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
    print(f"layer: hidden {hidden}, width {width}, {experts} experts, top {top_k}; HBM "
          f"{args.hbm / 1e12:.1f} TB/s, copy bandwidth {copy_bw / 1e12:.2f} TB/s\n")  # fmt: skip
    headers = ["tokens", "way", "experts read", "us", "MB read", "GB/s", "of HBM", "of copy"]
    print(format_table([*headers, "TFLOP/s"], table(results)))
    if args.json:
        figures = {"shape": shape, "hbm_bytes_s": args.hbm, "copy_bytes_s": copy_bw}
        write_json(args.json, header, figures | {"results": results})
    return 0
