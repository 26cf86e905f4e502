"""FP8 row-wise GEMM at decode sizes on the GPU: torch._scaled_mm (cuBLASLt, what
models/fp8_kernels.py runs) against the bf16 matmul, on llama-8b's projections. Each GEMM is
timed alone (launch included), so small ones read far below the bandwidth they reach inside a
CUDA graph; the comparison between columns is the point.

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

from engine_core.models.fp8_kernels import fp8_rowwise_gemm, quantize_per_token  # noqa: E402

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
    print("| shape | M | bf16 us (TB/s) | FP8 us (TB/s) |")
    print("|---|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        scale = w16.float().abs().amax(1) / 448
        w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
        for m in (1, 16, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_per_token(x)
            bf16 = time_us(lambda: x @ w16.T)  # noqa: B023
            fp8 = time_us(lambda: fp8_rowwise_gemm(xq, xs, w8, scale, torch.bfloat16))  # noqa: B023
            cells = [f"{t:.1f} ({b / t / 1e6:.2f})" for t, b in ((bf16, 2 * n * k), (fp8, n * k))]
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
