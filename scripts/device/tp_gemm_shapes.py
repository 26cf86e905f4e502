"""llama-8b's four decode GEMMs at TP=1 and TP=2 shard sizes: how fast each runs, and whether
another cuBLAS path picks a better kernel for the slow ones.

    python scripts/device/tp_gemm_shapes.py [--rows 64,256]

Each GEMM ([rows, K] x [K, N]^T, bfloat16, as F.linear runs a projection) is captured 20 times
in one CUDA graph and replayed; it prints microseconds per GEMM and the weight bytes read per
second, for: F.linear with torch's default BLAS library, the same with
``torch.backends.cuda.preferred_blas_library("cublas")`` (classic cuBLAS heuristics instead of
cuBLASLt's), and the transposed product ``(W @ x^T)^T`` (the weight as the left operand).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
REPEATS = 20


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of this rank's weight [N, K]."""
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp
    return {
        "qkv_proj": (HIDDEN, qkv),
        "o_proj": (HEADS * HEAD_DIM // tp, HIDDEN),
        "gate_up_proj": (HIDDEN, 2 * INTER // tp),
        "down_proj": (INTER // tp, HIDDEN),
    }


def time_us(fn: Callable[[], torch.Tensor]) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * REPEATS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256")
    args = parser.parse_args()
    default_lib = torch.backends.cuda.preferred_blas_library()
    print(f"{torch.cuda.get_device_name()}; torch's default BLAS library: {default_lib}")
    columns = ("default us", "TB/s", "cublas us", "TB/s", "W@xT us", "TB/s")
    print(
        f"{'tp':>3} {'rows':>5} {'gemm':>13} {'K':>6} {'N':>6}  "
        + " ".join(f"{c:>10}" for c in columns)
    )
    for rows in map(int, args.rows.split(",")):
        for tp in (1, 2):
            for name, (k, n) in shapes(tp).items():
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                tb = n * k * 2 / 1e12
                torch.backends.cuda.preferred_blas_library(default_lib)
                plain = time_us(lambda x=x, w=w: F.linear(x, w))
                torch.backends.cuda.preferred_blas_library("cublas")
                classic = time_us(lambda x=x, w=w: F.linear(x, w))
                torch.backends.cuda.preferred_blas_library(default_lib)
                swapped = time_us(lambda x=x, w=w: torch.mm(w, x.t()).t())
                cells = [f"{us:>10.1f} {tb / us * 1e6:>10.2f}" for us in (plain, classic, swapped)]
                print(f"{tp:>3} {rows:>5} {name:>13} {k:>6} {n:>6}  " + " ".join(cells))


if __name__ == "__main__":
    main()
