"""`lora-kernels`: what LoRA adds to a decode step's projections, kernel by kernel, on a GPU.

    python -m benchmarks lora-kernels --model llama-8b --rows 16,64,128,256 --adapters 8

For each row count, one CUDA graph per way of adding the adapters' product, of ``--layers``
layers of the preset's four wrapped projections (qkv, o, gate/up, down), each the base product
as a decode graph runs it (the skinny GEMM, a link of the PDL chain) followed by the LoRA
product of every row, the rows spread over ``--adapters`` slots of rank ``--rank`` in turn:
``base`` (no LoRA), ``split`` (the shrink over splits of the input, then the expand: two
launches a projection), ``fused`` (engine_core/lora/triton_lora.py's one kernel a projection,
its default tiles) and, with ``--sweep``, the fused kernel at other tiles, each projection
alone as well as the four together. Every layer has its own weights and adapters, so each
product reads them from HBM as a model step does. The table:
microseconds a replay (median of CUDA-event timings), what LoRA adds over ``base``, and base's
time over the way's (the throughput ratio LoRA leaves a decode step of these products alone).

``--profile`` also replays each graph of ``base`` and ``split`` (the four projections', and
with ``--sweep`` each projection's) under torch.profiler and prints their kernels' device time a
replay: which launch the added time is in. Under programmatic dependent launch a kernel starts
before the one ahead of it ends, so a kernel's time includes its wait at the chain's barrier;
the sum can pass the replay's time.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.gemm import projection_shapes
from benchmarks.report import Provenance, format_table, write_json

# Fused tiles the sweep tries: (output columns a program, reduction tile).
SWEEP = ((256, 256), (512, 256), (1024, 256), (2048, 256), (4096, 256), (512, 64), (512, 128))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset (default: llama-8b)")
    parser.add_argument(
        "--rows", default="16,64,128,256", help="decode rows (default: %(default)s)"
    )
    parser.add_argument("--adapters", type=int, default=8, help="slots in use (default: 8)")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's rank (default: 16)")
    parser.add_argument("--layers", type=int, default=32, help="layers a graph runs (default: 32)")
    parser.add_argument("--iters", type=int, default=20, help="timed replays (default: 20)")
    parser.add_argument("--sweep", action="store_true", help="also the fused kernel's other tiles")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--profile", action="store_true", help="also the kernels of base and split, profiled"
    )


def layer_weights(model: str, slots: int, rank: int, layers: int) -> list[list[dict[str, Any]]]:
    """Per layer, per projection: the base weight and each slot's stacked A and B, as
    LoraLinear lays them out (shard i's rows of B read its own rank columns)."""
    import torch

    shapes = projection_shapes(model)
    sizes = split_sizes(model)
    out = []
    for _ in range(layers):
        projections = []
        for name, (n, k) in shapes.items():
            width = len(sizes[name]) * rank
            a = torch.randn(slots, width, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            b = torch.randn(slots, n, width, device="cuda", dtype=torch.bfloat16) * 0.01
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            projections.append({"name": name, "w": w, "a": a, "b": b, "sizes": sizes[name], "k": k})
        out.append(projections)
    return out


def split_sizes(model: str) -> dict[str, tuple[int, ...]]:
    """The shards' outputs of each projection (q, k, v; gate, up)."""
    from engine_core.presets import hf_config

    hf = hf_config(model)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv = hf.get("num_key_value_heads", heads) * head_dim
    inter = hf["intermediate_size"]
    return {
        "qkv": (heads * head_dim, kv, kv),
        "o": (hf["hidden_size"],),
        "gate_up": (inter, inter),
        "down": (hf["hidden_size"],),
    }


def captured(step: Any) -> Any:
    """``step`` captured as one CUDA graph (compiled outside the capture)."""
    import torch

    from engine_core.models import skinny_gemm

    with skinny_gemm.for_graphs():
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    return graph


def graph_us(graph: Any, iters: int) -> float:
    """Median microseconds of a replay of ``graph``."""
    import torch

    times = []
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters + 3):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def ways(sweep: bool) -> dict[str, Any]:
    """name -> the LoRA product (out, x, a, b, tiles, sizes) or None (base only)."""
    from functools import partial

    from engine_core.lora import triton_lora

    table: dict[str, Any] = {
        "base": None,
        "split": triton_lora.add_lora_split,
        "fused": triton_lora.add_lora_fused,
    }
    if sweep:
        for block_n, block_k in SWEEP:
            fused = partial(triton_lora.add_lora_fused, block_n=block_n, block_k=block_k)
            table[f"fused n{block_n} k{block_k}"] = fused
    return table


def measure(
    args: argparse.Namespace, rows: int, weights: list, projection: str, sweep: bool
) -> list[dict[str, Any]]:
    """Each way's replay of ``rows`` rows through ``projection`` ("all": the four) of every
    layer."""
    import torch

    from engine_core.lora.batch import lora_batch, tile_capacity
    from engine_core.models.layers import dense_linear

    row_slots = [(1, i % args.adapters) for i in range(rows)]
    batch = lora_batch(row_slots, torch.device("cuda"), tile_capacity(rows, args.adapters))
    assert batch is not None
    widths = {p["k"] for layer in weights for p in layer}
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in widths}
    chosen = [[p for p in layer if projection in ("all", p["name"])] for layer in weights]
    results = []
    base_us = 0.0
    for name, add in ways(sweep).items():

        def step(add: Any = add) -> None:
            for layer in chosen:
                for p in layer:
                    x = inputs[p["k"]]
                    out = dense_linear(x, p["w"])
                    if add is not None:
                        add(out, x, p["a"], p["b"], batch.tiles, p["sizes"])

        graph = captured(step)
        us = graph_us(graph, args.iters)
        if args.profile and name in ("base", "split"):
            print_kernels(f"{name}, {projection}, {rows} rows", graph)
        base_us = us if add is None else base_us
        results.append(
            {"rows": rows, "projection": projection, "way": name, "tiles": batch.tiles.count,
             "us": us, "lora_us": us - base_us, "ratio": base_us / us}
        )  # fmt: skip
    return results


def print_kernels(label: str, graph: Any, replays: int = 5) -> None:
    """The kernels of ``replays`` replays of ``graph`` under torch.profiler, device time each."""
    import torch

    from benchmarks.step_profile import format_phase, profiled

    def replay() -> bool:
        graph.replay()
        return True

    phase = profiled("graph replays", replay, torch.device("cuda"), top=12, max_steps=replays)
    print(format_phase(label, phase), flush=True)


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv)
    print(header.format())
    results = []
    weights = layer_weights(args.model, args.adapters, args.rank, args.layers)
    for rows in (int(r) for r in args.rows.split(",")):
        results += measure(args, rows, weights, "all", False)
        if args.sweep:
            for projection in split_sizes(args.model):
                results += measure(args, rows, weights, projection, True)
    headers = ["rows", "tiles", "projection", "way", "us a step", "LoRA us", "base / way"]
    keys = ["rows", "tiles", "projection", "way", "us", "lora_us", "ratio"]
    formats = ["{}", "{}", "{}", "{}", "{:.0f}", "{:.0f}", "{:.3f}"]
    table = [[f.format(r[k]) for f, k in zip(formats, keys, strict=True)] for r in results]
    print(format_table(headers, table))
    if args.json:
        write_json(args.json, header, results)
    return 0
