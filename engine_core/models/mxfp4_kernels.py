"""gpt-oss's MXFP4 experts on CUDA: fused_moe's grouping with GEMMs that read MXFP4 directly.

Hopper has no FP4 tensor cores, so the win is in the bytes: a weight is read as 4.25 bits (half
a byte of e2m1 code, a 32nd of an e8m0 scale byte) and widened to the activations' dtype in
registers, then multiplied on the bf16 (or fp16 / float32) tensor cores. The layer is four or
five launches, as fused_moe's (models/fused_moe.py, which this module reuses for ``align``,
``block_rows`` and ``combine_kernel``):

1. ``align``: the (token, k) slots sorted by expert, each expert's run padded to BLOCK_M rows
   (skipped for a single token: its K experts are distinct, one slot a row block).
2. ``_gate_up_kernel``: for a block of sorted rows and a block of intermediate columns, the
   tokens' rows times the expert's gate and up rows (``w13`` as models/gpt_oss.py loads it:
   gate rows, then up rows, so gate row n and up row n sit I rows apart, never interleaved),
   plus their biases, then gpt-oss's clamped SwiGLU, written per slot.
3. ``_down_kernel``: each slot's activation times the expert's down rows, plus the bias, rounded
   to the activations' dtype as the reference rounds its linear, times the routing weight,
   written per slot in float32.
4. ``combine_kernel``: each token's K slots summed in float32, rounded once.

The layout is kept as loaded (``*_blocks [E, rows, cols / 2]`` uint8, ``*_scales [E, rows,
cols / 32]`` uint8): a tile is a few rows of consecutive bytes along K, the same access as a bf16
tile of a quarter of the width. Byte j of a row holds columns 2j (low nibble) and 2j + 1 (high
nibble), so instead of interleaving the two nibble planes into one [K, N] tile (a shuffle across
registers), each plane is multiplied by the activations' even or odd columns: two dots of K/2
per tile, which sum to the same product.

A code becomes a float by building its bits, no table and no multiply: an e2m1 code
(sign, exponent e, mantissa m) times 2^(scale - 127) has the float32/bf16 exponent field
``e + scale - 1`` and mantissa bit ``m if e else 0`` (e = 0, m = 1 is e2m1's one subnormal,
0.5: 1.0 an exponent down). bf16 and float32 share the 8-bit exponent, so the same field
serves both. Products below float32's normal range (a field below 1: scales under 2^-125) read
as zero, and scales of 2^126 and up, which overflow float32, are not read correctly; neither
occurs in trained weights (the reference quantizer gives all-zero blocks the scale 2^-127,
whose codes are all zero).

Importing this module imports triton: only CUDA code paths and GPU tests may do so (or set
``TRITON_INTERPRET=1`` first to run on CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import (
    Blocks,
    align,
    block_rows,
    combine_kernel,
)
from engine_core.models.mxfp4 import BLOCK, Mxfp4Experts

_SCALE_BYTES = tl.constexpr(BLOCK // 2)  # code bytes per scale


@triton.jit
def _e2m1_values(codes, exponents, dtype: tl.constexpr):
    """e2m1 codes (int32, 0..15) times 2^(exponents - 127) (int32 e8m0 bytes, broadcast) as
    dtype, by building the bits (module docstring). Exact wherever the product is a normal
    float32."""
    magnitude = codes & 7
    e = magnitude >> 1
    field = e + exponents - 1
    mantissa = tl.where(e > 0, magnitude & 1, 0)
    zero = (magnitude == 0) | (field <= 0)
    if dtype == tl.bfloat16:  # the top half of the float32 bits
        bits = ((codes & 8) << 12) | (field << 7) | (mantissa << 6)
        bits = tl.where(zero, 0, bits).to(tl.int16)
        return bits.to(tl.bfloat16, bitcast=True)
    bits = ((codes & 8) << 28) | (field << 23) | (mantissa << 22)
    values = tl.where(zero, 0, bits).to(tl.float32, bitcast=True)
    return values.to(dtype)


@triton.jit
def weight_planes(Codes, Scales, code_rows, scale_rows, kb, ok, dtype: tl.constexpr):
    """A [BYTES, BLOCK_N] tile of MXFP4 weight rows, transposed for tl.dot: (even columns,
    odd columns) in dtype. code_rows / scale_rows [1, BLOCK_N]: each row's offset into Codes /
    Scales; kb [BYTES, 1]: the tile's byte columns; ok: the mask."""
    packed = tl.load(Codes + code_rows + kb, mask=ok, other=0).to(tl.int32)
    exponents = tl.load(Scales + scale_rows + kb // _SCALE_BYTES, mask=ok, other=0).to(tl.int32)
    even = _e2m1_values(packed & 0xF, exponents, dtype)
    odd = _e2m1_values(packed >> 4, exponents, dtype)
    return even, odd


@triton.jit
def _dot_mxfp4(
    acc,
    a_ptrs,
    a_ok,
    Codes,
    Scales,
    code_rows,
    scale_rows,
    kb,
    w_ok,
    dtype: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + A's tile times a weight tile: A's even columns times the low nibbles, its odd
    columns times the high ones. a_ptrs [BLOCK_M, BYTES] point at A's even columns."""
    even, odd = weight_planes(Codes, Scales, code_rows, scale_rows, kb, w_ok, dtype)
    a_even = tl.load(a_ptrs, mask=a_ok, other=0.0)
    a_odd = tl.load(a_ptrs + 1, mask=a_ok, other=0.0)
    acc = tl.dot(a_even, even, acc, input_precision=PRECISION)
    return tl.dot(a_odd, odd, acc, input_precision=PRECISION)


# The slot count changes from step to step: not specialized (fused_moe._gate_up_kernel says why).
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    X,  # [T, H]
    Codes,  # [E, 2I, H/2] uint8
    Scales,  # [E, 2I, H/32] uint8
    Bias,  # [E, 2I]
    Act,  # [S, I] (S = T*K slots)
    SortedSlots,  # [R] slot of each sorted row; S for padding
    BlockExperts,  # [R // BLOCK_M] expert of each block of rows; -1 past the last one
    stride_xt,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    stride_be,
    stride_as,
    num_slots,
    hidden,
    inter,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # weight columns a step: BLOCK_K / 2 bytes
    ONE_SLOT_PER_BLOCK: tl.constexpr = False,
):
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    expert, slots = block_rows(
        SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, ONE_SLOT_PER_BLOCK
    )
    if expert < 0:
        return
    dtype = X.dtype.element_ty
    row_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    jb = tl.arange(0, BLOCK_K // 2)  # the tile's bytes along K
    x_ptrs = X + tokens[:, None] * stride_xt + 2 * jb[None, :]  # even columns
    gate_codes = expert * stride_ce + cols[None, :].to(tl.int64) * stride_cn
    up_codes = gate_codes + inter * stride_cn
    gate_scales = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    up_scales = gate_scales + inter * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb0 in range(0, hidden // 2, BLOCK_K // 2):
        kb = kb0 + jb
        kb_ok = kb < hidden // 2
        x_ok = row_ok[:, None] & kb_ok[None, :]
        w_ok = kb_ok[:, None] & col_ok[None, :]
        gate = _dot_mxfp4(gate, x_ptrs + 2 * kb0, x_ok, Codes, Scales, gate_codes, gate_scales,
                          kb[:, None], w_ok, dtype, PRECISION)  # fmt: skip
        up = _dot_mxfp4(up, x_ptrs + 2 * kb0, x_ok, Codes, Scales, up_codes, up_scales,
                        kb[:, None], w_ok, dtype, PRECISION)  # fmt: skip
    bias = Bias + expert * stride_be + cols
    gate += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    up += tl.load(bias + inter, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # Rounded to the activations' dtype as the reference's biased linear rounds its output.
    gate = tl.minimum(gate.to(dtype).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
    act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    out_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])  # as _gate_up_kernel
def _down_kernel(
    Act,  # [S, I]
    Codes,  # [E, H, I/2] uint8
    Scales,  # [E, H, I/32] uint8
    Bias,  # [E, H]
    Out,  # [S, H] float32
    SlotWeights,  # [S] float32
    SortedSlots,
    BlockExperts,
    stride_as,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    stride_be,
    stride_os,
    num_slots,
    hidden,
    inter,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_SLOT_PER_BLOCK: tl.constexpr = False,
):
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    expert, slots = block_rows(
        SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, ONE_SLOT_PER_BLOCK
    )
    if expert < 0:
        return
    dtype = Act.dtype.element_ty
    row_ok = slots < num_slots
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    jb = tl.arange(0, BLOCK_K // 2)
    a_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + 2 * jb[None, :]
    codes = expert * stride_ce + cols[None, :].to(tl.int64) * stride_cn
    scales = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb0 in range(0, inter // 2, BLOCK_K // 2):
        kb = kb0 + jb
        kb_ok = kb < inter // 2
        acc = _dot_mxfp4(acc, a_ptrs + 2 * kb0, row_ok[:, None] & kb_ok[None, :], Codes, Scales,
                         codes, scales, kb[:, None], kb_ok[:, None] & col_ok[None, :], dtype,
                         PRECISION)  # fmt: skip
    acc += tl.load(Bias + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(dtype).to(tl.float32)  # the reference's linear output, rounded
    weight = tl.load(SlotWeights + slots, mask=row_ok, other=0.0)
    out_ptrs = Out + slots[:, None].to(tl.int64) * stride_os + cols[None, :]
    tl.store(out_ptrs, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


def block_sizes(num_slots: int, num_experts: int) -> Blocks:
    """Row blocks as fused_moe's (small when each expert gets few rows, large when many); 128
    weight columns (64 code bytes a row) a step. Not yet swept on a GPU."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 8:
        return Blocks(16, 64, 128)
    if per_expert <= 64:
        return Blocks(32, 64, 128)
    return Blocks(64, 128, 128, warps=8)


ONE_TOKEN = Blocks(16, 32, 128, warps=4, stages=4)  # one slot a row block, as fused_moe's


def fused_moe_mxfp4(
    x: torch.Tensor,  # [T, H]
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: block_sizes' choice (a benchmark may sweep others)
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H], each
    expert gpt-oss's biased, clamped SwiGLU over MXFP4 weights. No host sync."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    check_layout(experts, x.shape[1])
    if num_tokens == 1 and blocks is None:
        ids = topk_ids.reshape(-1).to(torch.int32)
        return _grouped_gemms(x, experts, topk_weights, top_k, (None, ids), ONE_TOKEN)
    num_experts = experts.w13_blocks.shape[0]
    b = blocks or block_sizes(topk_ids.numel(), num_experts)
    rows = align(topk_ids, num_experts, b.m)
    return _grouped_gemms(x, experts, topk_weights, top_k, rows, b)


def check_layout(experts: Mxfp4Experts, hidden: int) -> None:
    """ValueError unless the tensors have the shapes and inner strides the kernels assume."""
    num_experts, rows, half_hidden = experts.w13_blocks.shape
    inter = rows // 2
    want = {
        "w13_blocks": (experts.w13_blocks, (num_experts, 2 * inter, hidden // 2)),
        "w13_scales": (experts.w13_scales, (num_experts, 2 * inter, hidden // BLOCK)),
        "b13": (experts.b13, (num_experts, 2 * inter)),
        "w2_blocks": (experts.w2_blocks, (num_experts, hidden, inter // 2)),
        "w2_scales": (experts.w2_scales, (num_experts, hidden, inter // BLOCK)),
        "b2": (experts.b2, (num_experts, hidden)),
    }
    for name, (tensor, shape) in want.items():
        if tuple(tensor.shape) != shape or tensor.stride(-1) != 1:
            raise ValueError(
                f"fused_moe_mxfp4: {name} is {tuple(tensor.shape)} (inner stride "
                f"{tensor.stride(-1)}); the kernels need {shape}, rows contiguous"
            )
    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(f"fused_moe_mxfp4: widths {hidden}, {inter} are not whole {BLOCK}s")


def _grouped_gemms(
    x: torch.Tensor,
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,
    top_k: int,
    rows: tuple[torch.Tensor | None, torch.Tensor],  # align's (sorted slots, block experts)
    b: Blocks,
) -> torch.Tensor:
    """The two GEMM launches and the combine (fused_moe._grouped_gemms' scheme): rows are
    align's output, or (None, the single token's expert ids) for one slot a block."""
    sorted_slots, block_experts = rows
    one_slot = sorted_slots is None
    slots_arg = block_experts if one_slot else sorted_slots  # unread with ONE_SLOT_PER_BLOCK
    x = x.contiguous()
    num_tokens, hidden = x.shape
    inter = experts.w13_blocks.shape[1] // 2
    num_slots, num_blocks = num_tokens * top_k, block_experts.numel()
    # float32 models (the tests' comparisons) need exact float32 products, not TF32's.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    e = experts
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, b.n))](
        x, e.w13_blocks, e.w13_scales, e.b13, act, slots_arg, block_experts,
        x.stride(0), e.w13_blocks.stride(0), e.w13_blocks.stride(1), e.w13_scales.stride(0),
        e.w13_scales.stride(1), e.b13.stride(0), act.stride(0),
        num_slots, hidden, inter, e.limit, e.alpha,
        TOP_K=top_k, PRECISION=precision, BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    out = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, b.n))](
        act, e.w2_blocks, e.w2_scales, e.b2, out, weights, slots_arg, block_experts,
        act.stride(0), e.w2_blocks.stride(0), e.w2_blocks.stride(1), e.w2_scales.stride(0),
        e.w2_scales.stride(1), e.b2.stride(0), out.stride(0),
        num_slots, hidden, inter,
        PRECISION=precision, BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    combined = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(hidden))
    combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        out, combined, hidden, K=top_k, BLOCK=block, num_warps=4
    )
    return combined
