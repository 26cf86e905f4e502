"""What llama-8b 256's products would have to do to reach 80% of the roofline, against the
fastest products this board runs at all, under its power limit (issue 17), on the GPU machine:

    python scripts/device/gemm_ceiling_probe.py [--model llama-8b] [--batch 256] [--context 256]
        [--target 80]

Four CUDA graphs, each replayed back to back for a few seconds, as the decode loop runs its
steps (the median of the second half, once the board's power has settled at its limit), with
nvidia-smi's SM clock, board power and software power cap sampled during each:

1. **the engine's decode graph** at about ``--context`` tokens a sequence (power_cap_probe.py's);
2. **its products alone**: one ``F.linear`` per projection per layer (qkv, o, gate_up, down) on
   every layer's distinct random weights, and the LM head, at ``--batch`` rows: what the step
   spends in cuBLAS. The decode graph less this is what the step spends elsewhere (attention,
   norms, rotary, sampling);
3. **the same products at 4,096 rows**: the same weight shapes where the matrix units, not the
   weight reads, set the pace;
4. **square 8,192 products**: the shape GEMM libraries are tuned and published for.

Graphs 1 and 2 are also timed rested: the first three replays after 0.5 s of idle GPU, at the
idle clock, before the power limiter cuts it (power_cap_probe.py's).

Then the products' pace that the target step asks for, with everything else in the step as it
is: (the target step) - (the step less its products) is the time the products may take. A pace
above what 3 and 4 reach asks the 256-row products to beat the board's best product shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Workload, measure_hbm_bandwidth, roofline  # noqa: E402
from bf16_chain_probe import shapes  # noqa: E402
from decode_graph_ab import decode_graph, engine_at_context  # noqa: E402
from fp8_skinny_bench import capture_graph  # noqa: E402
from power_cap_probe import rested, sustained, timed_replays  # noqa: E402

from engine_core.presets import hf_config  # noqa: E402


def model_products(model: str, rows: int) -> tuple[torch.cuda.CUDAGraph, int, list[torch.Tensor]]:
    """(graph, FLOPs per replay, the weights it holds): every layer's projections and the LM
    head at ``rows`` rows, each layer on its own weights so that no weight is in L2 from the
    call before."""
    proj, dims = shapes(model)
    vocab = hf_config(model)["vocab_size"]
    pairs = [(n, k) for _ in range(dims["layers"]) for n, k in proj.values()]
    pairs.append((vocab, dims["hidden"]))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in pairs]
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in pairs}

    def calls() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    flops = sum(2 * rows * n * k for n, k in pairs)
    return capture_graph(calls), flops, weights


def square_products(size: int, count: int) -> tuple[torch.cuda.CUDAGraph, int, list[torch.Tensor]]:
    """(graph, FLOPs per replay, its tensors): ``count`` size^3 products on distinct weights."""
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(count)]

    def calls() -> None:
        for w in weights:
            F.linear(x, w)

    return capture_graph(calls), 2 * size**3 * count, [x, *weights]


def replays_for(graph: torch.cuda.CUDAGraph, seconds: float) -> int:
    """How many back-to-back replays take about ``seconds``."""
    return max(20, int(seconds * 1e3 / statistics.mean(timed_replays(graph, 3))))


def report(label: str, graph: torch.cuda.CUDAGraph, seconds: float, flops: int = 0) -> float:
    """Milliseconds a replay, sustained; prints it with its pace and the GPU samples."""
    ms, samples = sustained(graph, replays_for(graph, seconds))
    pace = f", {flops / ms / 1e9:.0f} TFLOP/s" if flops else ""
    print(f"{label}: {ms:.3f} ms a replay{pace}; samples (MHz, W, power cap): "
          f"{' | '.join(samples)}", flush=True)  # fmt: skip
    return ms


def report_rested(label: str, graph: torch.cuda.CUDAGraph, rests: int, flops: int = 0) -> None:
    """The first three replays after 0.5 s of idle GPU (medians over ``rests`` rests): the
    graph at the idle clock, before the power limiter has cut it."""
    by_position, samples = rested(graph, rests, 0.5)
    paces = f" ({', '.join(f'{flops / ms / 1e9:.0f}' for ms in by_position)} TFLOP/s)"
    shown = ", ".join(f"{ms:.3f}" for ms in by_position)
    print(f"{label}, rested: replays 1-3 after 0.5 s idle {shown} ms{paces if flops else ''}; "
          f"samples after them: {' | '.join(samples[:5])}", flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-8b", help="preset (random weights)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=256, help="tokens per request, about")
    parser.add_argument("--target", type=float, default=80.0, help="roofline share, percent")
    parser.add_argument("--seconds", type=float, default=4.0, help="sustained, per graph")
    parser.add_argument("--rests", type=int, default=10, help="rested groups, step and products")
    args = parser.parse_args(argv)
    print("# python " + " ".join([sys.argv[0], *argv]), flush=True)
    print(torch.cuda.get_device_name(0), flush=True)
    bandwidth = measure_hbm_bandwidth("cuda")
    _, step_bytes, _ = roofline(args.model, Workload(args.batch, args.context, 0, 0), bandwidth)
    roof_ms = 1e3 * step_bytes / bandwidth
    head = f"{args.model} batch {args.batch} context ~{args.context}"
    print(f"{head}: roofline step {roof_ms:.2f} ms ({bandwidth / 1e12:.2f} TB/s copies)")

    core = engine_at_context(args.model, args.batch, args.context)
    step_graph = decode_graph(core, args.batch)
    step_ms = report(f"{head}, decode graph", step_graph, args.seconds)
    report_rested(f"{head}, decode graph", step_graph, args.rests)
    graph, flops, held = model_products(args.model, args.batch)
    products_ms = report(f"{head}, products alone", graph, args.seconds, flops)
    report_rested(f"{head}, products alone", graph, args.rests, flops)
    del graph, held
    torch.cuda.empty_cache()
    graph, big_flops, held = model_products(args.model, 4096)
    report(f"{args.model} products at 4096 rows", graph, args.seconds, big_flops)
    del graph, held
    torch.cuda.empty_cache()
    graph, square_flops, held = square_products(8192, 8)
    report("8192 x 8192 x 8192 products", graph, args.seconds, square_flops)

    rest_ms = step_ms - products_ms
    target_ms = roof_ms / (args.target / 100)
    allowed_ms = target_ms - rest_ms
    print(f"{head}: step {step_ms:.2f} ms ({100 * roof_ms / step_ms:.1f}%) = products "
          f"{products_ms:.2f} + the rest {rest_ms:.2f} ms; {args.target:.0f}% is a {target_ms:.2f} "
          f"ms step: the products in {allowed_ms:.2f} ms, {flops / allowed_ms / 1e9:.0f} TFLOP/s "
          f"({products_ms / allowed_ms:.2f}x their pace here)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
