"""gpt-oss's MXFP4 experts on CUDA: fused_moe's grouping with GEMMs that read MXFP4 directly.

This is the tiled path, for batches between decode and prefill (models/mxfp4_moe.py chooses:
mxfp4_gemv.py at decode, mxfp4_prefill.py at prefill); its conversion helpers and epilogues
serve the other two.

Hopper has no FP4 tensor cores, so the win is in the bytes: a weight is read as 4.25 bits (half
a byte of e2m1 code, a 32nd of an e8m0 scale byte) and widened to the activations' dtype in
registers, then multiplied on the bf16 (or fp16 / float32) tensor cores. The layer is a
handful of launches whatever the routing, as fused_moe's (models/fused_moe.py, which this module
reuses for ``align``, ``block_rows`` and ``combine_slots``):

1. ``align``: the (token, k) slots sorted by expert, each expert's run padded to BLOCK_M rows
   (skipped for a single token: its K experts are distinct, one slot a row block).
2. ``_gate_up_kernel``: for a block of sorted rows and a block of intermediate columns, the
   tokens' rows times the expert's gate and up rows (``w13`` as models/gpt_oss.py loads it:
   gate rows, then up rows, so gate row n and up row n sit I rows apart, never interleaved),
   plus their biases, then gpt-oss's clamped SwiGLU, written per slot.
3. ``_down_kernel``: each slot's activation times the expert's down rows, plus the bias, rounded
   to the activations' dtype as the reference rounds its linear, times the routing weight,
   written per slot in float32.
4. ``combine_slots``: each token's K slots summed in float32, rounded once.

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

from typing import Any

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import (
    Blocks,
    align,
    block_rows,
    combine_slots,
)
from engine_core.models.mxfp4 import BLOCK, Mxfp4Experts

BLOCK_SCALE = tl.constexpr(BLOCK)  # weights per scale, as the kernels see it
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
def load_codes(Codes, Scales, code_offsets, scale_offsets, k_bytes, k_groups, col_ok):
    """One weight tile's code bytes [BYTES, BLOCK_N] and scales [BYTES / 16, BLOCK_N] as
    stored (uint8), zeros past the row's end (k_bytes, k_groups: bytes and scales left in the
    row from the tile's start). Codes and Scales point at the tile's first column."""
    bytes_ok = (tl.arange(0, code_offsets.shape[0]) < k_bytes)[:, None] & col_ok[None, :]
    groups_ok = (tl.arange(0, scale_offsets.shape[0]) < k_groups)[:, None] & col_ok[None, :]
    packed = tl.load(Codes + code_offsets, mask=bytes_ok, other=0)
    exponents = tl.load(Scales + scale_offsets, mask=groups_ok, other=0)
    return packed, exponents


@triton.jit
def widen(packed, exponents, dtype: tl.constexpr):
    """load_codes' tile -> the weights, transposed for tl.dot, in dtype: (even columns from
    the low nibbles, odd columns from the high ones), each [BYTES, BLOCK_N]."""
    groups: tl.constexpr = exponents.shape[0]
    block_n: tl.constexpr = exponents.shape[1]
    exponents = tl.broadcast_to(exponents[:, None, :], (groups, _SCALE_BYTES, block_n))
    exponents = tl.reshape(exponents, (groups * _SCALE_BYTES, block_n)).to(tl.int32)
    packed = packed.to(tl.int32)
    return _e2m1_values(packed & 0xF, exponents, dtype), _e2m1_values(packed >> 4, exponents, dtype)


@triton.jit
def _split_columns(a):
    """A [BLOCK_M, 2 * BYTES] tile -> (its even columns, its odd columns)."""
    rows: tl.constexpr = a.shape[0]
    cols: tl.constexpr = a.shape[1]
    return tl.split(tl.reshape(a, (rows, cols // 2, 2)))


@triton.jit
def _dot_tile(acc, a_even, a_odd, packed, exponents, PRECISION: tl.constexpr):
    """acc + A's tile times a weight tile (A's even columns times the low nibbles' weights, its
    odd columns times the high ones')."""
    even, odd = widen(packed, exponents, a_even.dtype)
    acc = tl.dot(a_even, even, acc, input_precision=PRECISION)
    return tl.dot(a_odd, odd, acc, input_precision=PRECISION)


# The slot count changes from step to step: not specialized (fused_moe._gate_up_kernel says why).
# Each K step loads the next step's codes before it widens and multiplies this one's, so a load
# is in flight while the tile converts (the loads feed integer ops, not tl.dot, so Triton's
# pipelining does not stage them in shared memory).
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
    BLOCK_K: tl.constexpr,  # weight columns a step (a multiple of 32): BLOCK_K / 2 bytes
    ONE_SLOT_PER_BLOCK: tl.constexpr = False,
):
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    expert, slots = block_rows(
        SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, ONE_SLOT_PER_BLOCK
    )
    if expert < 0:
        return
    row_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    jk = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_xt + jk[None, :]
    # Offsets within one expert's rows fit in int32; the expert's start is added as int64.
    code_offsets = cols[None, :] * stride_cn + tl.arange(0, BLOCK_K // 2)[:, None]
    scale_offsets = cols[None, :] * stride_sn + tl.arange(0, BLOCK_K // BLOCK_SCALE)[:, None]
    gate_codes, gate_scales = Codes + expert * stride_ce, Scales + expert * stride_se
    up_codes, up_scales = gate_codes + inter * stride_cn, gate_scales + inter * stride_sn
    row_bytes, row_groups = hidden // 2, hidden // BLOCK_SCALE
    offs, s_offs = code_offsets, scale_offsets
    # (codes, scales) of the tile to multiply next, gate's and up's.
    gate_q, gate_s = load_codes(
        gate_codes, gate_scales, offs, s_offs, row_bytes, row_groups, col_ok
    )
    up_q, up_s = load_codes(up_codes, up_scales, offs, s_offs, row_bytes, row_groups, col_ok)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & (jk + k0 < hidden)[None, :], other=0.0)
        x_even, x_odd = _split_columns(x)
        # The next step's tiles (all masked off after the last step).
        b1, g1 = (k0 + BLOCK_K) // 2, (k0 + BLOCK_K) // BLOCK_SCALE
        bytes_left, groups_left = row_bytes - b1, row_groups - g1
        gate_q1, gate_s1 = load_codes(gate_codes + b1, gate_scales + g1, offs, s_offs,
                                      bytes_left, groups_left, col_ok)  # fmt: skip
        up_q1, up_s1 = load_codes(up_codes + b1, up_scales + g1, offs, s_offs, bytes_left,
                                  groups_left, col_ok)  # fmt: skip
        gate = _dot_tile(gate, x_even, x_odd, gate_q, gate_s, PRECISION)
        up = _dot_tile(up, x_even, x_odd, up_q, up_s, PRECISION)
        gate_q, gate_s, up_q, up_s = gate_q1, gate_s1, up_q1, up_s1
    bias = Bias + expert * stride_be + cols
    gate_bias = tl.load(bias, mask=col_ok, other=0.0)[None, :]
    up_bias = tl.load(bias + inter, mask=col_ok, other=0.0)[None, :]
    dtype = X.dtype.element_ty
    act = clamped_swiglu(gate, up, gate_bias, up_bias, limit, alpha, dtype)
    out_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def clamped_swiglu(gate, up, gate_bias, up_bias, limit, alpha, dtype: tl.constexpr):
    """gpt-oss's activation of float32 gate and up sums plus their biases, in float32. Each
    biased sum is rounded to the activations' dtype first, as the reference's biased linear
    rounds its output; the caller rounds the result once."""
    gate = (gate + gate_bias.to(tl.float32)).to(dtype).to(tl.float32)
    up = (up + up_bias.to(tl.float32)).to(dtype).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))


@triton.jit
def weighted_down(acc, bias, weight, dtype: tl.constexpr):
    """A slot's float32 down-projection sum plus its bias, rounded to the activations' dtype as
    the reference's linear rounds it, times the slot's routing weight, in float32."""
    return (acc + bias.to(tl.float32)).to(dtype).to(tl.float32) * weight


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
    row_ok = slots < num_slots
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    jk = tl.arange(0, BLOCK_K)
    a_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + jk[None, :]
    code_offsets = cols[None, :] * stride_cn + tl.arange(0, BLOCK_K // 2)[:, None]
    scale_offsets = cols[None, :] * stride_sn + tl.arange(0, BLOCK_K // BLOCK_SCALE)[:, None]
    codes, scales = Codes + expert * stride_ce, Scales + expert * stride_se
    row_bytes, row_groups = inter // 2, inter // BLOCK_SCALE
    q, s = load_codes(codes, scales, code_offsets, scale_offsets, row_bytes, row_groups, col_ok)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (jk + k0 < inter)[None, :], other=0.0)
        a_even, a_odd = _split_columns(a)
        b1, g1 = (k0 + BLOCK_K) // 2, (k0 + BLOCK_K) // BLOCK_SCALE
        q1, s1 = load_codes(codes + b1, scales + g1, code_offsets, scale_offsets,
                            row_bytes - b1, row_groups - g1, col_ok)  # fmt: skip
        acc = _dot_tile(acc, a_even, a_odd, q, s, PRECISION)
        q, s = q1, s1
    bias = tl.load(Bias + expert * stride_be + cols, mask=col_ok, other=0.0)[None, :]
    weight = tl.load(SlotWeights + slots, mask=row_ok, other=0.0)[:, None]
    out = weighted_down(acc, bias, weight, Act.dtype.element_ty)
    out_ptrs = Out + slots[:, None].to(tl.int64) * stride_os + cols[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def block_sizes(num_slots: int, num_experts: int) -> Blocks:
    """Row blocks as fused_moe's (small when each expert gets few rows, large when many), 64
    weight columns (32 code bytes a row) a K step. Compiled for sm_90 without a GPU, these are
    the largest tiles of each row block whose registers did not spill (the widened weights, and
    the next step's codes in flight, take most of them); their speed is unmeasured
    (``python -m benchmarks mxfp4 --sweep`` times the candidates)."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 8:
        return Blocks(16, 64, 64)
    if per_expert <= 64:
        return Blocks(32, 64, 64, warps=8)
    return Blocks(64, 64, 64, warps=8)


ONE_TOKEN = Blocks(16, 32, 64)  # one slot a row block (fused_moe's ONE_SLOT_PER_BLOCK)
# Tiles ``python -m benchmarks mxfp4 --sweep`` times beside block_sizes' choice.
CANDIDATES = (
    Blocks(16, 32, 64),
    Blocks(16, 64, 64),
    Blocks(16, 64, 64, warps=8),
    Blocks(32, 64, 64, warps=8),
    Blocks(64, 64, 64, warps=8),
    Blocks(64, 64, 32, warps=8),
    Blocks(128, 64, 32, warps=8),
)


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
    constants = {"BLOCK_M": b.m, "BLOCK_N": b.n, "BLOCK_K": b.k, "ONE_SLOT_PER_BLOCK": one_slot}
    return expert_gemms(
        (_gate_up_kernel, _down_kernel), x, experts, topk_weights, top_k,
        (slots_arg, block_experts), b.n, constants | {"num_warps": b.warps, "num_stages": b.stages},
    )  # fmt: skip


def expert_gemms(
    kernels: tuple[Any, Any],  # gate/up and down kernels with _gate_up_kernel's and _down_kernel's
    x: torch.Tensor,
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,
    top_k: int,
    rows: tuple[torch.Tensor, torch.Tensor],  # (what SortedSlots reads, block experts)
    columns: int,  # output columns a program
    constants: dict[str, Any],  # the tiles and launch settings both kernels take
) -> torch.Tensor:
    """Gate/up, then down over ``rows``' blocks, then the combine: the launches of this module's
    kernels and of mxfp4_swapped's, which take the same arguments. The kernels' positional
    arguments, TOP_K (gate/up) and PRECISION are set here."""
    gate_up_kernel, down_kernel = kernels
    slots_arg, block_experts = rows
    x = x.contiguous()
    num_tokens, hidden = x.shape
    inter = experts.w13_blocks.shape[1] // 2
    num_slots, num_blocks = num_tokens * top_k, block_experts.numel()
    # float32 models (the tests' comparisons) need exact float32 products, not TF32's.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    e = experts
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    gate_up_kernel[(num_blocks, triton.cdiv(inter, columns))](
        x, e.w13_blocks, e.w13_scales, e.b13, act, slots_arg, block_experts,
        x.stride(0), e.w13_blocks.stride(0), e.w13_blocks.stride(1), e.w13_scales.stride(0),
        e.w13_scales.stride(1), e.b13.stride(0), act.stride(0),
        num_slots, hidden, inter, e.limit, e.alpha,
        TOP_K=top_k, PRECISION=precision, **constants,
    )  # fmt: skip
    out = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down_kernel[(num_blocks, triton.cdiv(hidden, columns))](
        act, e.w2_blocks, e.w2_scales, e.b2, out, weights, slots_arg, block_experts,
        act.stride(0), e.w2_blocks.stride(0), e.w2_blocks.stride(1), e.w2_scales.stride(0),
        e.w2_scales.stride(1), e.b2.stride(0), out.stride(0),
        num_slots, hidden, inter, PRECISION=precision, **constants,
    )  # fmt: skip
    return combine_slots(out, top_k, x.dtype)
