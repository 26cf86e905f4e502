"""Causal attention of fresh prompts over their own K/V as the step's contiguous tensors, loaded
through tensor (TMA) descriptors: an experiment beside the paged prefill kernel
(triton_kernels.py), measured by ``python -m benchmarks attention --contiguous``.

Why: the paged kernel gathers each 16-token page of K and V through the block table, one
pointer per row, and reaches 250-330 TFLOP/s at llama-8b's heads where torch's flash
attention over contiguous K/V reaches 460-580 (docs/design/kernels-and-limits.md, "Long prompts
and prefill beside vLLM"). A fresh prompt's keys are the step's own new tokens, which the layer
holds contiguously before the cache write; a descriptor load of a [BLOCK_N, head_dim] tile is
one bulk copy the Hopper TMA unit does for the whole tile. Whether that closes the gap is what
the benchmark measures; no engine path calls this module.

Only fresh prompts (no cached context, no window, chunk, sinks or FP8 cache), K already rotated.
The work list is the paged kernel's (prefill_tiles.py, ``work_list_row``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_core.attention.prefill_tiles import device_tiles
from engine_core.attention.triton_kernels import (
    LOG2E,
    dot_precision,
    softmax_step,
    work_list_row,
)


@dataclass(frozen=True)
class ContiguousLaunch:
    """Query rows a tile, keys an iteration, warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


@triton.jit(do_not_specialize=["num_tokens"])
def _contiguous_prefill_kernel(
    Q,  # [T, heads * HEAD_DIM]
    K,  # [T, kv_heads * HEAD_DIM]
    V,
    QSL,
    TILES,
    Out,  # [T, heads * HEAD_DIM]
    scale_log2,
    num_tokens,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    named, seq, tile, q_start, q_len = work_list_row(TILES, QSL)
    head = tl.program_id(1)
    if named >= 0 and tile * BLOCK_M < q_len:
        kv_col = (head // (HEADS // KV_HEADS)) * HEAD_DIM
        q_desc = tl.make_tensor_descriptor(
            Q, [num_tokens, HEADS * HEAD_DIM], [HEADS * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM]
        )
        k_desc = tl.make_tensor_descriptor(
            K, [num_tokens, KV_HEADS * HEAD_DIM], [KV_HEADS * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]
        )
        v_desc = tl.make_tensor_descriptor(
            V, [num_tokens, KV_HEADS * HEAD_DIM], [KV_HEADS * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]
        )
        first = tile * BLOCK_M
        q = q_desc.load([q_start + first, head * HEAD_DIM])
        rows = first + tl.arange(0, BLOCK_M)  # positions in the sequence
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # Key tiles that end at or before the tile's first row: every row sees them, no mask.
        masked_from = (first + 1) // BLOCK_N * BLOCK_N
        for n0 in range(0, masked_from, BLOCK_N):
            k = k_desc.load([q_start + n0, kv_col])
            v = v_desc.load([q_start + n0, kv_col])
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        # Rows past the sequence's end read the next sequence's keys (or the descriptor's zero
        # fill past the step): the causal mask and the key bound leave them out.
        hi = tl.minimum(q_len, first + BLOCK_M)
        for n0 in range(masked_from, hi, BLOCK_N):
            k = k_desc.load([q_start + n0, kv_col])
            v = v_desc.load([q_start + n0, kv_col])
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            offs = n0 + tl.arange(0, BLOCK_N)
            visible = (offs[None, :] <= rows[:, None]) & (offs[None, :] < q_len)
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        d = tl.arange(0, HEAD_DIM)
        o_rows = (q_start + rows).to(tl.int64)
        o_ptr = Out + o_rows[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors the kernel builds on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def contiguous_prefill_attention(
    q: torch.Tensor,  # [T, heads, head_dim], contiguous
    k: torch.Tensor,  # [T, kv_heads, head_dim], contiguous, rotated
    v: torch.Tensor,  # [T, kv_heads, head_dim], contiguous
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    launch: ContiguousLaunch = ContiguousLaunch(),
    tiles: torch.Tensor | None = None,  # [rows, 2] int32, prefill_tiles.py's for block_m
) -> torch.Tensor:  # [T, heads, head_dim]
    """Causal attention of each sequence's tokens over its own (fresh prompts only)."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim not in (64, 128) or heads % kv_heads:
        raise ValueError(f"head dim {head_dim} with {heads}/{kv_heads} heads: not served here")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if q.is_cuda:
        triton.set_allocator(_scratch)
    if tiles is None:
        tiles = device_tiles(query_start_loc.tolist(), q.device, launch.block_m)
    out = torch.empty_like(q)
    _contiguous_prefill_kernel[(tiles.shape[0], heads)](
        q,
        k,
        v,
        query_start_loc,
        tiles,
        out,
        scale * LOG2E,
        num_tokens,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        PRECISION=dot_precision(q.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
