"""W4A16 experts at prefill: dequantized into a scratch buffer, then fused_moe's grouped GEMMs.

With hundreds of rows an expert the layer is compute-bound, and the tiled kernels of
w4a16_moe_kernels.py redo each weight's conversion for every row block (and their register
tiles spill): qwen3-30b-a3b's layer at 2,048 tokens took 4,976 us against the bf16 fused MoE's
690 on the same shapes. Converting each weight once, into the activations' dtype in a scratch
buffer, costs one pass over the experts (read 4 bits and a share of the scales, write 16 a
weight), after which the GEMMs are the bf16 layer's own (fused_moe.py):

1. ``align``: fused_moe's grouping of the (token, k) slots by expert, once for the step.
2. For each chunk of experts whose weights fit mxfp4.SCRATCH_BYTES (the bound both formats'
   prefill scratch shares; qwen3-30b-a3b's 128 experts need 1.2 GB in bf16: two chunks):
   ``_dequantize_kernel`` writes the chunk's gate/up and down weights as ``(q - zero) * scale``
   in float32, rounded once to the activations' dtype: bit for bit what the CPU reference
   (w4a16.dequantize, then ``.to(dtype)``) computes. Then fused_moe's gate/up and down GEMMs run
   over the row blocks of the chunk's experts; the other blocks' expert reads -1 for this
   chunk, and their programs return at once.
3. ``combine_slots``: each token's K slots summed in float32.

The scratch's bytes are reserved by the start-up memory plan (memory_plan.expert_scratch_bytes)
and taken from the caching allocator per call, as MXFP4's are: a step this long runs eagerly
(CUDA graphs hold decode steps). Nothing reads the host. Importing this module imports triton
(set ``TRITON_INTERPRET=1`` first to run on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import (
    Blocks,
    align,
    block_sizes,
    combine_slots,
    grouped_gemms_into,
)
from engine_core.models.mxfp4 import chunk_experts
from engine_core.models.w4a16 import PACK, SYMMETRIC_ZERO, W4A16Experts

_ROWS = 16  # weight rows a dequantizing program
_COLS = 256  # weight columns (32 words) of each row a dequantizing program
_SYMMETRIC = tl.constexpr(float(SYMMETRIC_ZERO))


@triton.jit
def _dequantize_kernel(
    QWeight,  # [C, N, K / 8] int32: the chunk's experts, w4a16.py's layout
    Scales,  # [C, G, N] float32
    Zeros,  # [C, G, N] uint8 (unread without HAS_ZEROS)
    Out,  # [C, N, K]
    rows,  # C * N
    n,  # rows an expert
    k,  # columns a row
    groups,  # G
    GROUP: tl.constexpr,  # columns a scale
    HAS_ZEROS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Program (row block, column block): ROWS rows' COLS weights, each ``(q - zero) * scale``."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = (r < rows)[:, None] & (c < k)[None, :]
    r64 = r.to(tl.int64)
    # Each word is read for its eight columns; the repeats come from the L1.
    words = tl.load(QWeight + r64[:, None] * (k // 8) + (c // 8)[None, :], mask=mask, other=0)
    q = ((words >> (4 * (c % 8))[None, :]) & 0xF).to(tl.float32)
    expert, row = r64 // n, r64 % n
    group = (c // GROUP).to(tl.int64)
    offsets = (expert * groups)[:, None] * n + group[None, :] * n + row[:, None]
    scale = tl.load(Scales + offsets, mask=mask, other=0.0)
    zero = tl.load(Zeros + offsets, mask=mask, other=0).to(tl.float32) if HAS_ZEROS else _SYMMETRIC
    w = (q - zero) * scale
    tl.store(Out + r64[:, None] * k + c[None, :], w.to(Out.dtype.element_ty), mask=mask)


def dequantize_experts(
    qweight: torch.Tensor,  # [C, N, K / 8] int32, contiguous
    scales: torch.Tensor,  # [C, G, N] float32, contiguous
    zeros: torch.Tensor | None,  # [C, G, N] uint8, contiguous
    group: int,  # columns a scale
    out: torch.Tensor,  # [C, N, K], contiguous: written in its dtype
) -> torch.Tensor:
    """Experts' weights [C, N, K] as the CPU reference dequantizes them (w4a16.dequantize,
    rounded once to out's dtype)."""
    experts, n, words = qweight.shape
    k = words * PACK
    rows = experts * n
    grid = (triton.cdiv(rows, _ROWS), triton.cdiv(k, _COLS))
    _dequantize_kernel[grid](
        qweight, scales, zeros if zeros is not None else scales, out, rows, n, k,
        scales.shape[1], GROUP=group, HAS_ZEROS=zeros is not None, ROWS=_ROWS, COLS=_COLS,
    )  # fmt: skip
    return out


def dequantized_moe_w4a16(
    x: torch.Tensor,  # [T, H]
    experts: W4A16Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: fused_moe.block_sizes' choice
    chunk: int | None = None,  # experts a chunk; None: as many as mxfp4.SCRATCH_BYTES holds
) -> torch.Tensor:
    """w4a16_moe_kernels.fused_moe_w4a16's result through dequantized weights: [T, H] in x's
    dtype. The caller has checked the layout (w4a16_moe_kernels.check_layout)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, rows, _ = experts.w13_qweight.shape
    hidden, inter = x.shape[1], rows // 2
    num_slots = num_tokens * top_k
    b = blocks or block_sizes(num_slots, num_experts, inter)
    chunk = chunk or chunk_experts(num_experts, hidden, inter, x.dtype)
    sorted_slots, block_experts = align(topk_ids, num_experts, b.m)
    x = x.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    scratch = (
        torch.empty(chunk, 2 * inter, hidden, dtype=x.dtype, device=x.device),
        torch.empty(chunk, hidden, inter, dtype=x.dtype, device=x.device),
    )
    for first in range(0, num_experts, chunk):
        count = min(chunk, num_experts - first)
        w13, w2 = _dequantize_chunk(experts, first, count, scratch)
        local = _chunk_blocks(block_experts, first, count, num_experts)
        grouped_gemms_into(x, w13, w2, weights, top_k, (sorted_slots, local), (b, b), (act, out))
    return combine_slots(out, top_k, x.dtype)


def _dequantize_chunk(
    e: W4A16Experts, first: int, count: int, scratch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [first, first + count)'s gate/up and down weights, dequantized into the
    scratch's first ``count`` experts."""
    chosen = slice(first, first + count)
    w13, w2 = scratch[0][:count], scratch[1][:count]

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[chosen]

    group13, group2 = e.groups
    dequantize_experts(e.w13_qweight[chosen], e.w13_scales[chosen], part(e.w13_zeros), group13, w13)
    dequantize_experts(e.w2_qweight[chosen], e.w2_scales[chosen], part(e.w2_zeros), group2, w2)
    if e.w13_perm is not None:
        w13 = unsort_columns(w13, e.w13_perm[chosen])
    if e.w2_perm is not None:
        w2 = unsort_columns(w2, e.w2_perm[chosen])
    return w13, w2


def unsort_columns(weights: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Act-order experts' dequantized weights [C, N, K], their columns sorted by group (column
    j is the input's perm[c, j]), back in the input's order: the GEMMs then take x as it is.
    A new tensor of the chunk's size, so act-order doubles the scratch at prefill (steps this
    long are not captured in graphs)."""
    restored = torch.empty_like(weights)
    index = perm.to(torch.int64)[:, None, :].expand_as(weights)
    return restored.scatter_(2, index, weights)


def _chunk_blocks(
    block_experts: torch.Tensor, first: int, count: int, num_experts: int
) -> torch.Tensor:
    """align's expert of each row block as the chunk's index of it, -1 outside the chunk (the
    GEMMs skip those blocks; -1 past the last block stays -1)."""
    if first == 0 and count == num_experts:
        return block_experts
    local = block_experts - first
    return torch.where((block_experts >= first) & (local < count), local, -1)
