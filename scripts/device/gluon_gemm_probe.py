"""A Gluon (Triton's explicit Hopper layer) GEMM with K splits against cuBLAS, at llama-8b's
decode products of 256 rows, on the GPU machine (issue 17, llama-8b 256):

    python scripts/device/gluon_gemm_probe.py [--model llama-8b] [--m 256] [--quick]
    python scripts/device/gluon_gemm_probe.py --compile-only   # any machine: build for sm_90

The question: can a kernel with larger tiles and K splits beat cuBLAS where cuBLAS's own tiles
(128 x 64 for o and down, from gemm_waves_probe.py) read the activations many times over? Each
program computes one [BLOCK_M, BLOCK_N] tile of X @ W.T over one K slice: TMA loads into a ring
of STAGES shared-memory buffers, each tile multiplied by an asynchronous warpgroup MMA (WGMMA)
while the loads of the next ones are in flight, the float32 accumulator in registers. One split
writes bf16; several write float32 partials that the skinny GEMM's reduction kernel sums
(``skinny_gemm._reduce_splits``, a second launch, timed with the product).

Each projection alone, one call per layer over 16 layers' distinct weights in one CUDA graph (so
L2 holds no weights between calls), every shape checked against F.linear. Prints microseconds
per call and TFLOP/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@gluon.constexpr_function
def _warps_per_cta(block_m: int, num_warps: int) -> list[int]:
    """Warps along M first (a warpgroup's MMA covers 64 rows), then along N."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


@gluon.constexpr_function
def _instr_n(block_m: int, block_n: int, num_warps: int) -> int:
    """The widest WGMMA instruction N (a multiple of 8 up to 256) that tiles BLOCK_N."""
    n_reps = triton.cdiv(num_warps, triton.cdiv(block_m, 16))
    most = max(block_n // n_reps, 8)
    n = 256
    while n > most or block_n % n:
        n -= 8
    return n


@gluon.jit
def _issue_load(a_desc, b_desc, bars, a_bufs, b_bufs, off_m, off_n, k, index, pred):
    bar = bars.index(index)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_bufs.index(index), pred)


@gluon.jit
def _splitk_gemm_kernel(
    a_desc,
    b_desc,
    c_ptr,
    M,
    N,
    K_PER_SPLIT,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """C[split * M + tile rows, tile cols] = X[tile rows, K slice] @ W[tile cols, K slice].T."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    split = gl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k0 = split * K_PER_SPLIT
    iters = K_PER_SPLIT // BLOCK_K

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=_warps_per_cta(BLOCK_M, num_warps),
        instr_shape=[16, _instr_n(BLOCK_M, BLOCK_N, num_warps), 16],
    )
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)

    # STAGES - 2 loads ahead: the buffer a load refills was read by the MMA two tiles back,
    # which the wait for at most one outstanding MMA has retired.
    for i in gl.static_range(STAGES - 2):
        _issue_load(a_desc, b_desc, bars, a_bufs, b_bufs, off_m, off_n, k0 + i * BLOCK_K, i,
                    i < iters)  # fmt: skip
    for i in range(iters):
        ahead = i + STAGES - 2
        _issue_load(a_desc, b_desc, bars, a_bufs, b_bufs, off_m, off_n, k0 + ahead * BLOCK_K,
                    ahead % STAGES, ahead < iters)  # fmt: skip
        index = i % STAGES
        mbarrier.wait(bars.index(index), (i // STAGES) & 1)
        acc = warpgroup_mma(
            a_bufs.index(index), b_bufs.index(index).permute((1, 0)), acc, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    offsets = (split * M + rows).to(gl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    gl.store(c_ptr + offsets, acc.to(c_ptr.dtype.element_ty), mask=mask)


def splitk_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    stages: int,
    splits: int,
    num_warps: int,
    part: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """X [M, K] @ W [N, K].T as bf16 [M, N]; ``part`` float32 [splits * M, N] where splits > 1."""
    m, k = x.shape
    n = w.shape[0]
    if k % (splits * block_k):
        raise ValueError(f"K={k} is not a multiple of {splits} splits of {block_k}")
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(x, [block_m, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(w, [block_n, block_k], b_layout)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if splits > 1 and part is None:
        part = torch.empty((splits * m, n), dtype=torch.float32, device=x.device)
    target = out if splits == 1 else part
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _splitk_gemm_kernel[grid](a_desc, b_desc, target, m, n, k // splits, block_m, block_n, stages,
                              num_warps=num_warps)  # fmt: skip
    if splits > 1:
        from engine_core.models.skinny_gemm import _reduce_splits

        _reduce_splits(part.view(splits, m, n), out, None)
    return out


# (block_m, block_n, block_k, stages, splits, num_warps)
CONFIGS = {
    "qkv": [(256, 128, 64, 4, 1, 8), (128, 256, 64, 4, 1, 8), (128, 128, 64, 5, 1, 8),
            (256, 128, 64, 4, 2, 8), (128, 128, 64, 5, 2, 8)],
    "o": [(256, 128, 64, 4, 4, 8), (128, 256, 64, 4, 4, 8), (128, 128, 64, 5, 2, 8),
          (256, 128, 64, 4, 2, 8), (128, 128, 64, 5, 4, 8)],
    "gate_up": [(256, 128, 64, 4, 1, 8), (128, 256, 64, 4, 1, 8), (128, 128, 64, 5, 1, 8)],
    "down": [(256, 128, 64, 4, 4, 8), (128, 256, 64, 4, 4, 8), (256, 128, 64, 4, 2, 8),
             (128, 128, 64, 5, 2, 8), (128, 128, 64, 5, 4, 8), (256, 128, 64, 3, 4, 8)],
}  # fmt: skip


def probe(model: str, m: int, quick: bool) -> None:
    from bf16_chain_probe import shapes, time_graph

    torch.manual_seed(0)
    proj, _ = shapes(model)
    layers = 16
    for name, (n, k) in proj.items():
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(layers)
        ]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0]).float()

        def cublas_calls(x: torch.Tensor = x, weights: list = weights) -> None:
            for w in weights:
                F.linear(x, w)

        base = time_graph(cublas_calls, layers)
        flops = 2 * m * n * k
        print(f"{name:8} M={m} N={n:6} K={k:6} cuBLAS {base:7.2f} us "
              f"{flops / base / 1e6:5.0f} TFLOP/s", flush=True)  # fmt: skip
        for cfg in CONFIGS[name][: 2 if quick else None]:
            bm, bn, bk, stages, splits, warps = cfg
            try:
                part = torch.empty((splits * m, n), dtype=torch.float32, device="cuda")
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                got = splitk_gemm(x, weights[0], *cfg, part=part, out=out).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()

                def calls(x: torch.Tensor = x, weights: list = weights, cfg: tuple = cfg,
                          part: torch.Tensor = part, out: torch.Tensor = out) -> None:  # fmt: skip
                    for w in weights:
                        splitk_gemm(x, w, *cfg, part=part, out=out)

                us = time_graph(calls, layers)
            except Exception as exc:  # a shape the compiler or the GPU refuses: report, go on
                print(f"{name:8} {bm}x{bn}x{bk} s{stages} k{splits} w{warps}: failed: "
                      f"{type(exc).__name__}: {str(exc)[:300]}", flush=True)  # fmt: skip
                continue
            print(f"{name:8} M={m} gluon {bm}x{bn}x{bk} stages {stages} splits {splits} warps "
                  f"{warps}: {us:7.2f} us {flops / us / 1e6:5.0f} TFLOP/s ({base / us:.2f}x "
                  f"cuBLAS), max error / max |ref| {err:.2e}", flush=True)  # fmt: skip
        weights.clear()
        torch.cuda.empty_cache()


class _CompileOnlyDriver:
    """Enough of a Triton driver to compile for an H100 on a machine without one."""

    def __init__(self) -> None:
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_only() -> None:
    """Build every configuration for sm_90 without a GPU (catches layout and API errors)."""
    triton.runtime.driver.set_active(_CompileOnlyDriver())
    for name, configs in CONFIGS.items():
        for bm, bn, bk, stages, splits, warps in configs:
            x = torch.empty((256, 4096), dtype=torch.bfloat16)
            w = torch.empty((4096, 4096), dtype=torch.bfloat16)
            a_desc = TensorDescriptor.from_tensor(
                x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
            )
            b_desc = TensorDescriptor.from_tensor(
                w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
            )
            c = torch.empty((splits * 256, 4096), dtype=torch.float32 if splits > 1 else x.dtype)
            kernel = _splitk_gemm_kernel.warmup(
                a_desc, b_desc, c, 256, 4096, 4096 // splits, bm, bn, stages,
                num_warps=warps, grid=(1,),
            )  # fmt: skip
            wgmma = kernel.asm["ptx"].count("wgmma.mma_async")
            print(f"{name} {bm}x{bn}x{bk} s{stages} k{splits} w{warps}: compiled, "
                  f"{kernel.metadata.shared} bytes of shared memory, {wgmma} WGMMA "
                  f"instructions")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="two shapes a projection")
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90, no GPU")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
    else:
        probe(args.model, args.m, args.quick)


if __name__ == "__main__":
    main()
