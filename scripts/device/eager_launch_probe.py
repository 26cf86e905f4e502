"""Host time of one eager call of each path a plain decode-sized projection can take, on the GPU
machine (issue 17: is the skinny Triton GEMM's launch dearer than cuBLAS's outside CUDA graphs?):

    python scripts/device/eager_launch_probe.py [--rows 64] [--calls 2000]

For smollm2-135m's and llama-1b's projections at ``rows`` rows: ``F.linear`` (cuBLAS), the
skinny GEMM (``skinny_gemm.decode_linear``) and, for gate_up, the GLU epilogue
(``decode_glu``) against cuBLAS with the interleaved SiLU-and-mul. Each path is called
``calls`` times back to back, eagerly; the GPU work of a call is a few microseconds, so the
time per call is the host's launch path (where the GPU work is longer, as llama-1b's down
projection's 17 us, the faster path's figure is bounded by the GPU instead). The paths
alternate over five rounds in one process (host speed differs between processes on these
machines); the medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_chain_probe import shapes  # noqa: E402

from engine_core.models import skinny_gemm, triton_ops  # noqa: E402


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def paths(model: str, rows: int) -> dict[str, Callable[[], object]]:
    proj, dims = shapes(model)
    hidden, inter = dims["hidden"], proj["down"][1]
    out: dict[str, Callable[[], object]] = {}
    for name in ("qkv", "o", "down"):
        n, k = proj[name]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        out[f"{name} cuBLAS"] = lambda x=x, w=w: F.linear(x, w)
        out[f"{name} skinny"] = lambda x=x, w=w: skinny_gemm.decode_linear(x, w, None)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = skinny_gemm.interleave_gate_up(
        torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    )
    out["gate_up+silu cuBLAS"] = lambda: triton_ops.silu_and_mul(
        F.linear(x, w), skinny_gemm.GLU_HALF
    )
    out["gate_up+silu epilogue"] = lambda: skinny_gemm.decode_glu(x, w)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,llama-1b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for model in args.models.split(","):
        fns = paths(model, args.rows)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(5):
            for name, fn in fns.items():
                times[name].append(per_call_us(fn, args.calls))
        for name, values in times.items():
            print(
                f"{model:13} {args.rows} rows {name:22} {statistics.median(values):7.2f} us a "
                f"call (rounds: {', '.join(f'{v:.1f}' for v in values)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
