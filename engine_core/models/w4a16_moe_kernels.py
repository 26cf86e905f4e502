"""W4A16 experts on CUDA: fused_moe's grouping with GEMMs that dequantize 4-bit weights in
registers against the activations in their own dtype (W4A16 quantizes no activations).

The experts (models/moe.py ``SparseMoE.make_w4a16``, w4a16.py ``W4A16Experts``) are held as they
load, w4a16.py's layout stacked per expert: ``w13_qweight`` int32 [E, 2I, H / 8] (gate rows, then
up rows; column 8j + i of a row in nibble i of its word j), ``w13_scales`` float32 [E, G, 2I],
``w13_zeros`` uint8 [E, G, 2I] or none (every zero point 8), and ``w2_*`` alike for [H, I]. So
this layer computes what the CPU reference (``SparseMoE.w4a16_expert``: each expert's weights
dequantized to (q - zero) * scale, rounded to the activations' dtype, then its SwiGLU) computes:

1. ``align`` (fused_moe.py) groups the (token, k) slots by expert into row blocks; skipped for a
   single token, whose K experts are distinct (one slot a block);
2. ``_gate_up_kernel``: a block of sorted rows times the expert's gate and up columns. A K step
   of BLOCK_K columns is one [BLOCK_K / 8, BLOCK_N] tile of words per projection (each weight
   row's words are contiguous); nibble i of that tile is the weight at columns 8j + i, a
   [BLOCK_K / 8, BLOCK_N] slice of K that goes to the tensor cores against the activations at
   the same columns (a strided load from the L1). A nibble becomes a float by the mantissa trick
   of w4a16_kernels.py (OR'd into 2**23, subtract 2**23 + zero): no integer conversion. Groups
   are multiples of 8 columns, so a word row's eight columns share one scale and zero: they are
   loaded once per K step as [BLOCK_K / 8, BLOCK_N] tiles, for all eight slices. Gate and up are
   rounded to the activations' dtype, as the reference's linear rounds them, then SiLU(gate) *
   up is written per slot;
3. ``_down_kernel``: the same product against the expert's down rows, rounded, times the slot's
   routing weight, written per slot in the activations' dtype;
4. ``combine_slots`` (fused_moe.py): each token's K slots summed in float32, in slot order.

Act-order experts (``w13_perm``, ``w2_perm``: each expert's columns sorted by group at load)
read their inputs through a gathered load at the expert's order (``HAS_PERM``).

No step reads anything on the host, so the layer is captured in CUDA graphs like the bf16 one.
Why not the dense W4A16 kernel's tiled layout (w4a16.py ``tile_qweight``): that layout serves a
matrix-vector product at one row; here every expert's rows are a small GEMM as in the FP8
experts, and the loaded layout needs no second repack at load.

Importing this module imports triton: only CUDA code paths and GPU tests may do so (or set
``TRITON_INTERPRET=1`` first to run on CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import Blocks, align, block_rows, combine_slots
from engine_core.models.w4a16 import PACK, SYMMETRIC_ZERO, W4A16Experts

MAGIC = 8388608.0  # 2**23: a float32 whose last mantissa bit is worth 1
_MAGIC = tl.constexpr(MAGIC)
_MAGIC_BITS = tl.constexpr(0x4B000000)  # MAGIC's bits
_SYMMETRIC_OFFSET = tl.constexpr(MAGIC + SYMMETRIC_ZERO)


@triton.jit
def _group_tile(Scales, Zeros, groups, cols, mask, stride_g, HAS_ZEROS: tl.constexpr):
    """(scale, 2**23 + zero) [WORDS, BLOCK_N] of the groups ``groups`` [WORDS] (one per word
    row of the K step) for weight columns ``cols`` [BLOCK_N]; the pointers at the expert."""
    offsets = groups[:, None] * stride_g + cols[None, :]
    scale = tl.load(Scales + offsets, mask=mask, other=0.0)
    if HAS_ZEROS:
        offset = tl.load(Zeros + offsets, mask=mask, other=0).to(tl.float32) + _MAGIC
    else:
        offset = _SYMMETRIC_OFFSET
    return scale, offset


@triton.jit
def _input_columns(perm, positions, ok, HAS_PERM: tl.constexpr):
    """The input columns of weight columns ``positions`` (sorted by group under act-order):
    ``perm[positions]``, a gather of the inputs at the expert's order, or the positions."""
    if HAS_PERM:
        return tl.load(perm + positions, mask=ok, other=0)
    return positions


@triton.jit
def _dequantized(words, i: tl.constexpr, scale, offset, dtype: tl.constexpr):
    """Nibble i of each word as (q - zero) * scale in ``dtype``: q OR'd into the mantissa of
    2**23 and read as a float, instead of converted."""
    bits = ((words >> (4 * i)) & 0xF) | _MAGIC_BITS
    return ((bits.to(tl.float32, bitcast=True) - offset) * scale).to(dtype)


# The slot count changes from step to step: not specialized (fused_moe._gate_up_kernel says why).
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    X,  # [T, H]
    QW13,  # [E, 2I, H / 8] int32
    Scales13,  # [E, G, 2I] float32
    Zeros13,  # [E, G, 2I] uint8 (unread without HAS_ZEROS)
    Act,  # [S, I] the activations' dtype (S = T*K slots)
    SortedSlots,  # [R] slot of each sorted row; S for padding
    BlockExperts,  # [R // BLOCK_M] expert of each block of rows; -1 past the last one
    Perm13,  # [E, H] int32: act-order's column order of each expert (unread without HAS_PERM)
    stride_xt,
    stride_qe,
    stride_qn,
    stride_se,
    stride_as,
    num_slots,
    hidden,
    inter,
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,  # input columns a scale (a multiple of 8)
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 128: BLOCK_K / 8 word rows, a tensor-core K of 16+
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
    tokens = (slots // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    js = tl.arange(0, BLOCK_K // 8)  # word rows of a K step
    x_rows = X + tokens[:, None] * stride_xt
    perm = Perm13 + expert.to(tl.int64) * hidden
    # Offsets within one expert fit in int32; the expert's start is added as int64, once.
    gate_ptrs = QW13 + expert * stride_qe + (cols[None, :] * stride_qn + js[:, None])
    up_ptrs = gate_ptrs + inter * stride_qn
    scales, zeros = Scales13 + expert * stride_se, Zeros13 + expert * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        j_ok = js + k0 // 8 < hidden // 8
        w_mask = j_ok[:, None] & col_ok[None, :]
        gate_words = tl.load(gate_ptrs + k0 // 8, mask=w_mask, other=0)
        up_words = tl.load(up_ptrs + k0 // 8, mask=w_mask, other=0)
        groups = (k0 + 8 * js) // GROUP
        gate_scale, gate_offset = _group_tile(
            scales, zeros, groups, cols, w_mask, 2 * inter, HAS_ZEROS
        )
        up_scale, up_offset = _group_tile(
            scales, zeros, groups, cols + inter, w_mask, 2 * inter, HAS_ZEROS
        )
        for i in tl.static_range(8):
            ks = _input_columns(perm, k0 + 8 * js + i, j_ok, HAS_PERM)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
            gate_w = _dequantized(gate_words, i, gate_scale, gate_offset, dtype)
            up_w = _dequantized(up_words, i, up_scale, up_offset, dtype)
            gate = tl.dot(x, gate_w, gate, input_precision=PRECISION)
            up = tl.dot(x, up_w, up, input_precision=PRECISION)
    # Each linear's output rounded to the activations' dtype, as the reference's linear does.
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])  # as _gate_up_kernel
def _down_kernel(
    Act,  # [S, I]
    QW2,  # [E, H, I / 8] int32
    Scales2,  # [E, G, H] float32
    Zeros2,  # [E, G, H] uint8 (unread without HAS_ZEROS)
    Out,  # [S, H] the activations' dtype
    SlotWeights,  # [S] float32
    SortedSlots,
    BlockExperts,
    Perm2,  # [E, I] int32: as Perm13, for the down projection
    stride_as,
    stride_qe,
    stride_qn,
    stride_se,
    stride_os,
    num_slots,
    hidden,
    inter,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
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
    dtype = Out.dtype.element_ty
    row_ok = slots < num_slots
    slots64 = slots.to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    js = tl.arange(0, BLOCK_K // 8)
    a_rows = Act + slots64[:, None] * stride_as
    perm = Perm2 + expert.to(tl.int64) * inter
    w_ptrs = QW2 + expert * stride_qe + (cols[None, :] * stride_qn + js[:, None])  # as gate/up's
    scales, zeros = Scales2 + expert * stride_se, Zeros2 + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        j_ok = js + k0 // 8 < inter // 8
        w_mask = j_ok[:, None] & col_ok[None, :]
        words = tl.load(w_ptrs + k0 // 8, mask=w_mask, other=0)
        groups = (k0 + 8 * js) // GROUP
        scale, offset = _group_tile(scales, zeros, groups, cols, w_mask, hidden, HAS_ZEROS)
        for i in tl.static_range(8):
            ks = _input_columns(perm, k0 + 8 * js + i, j_ok, HAS_PERM)
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
            w = _dequantized(words, i, scale, offset, dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    acc = acc.to(dtype).to(tl.float32)  # the reference's linear output, rounded
    weight = tl.load(SlotWeights + slots, mask=row_ok, other=0.0)
    out_ptrs = Out + slots64[:, None] * stride_os + cols[None, :]
    tl.store(out_ptrs, (acc * weight[:, None]).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def block_sizes(num_slots: int, num_experts: int) -> Blocks:
    """Row blocks as fused_moe's (small when each expert gets few rows, large when many), K
    steps of 128 columns (16 word rows: the tensor cores' K of 16 a slice). Not yet timed on
    a GPU: ``python -m benchmarks w4a16-moe --sweep`` times the CANDIDATES."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 8:
        return Blocks(16, 64, 128)
    if per_expert <= 64:
        return Blocks(32, 64, 128)
    return Blocks(64, 128, 128, warps=8)


# The one-token path's tiles (one slot a row block: fused_moe's ONE_SLOT_PER_BLOCK).
ONE_TOKEN_GATE_UP = Blocks(16, 32, 128)
ONE_TOKEN_DOWN = Blocks(16, 64, 128)
# Tiles ``python -m benchmarks w4a16-moe --sweep`` times beside block_sizes' choice.
CANDIDATES = (
    Blocks(16, 32, 128),
    Blocks(16, 64, 128),
    Blocks(16, 128, 128),
    Blocks(16, 64, 256),
    Blocks(32, 64, 128),
    Blocks(32, 128, 128, warps=8),
    Blocks(64, 64, 128),
    Blocks(64, 128, 128, warps=8),
    Blocks(128, 128, 128, warps=8),
)
MIN_BLOCK_K = 128  # 16 word rows: a slice is the tensor cores' shortest K step of 16


def fused_moe_w4a16(
    x: torch.Tensor,  # [T, H] bf16, fp16 or float32
    experts: W4A16Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: block_sizes' choice (a benchmark may sweep others)
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H], each
    expert a SwiGLU over its 4-bit weights (module docstring). No host sync."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    check_layout(experts, x.shape[1], blocks)
    x = x.contiguous()
    if num_tokens == 1 and blocks is None:
        ids = topk_ids.reshape(-1).to(torch.int32)
        tiles = (ONE_TOKEN_GATE_UP, ONE_TOKEN_DOWN)
        return _grouped_gemms(x, experts, topk_weights, top_k, (None, ids), tiles)
    num_experts = experts.w13_qweight.shape[0]
    b = blocks or block_sizes(topk_ids.numel(), num_experts)
    rows = align(topk_ids, num_experts, b.m)
    return _grouped_gemms(x, experts, topk_weights, top_k, rows, (b, b))


def check_layout(experts: W4A16Experts, hidden: int, blocks: Blocks | None) -> None:
    """ValueError unless the tensors have the dtypes and shapes the kernels assume, and the
    groups divide the inputs in whole word rows (as the loader already requires)."""
    e = experts
    num_experts, rows, words = e.w13_qweight.shape
    inter = rows // 2
    group13, group2 = e.groups
    whole = hidden % group13 == 0 and inter % group2 == 0
    if words * PACK != hidden or group13 % PACK or group2 % PACK or not whole:
        raise ValueError(
            f"fused_moe_w4a16: groups of ({group13}, {group2}) columns over inputs ({hidden}, "
            f"{inter}) need to divide them, in whole 8-column words"
        )
    if blocks is not None and blocks.k % MIN_BLOCK_K:
        raise ValueError(f"fused_moe_w4a16: K steps of {blocks.k}: a multiple of 128 only")
    zeros = e.w13_zeros is not None
    want = {
        "w13_qweight": (e.w13_qweight, (num_experts, 2 * inter, hidden // PACK), torch.int32),
        "w13_scales": (e.w13_scales, (num_experts, hidden // group13, 2 * inter), torch.float32),
        "w2_qweight": (e.w2_qweight, (num_experts, hidden, inter // PACK), torch.int32),
        "w2_scales": (e.w2_scales, (num_experts, inter // group2, hidden), torch.float32),
    }
    if zeros:
        want["w13_zeros"] = (e.w13_zeros, want["w13_scales"][1], torch.uint8)
        want["w2_zeros"] = (e.w2_zeros, want["w2_scales"][1], torch.uint8)
    if zeros != (e.w2_zeros is not None):
        raise ValueError("fused_moe_w4a16: zero points for one projection and not the other")
    if (e.w13_perm is None) != (e.w2_perm is None):
        raise ValueError("fused_moe_w4a16: act-order's column orders for one projection only")
    if e.w13_perm is not None:
        want["w13_perm"] = (e.w13_perm, (num_experts, hidden), torch.int32)
        want["w2_perm"] = (e.w2_perm, (num_experts, inter), torch.int32)
    for name, (tensor, shape, dtype) in want.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(
                f"fused_moe_w4a16: {name} is {tuple(tensor.shape)} {tensor.dtype}; the kernels "
                f"need {shape} {dtype}, contiguous"
            )


def _grouped_gemms(
    x: torch.Tensor,  # [T, H], contiguous
    experts: W4A16Experts,
    topk_weights: torch.Tensor,
    top_k: int,
    rows: tuple[torch.Tensor | None, torch.Tensor],  # align's (sorted slots, block experts)
    tiles: tuple[Blocks, Blocks],  # gate/up's, down's
) -> torch.Tensor:
    """Steps 2 to 4 of the module docstring over the row blocks ``rows`` describes: align's
    output, or (None, the single token's expert ids) for one slot a block."""
    sorted_slots, block_experts = rows
    one_slot = sorted_slots is None
    slots_arg = block_experts if one_slot else sorted_slots  # unread with ONE_SLOT_PER_BLOCK
    e = experts
    num_tokens, hidden = x.shape
    inter = e.w13_qweight.shape[1] // 2
    num_slots, num_blocks = num_tokens * top_k, block_experts.numel()
    has_zeros = e.w13_zeros is not None
    zeros13 = e.w13_zeros if has_zeros else e.w13_scales  # unread without zero points
    zeros2 = e.w2_zeros if has_zeros else e.w2_scales
    # float32 models (the tests' HF comparisons) need exact float32 products, not TF32's.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    b = tiles[0]
    has_perm = e.w13_perm is not None
    perm13 = e.w13_perm if has_perm else block_experts  # unread without act-order
    perm2 = e.w2_perm if has_perm else block_experts
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, b.n))](
        x, e.w13_qweight, e.w13_scales, zeros13, act, slots_arg, block_experts, perm13,
        x.stride(0), e.w13_qweight.stride(0), e.w13_qweight.stride(1), e.w13_scales.stride(0),
        act.stride(0), num_slots, hidden, inter,
        TOP_K=top_k, GROUP=e.groups[0], HAS_ZEROS=has_zeros, HAS_PERM=has_perm,
        PRECISION=precision,
        BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    b = tiles[1]
    _down_kernel[(num_blocks, triton.cdiv(hidden, b.n))](
        act, e.w2_qweight, e.w2_scales, zeros2, out, weights, slots_arg, block_experts, perm2,
        act.stride(0), e.w2_qweight.stride(0), e.w2_qweight.stride(1), e.w2_scales.stride(0),
        out.stride(0), num_slots, hidden, inter,
        GROUP=e.groups[1], HAS_ZEROS=has_zeros, HAS_PERM=has_perm, PRECISION=precision,
        BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    return combine_slots(out, top_k, x.dtype)
