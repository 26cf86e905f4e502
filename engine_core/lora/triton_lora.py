"""The LoRA product of a batch on CUDA: two Triton segment kernels, shrink then expand.

A step's rows that use an adapter come in segments (a request's contiguous rows, neighbours of
one slot merged: ``LoraBatch.segments``). ``shrink`` computes ``t = x[seg] @ A[slot].T`` for
every segment into a float32 buffer [T, R'] (R' = shards * max_rank); ``expand`` adds
``t[seg] @ B[slot].T`` into the base projection's output in place. Each program takes one tile
of one segment, so rows of different adapters never share a tile and rows of the base model
are never read; a slot's A or B tile is read once per row tile, not once per row (the peers'
SGMV idea, our own kernels).

Tested against the torch reference (``layers.add_lora``) on a GPU (tests/test_lora_gpu.py) and
through Triton's interpreter on the CPU (tests/test_lora_triton_interpreted.py, under
``TRITON_INTERPRET=1``). Not yet graph-safe: the grid's row-tile count comes from the host
(``max_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.lora.batch import LoraSegments

BLOCK_M = 16  # rows of a segment per program
BLOCK_K = 64  # reduction tile
BLOCK_N = 64  # output columns per program (rank columns for shrink, output rows for expand)


@triton.jit
def _segment_matmul_kernel(
    X,  # [T, K] the rows (shrink: the input; expand: the shrunk rows)
    W,  # [S, N, K] each slot's matrix (shrink: A; expand: B)
    Out,  # [T, N] (shrink: written, float32; expand: added to)
    SegStart,
    SegLen,
    SegSlot,
    K,
    N,
    stride_xm,
    stride_ws,
    stride_wn,
    stride_om,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    length = tl.load(SegLen + seg)
    if tile * BLOCK_M >= length:
        return
    start = tl.load(SegStart + seg)
    slot = tl.load(SegSlot + seg).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (start + offs_m).to(tl.int64)
    row_ok = offs_m < length
    col_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            X + rows[:, None] * stride_xm + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            W + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
    out_ptrs = Out + rows[:, None] * stride_om + offs_n[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask)


def _segment_matmul(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, segs: LoraSegments, accumulate: bool
) -> None:
    """out[seg] (+)= x[seg] @ w[slot].T for every segment (x [T, K], w [S, N, K], out [T, N])."""
    n, k = w.shape[1], w.shape[2]
    grid = (segs.count, triton.cdiv(segs.max_rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _segment_matmul_kernel[grid](
        x, w, out, segs.starts, segs.lengths, segs.slots, k, n,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def add_lora_segments(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segs: LoraSegments
) -> torch.Tensor:
    """out [T, O] += each segment's x @ A[slot].T @ B[slot].T (x [T, I], a [S, R, I],
    b [S, O, R]); rows outside every segment are left as they are."""
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    shrunk = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)  # [T, R]
    _segment_matmul(x, a, shrunk, segs, accumulate=False)
    _segment_matmul(shrunk, b, out, segs, accumulate=True)
    return out
