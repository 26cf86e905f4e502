"""FP8 row-wise GEMM at decode sizes on the GPU: torch._scaled_mm (cuBLASLt) against our Triton
kernel, with the bf16 matmul beside them, on llama-8b's projections.

    python scripts/device/fp8_gemm_bench.py

Prints microseconds per GEMM (median of 200 CUDA-event timings) and the weight bytes each reads
per second (TB/s).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.models.fp8_kernels import (  # noqa: E402
    fp8_rowwise_gemm_cublas,
    fp8_rowwise_gemm_triton,
    quantize_per_token,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_us(fn: Callable[[], object], iters: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}")
    print("| shape | M | bf16 us (TB/s) | cuBLAS fp8 us (TB/s) | Triton fp8 us (TB/s) |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        scale = w16.float().abs().amax(1) / 448
        w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
        for m in (1, 16, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_per_token(x)
            bf16 = time_us(lambda: x @ w16.T)  # noqa: B023
            cublas = time_us(lambda: fp8_rowwise_gemm_cublas(xq, xs, w8, scale, torch.bfloat16))  # noqa: B023
            tri = time_us(lambda: fp8_rowwise_gemm_triton(xq, xs, w8, scale, torch.bfloat16))  # noqa: B023
            cells = [f"{t:.1f} ({b / t / 1e6:.2f})" for t, b in
                     ((bf16, 2 * n * k), (cublas, n * k), (tri, n * k))]  # fmt: skip
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
