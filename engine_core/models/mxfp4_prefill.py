"""gpt-oss's MXFP4 experts at prefill: dequantized into a scratch buffer, then bf16 grouped GEMMs.

With hundreds of rows an expert the layer is compute-bound, and widening the codes in registers
(mxfp4_kernels.py) redoes the conversion for every row block: at 2,048 tokens of gpt-oss-20b
7.4 ms against the bf16 fused MoE's 1.05 on the same shapes. Converting each weight once, into
bf16 (or the activations' dtype) in a scratch buffer, costs one pass over the experts (read 4.25
bits, write 16 a weight: about 2 GB at 20b's shape, well under a millisecond), after which the
GEMMs run on the tensor cores at bf16's speed:

1. ``align``: fused_moe's grouping of the (token, k) slots by expert (as the tiled path).
2. For each chunk of experts whose weights fit mxfp4.SCRATCH_BYTES (gpt-oss-120b's 128
   experts would need 6.4 GB at once): ``_dequantize_kernel`` writes the chunk's gate/up and
   down weights, exact (the bit-building conversion of mxfp4_kernels.widen, checked bit for bit
   against mxfp4.dequantize); ``_gate_up_kernel`` and ``_down_kernel`` (fused_moe's grouped
   GEMMs with gpt-oss's biases, clamped SwiGLU and rounding, mxfp4_kernels' epilogues) run the
   row blocks of the chunk's experts, the other blocks' programs return at once.
3. ``combine_slots``: each token's K slots summed in float32.

The scratch's bytes (mxfp4.scratch_bytes) are reserved by the start-up memory plan
(memory_plan.expert_scratch_bytes), so the KV cache never takes them. Nothing reads the host.
Importing this module imports triton (set ``TRITON_INTERPRET=1`` first to run on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import Blocks, align, block_rows, block_sizes, combine_slots
from engine_core.models.mxfp4 import Mxfp4Experts, chunk_experts
from engine_core.models.mxfp4_kernels import clamped_swiglu, load_codes, weighted_down, widen

_DEQUANTIZE_ROWS = 32  # weight rows a dequantizing program
_DEQUANTIZE_BYTES = 64  # code bytes (128 weights) of each row a dequantizing program


@triton.jit
def _dequantize_kernel(
    Codes,  # [rows, cols / 2] uint8 (rows: the chunk's experts' rows, consecutive)
    Scales,  # [rows, cols / 32] uint8
    Out,  # [rows, cols]
    rows,
    row_bytes,
    ROWS: tl.constexpr,
    BYTES: tl.constexpr,
):
    """Program (row block, byte block): ROWS rows' BYTES code bytes as 2 x BYTES weights."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b0 = tl.program_id(1) * BYTES
    jb = tl.arange(0, BYTES)
    row_ok = r < rows
    # load_codes' tiles are [bytes, rows]: K down, the weight rows across.
    code_offsets = r[None, :].to(tl.int64) * row_bytes + jb[:, None]
    scale_offsets = r[None, :].to(tl.int64) * (row_bytes // 16) + tl.arange(0, BYTES // 16)[:, None]
    packed, exponents = load_codes(Codes + b0, Scales + b0 // 16, code_offsets, scale_offsets,
                                   row_bytes - b0, (row_bytes - b0) // 16, row_ok)  # fmt: skip
    even, odd = widen(packed, exponents, Out.dtype.element_ty)  # [BYTES, ROWS] each
    values = tl.reshape(tl.join(tl.trans(even), tl.trans(odd)), (ROWS, 2 * BYTES))
    cols = 2 * b0 + tl.arange(0, 2 * BYTES)
    out_ptrs = Out + r[:, None].to(tl.int64) * (2 * row_bytes) + cols[None, :]
    tl.store(out_ptrs, values, mask=row_ok[:, None] & (cols < 2 * row_bytes)[None, :])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """blocks [..., rows, cols / 2] and scales [..., rows, cols / 32] (each contiguous) -> out
    [..., rows, cols] in out's dtype, as mxfp4.dequantize computes it (products below float32's
    normal range read as zero)."""
    row_bytes = blocks.shape[-1]
    rows = blocks.numel() // row_bytes
    grid = (triton.cdiv(rows, _DEQUANTIZE_ROWS), triton.cdiv(row_bytes, _DEQUANTIZE_BYTES))
    _dequantize_kernel[grid](
        blocks, scales, out, rows, row_bytes, ROWS=_DEQUANTIZE_ROWS, BYTES=_DEQUANTIZE_BYTES
    )
    return out


@triton.jit
def _chunk_rows(SortedSlots, BlockExperts, block_m, num_slots, first, count, BLOCK_M: tl.constexpr):
    """(this chunk's index of the block's expert, -1 outside the chunk; the block's slots)."""
    expert, slots = block_rows(SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, False)
    local = expert - first
    local = tl.where((expert >= 0) & (local < count) & (local >= 0), local, -1)
    return local, slots, expert


@triton.jit(do_not_specialize=["num_slots"])  # the slot count varies (mxfp4_kernels says why)
def _gate_up_kernel(
    X,  # [T, H]
    W13,  # [C, 2I, H]: the chunk's experts
    Bias,  # [E, 2I]
    Act,  # [S, I]
    SortedSlots,
    BlockExperts,
    stride_xt,
    stride_we,
    stride_wn,
    stride_be,
    num_slots,
    hidden,
    inter,
    first,  # the chunk's first expert
    count,  # its experts
    limit,
    alpha,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    local, slots, expert = _chunk_rows(
        SortedSlots, BlockExperts, block_m, num_slots, first, count, BLOCK_M
    )
    if local < 0:
        return
    row_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_xt + ks[None, :]
    w_base = W13 + local * stride_we + ks[:, None]
    gate_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn
    up_ptrs = gate_ptrs + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (ks + k0) < hidden
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(x, tl.load(gate_ptrs + k0, mask=w_mask, other=0.0), gate,
                      input_precision=PRECISION)  # fmt: skip
        up = tl.dot(x, tl.load(up_ptrs + k0, mask=w_mask, other=0.0), up,
                    input_precision=PRECISION)  # fmt: skip
    bias = Bias + expert * stride_be + cols
    gate_bias = tl.load(bias, mask=col_ok, other=0.0)[None, :]
    up_bias = tl.load(bias + inter, mask=col_ok, other=0.0)[None, :]
    dtype = Act.dtype.element_ty
    act = clamped_swiglu(gate, up, gate_bias, up_bias, limit, alpha, dtype)
    out_ptrs = Act + slots[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    Act,  # [S, I]
    W2,  # [C, H, I]
    Bias,  # [E, H]
    SlotWeights,  # [S] float32
    Out,  # [S, H] float32
    SortedSlots,
    BlockExperts,
    stride_we,
    stride_wn,
    stride_be,
    num_slots,
    hidden,
    inter,
    first,
    count,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    local, slots, expert = _chunk_rows(
        SortedSlots, BlockExperts, block_m, num_slots, first, count, BLOCK_M
    )
    if local < 0:
        return
    row_ok = slots < num_slots
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = Act + slots[:, None].to(tl.int64) * inter + ks[None, :]
    w_ptrs = W2 + local * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (ks + k0) < inter
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    bias = tl.load(Bias + expert * stride_be + cols, mask=col_ok, other=0.0)[None, :]
    weight = tl.load(SlotWeights + slots, mask=row_ok, other=0.0)[:, None]
    out = weighted_down(acc, bias, weight, Act.dtype.element_ty)
    out_ptrs = Out + slots[:, None].to(tl.int64) * hidden + cols[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def dequantized_moe_mxfp4(
    x: torch.Tensor,  # [T, H]
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: fused_moe.block_sizes' choice
    chunk: int | None = None,  # experts a chunk; None: as many as mxfp4.SCRATCH_BYTES holds
) -> torch.Tensor:
    """mxfp4_kernels.fused_moe_mxfp4's result through dequantized weights: [T, H] in x's
    dtype. The caller has checked the layout (mxfp4_kernels.check_layout)."""
    e = experts
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = e.w13_blocks.shape[0], x.shape[1]
    inter = e.w13_blocks.shape[1] // 2
    num_slots = num_tokens * top_k
    b = blocks or block_sizes(num_slots, num_experts, inter)
    chunk = chunk or chunk_experts(num_experts, hidden, inter, x.dtype)
    rows = align(topk_ids, num_experts, b.m)
    x = x.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    scratch = (
        torch.empty(chunk, 2 * inter, hidden, dtype=x.dtype, device=x.device),
        torch.empty(chunk, hidden, inter, dtype=x.dtype, device=x.device),
    )
    for first in range(0, num_experts, chunk):
        count = min(chunk, num_experts - first)
        w13, w2 = _dequantize_chunk(e, first, count, scratch)
        _chunk_gate_up(x, e, w13, act, rows, first, count, top_k, b)
        _chunk_down(act, e, w2, weights, out, rows, first, count, b)
    return combine_slots(out, top_k, x.dtype)


def _dequantize_chunk(
    e: Mxfp4Experts, first: int, count: int, scratch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [first, first + count)'s gate/up and down weights, dequantized into the
    scratch's first ``count`` experts."""
    chosen = slice(first, first + count)
    w13, w2 = scratch
    dequantize(e.w13_blocks[chosen].contiguous(), e.w13_scales[chosen].contiguous(), w13[:count])
    dequantize(e.w2_blocks[chosen].contiguous(), e.w2_scales[chosen].contiguous(), w2[:count])
    return w13, w2


def _precision(dtype: torch.dtype) -> str:
    """float32 models (the tests' comparisons) need exact float32 products, not TF32's."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _chunk_gate_up(
    x: torch.Tensor,
    e: Mxfp4Experts,
    w13: torch.Tensor,  # [C, 2I, H]: the chunk's experts, dequantized
    act: torch.Tensor,  # [S, I]: the chunk's slots' rows written
    rows: tuple[torch.Tensor, torch.Tensor],  # align's (sorted slots, block experts)
    first: int,
    count: int,
    top_k: int,
    b: Blocks,
) -> None:
    sorted_slots, block_experts = rows
    num_slots, inter = act.shape
    _gate_up_kernel[(block_experts.numel(), triton.cdiv(inter, b.n))](
        x, w13, e.b13, act, sorted_slots, block_experts,
        x.stride(0), w13.stride(0), w13.stride(1), e.b13.stride(0),
        num_slots, x.shape[1], inter, first, count, e.limit, e.alpha,
        TOP_K=top_k, PRECISION=_precision(x.dtype), BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip


def _chunk_down(
    act: torch.Tensor,  # [S, I]
    e: Mxfp4Experts,
    w2: torch.Tensor,  # [C, H, I]
    weights: torch.Tensor,  # [S] float32
    out: torch.Tensor,  # [S, H] float32: the chunk's slots' rows written
    rows: tuple[torch.Tensor, torch.Tensor],
    first: int,
    count: int,
    b: Blocks,
) -> None:
    sorted_slots, block_experts = rows
    num_slots, hidden = out.shape
    _down_kernel[(block_experts.numel(), triton.cdiv(hidden, b.n))](
        act, w2, e.b2, weights, out, sorted_slots, block_experts,
        w2.stride(0), w2.stride(1), e.b2.stride(0),
        num_slots, hidden, act.shape[1], first, count,
        PRECISION=_precision(act.dtype), BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
