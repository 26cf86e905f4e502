"""How cuBLAS's time for llama-8b's decode products grows with N and with M, on the GPU machine
(issue 17, llama-8b 256):

    python scripts/device/gemm_waves_probe.py [--model llama-8b] [--m 256]

The question: does a product at 256 rows lose time to its last partial wave of tiles, so that a
kernel that balances its tiles over the multiprocessors (stream-K) could run it faster? For each
projection (qkv, o, gate_up, down) alone, one call per layer over every layer's distinct weights
in one CUDA graph (so L2 holds no weights between calls):

- N from half to one and a half times the real N (in steps of 1/8, multiples of 256): a time
  that steps with N where the tile count crosses a multiple of the multiprocessor count says
  the waves are quantized; a time linear in N says they are not;
- M from 128 to 512 rows at the real shape: how far the matrix units are from their limit;
- the kernel cuBLAS picks at the real shape (its name carries the tile).

Prints microseconds per call and TFLOP/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_chain_probe import shapes, time_graph  # noqa: E402


def time_linear(m: int, n: int, k: int, layers: int) -> float:
    """Microseconds per F.linear call of [m, k] x [n, k]^T, one distinct weight per call."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def calls() -> None:
        for w in weights:
            F.linear(x, w)

    us = time_graph(calls, layers)
    weights.clear()
    torch.cuda.empty_cache()
    return us


def report(label: str, m: int, n: int, k: int, us: float) -> None:
    tflops = 2 * m * n * k / us / 1e6
    print(f"{label:8} M={m:4} N={n:6} K={k:6} {us:8.2f} us {tflops:6.0f} TFLOP/s", flush=True)


def kernel_name(m: int, n: int, k: int) -> str:
    """The CUDA kernel(s) one F.linear call of this shape launches."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    F.linear(x, w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.linear(x, w)
        torch.cuda.synchronize()
    return "; ".join(e.name for e in prof.events() if e.device_type.name == "CUDA")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16, help="distinct weights per graph")
    args = parser.parse_args()
    torch.manual_seed(0)
    proj, _ = shapes(args.model)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} multiprocessors", flush=True)
    for name, (n, k) in proj.items():
        print(f"{name}: {kernel_name(args.m, n, k)}", flush=True)
    for name, (n, k) in proj.items():
        for eighths in range(4, 13):
            scaled = max(256, round(n * eighths / 8 / 256) * 256)
            report(name, args.m, scaled, k, time_linear(args.m, scaled, k, args.layers))
    for name, (n, k) in proj.items():
        for m in (128, 192, 256, 320, 384, 512):
            report(name, m, n, k, time_linear(m, n, k, args.layers))


if __name__ == "__main__":
    main()
