"""gpt-oss's MXFP4 experts at decode, on CUDA cores: a matrix-vector product per expert.

At decode an expert gets a few (token, k) slots, and its weights meet each activation once or a
few times: no matrix unit is needed, and the layer is a read of the touched experts' bytes (one
token of gpt-oss-20b: 4 experts x 25 M weights in 53 MB, 11 us at 4.8 TB/s). The tiled kernels
of mxfp4_kernels.py widen every code into a tensor-core operand tile, which costs more than the
read; here a code becomes a float32 in a few integer operations and meets the activations in
float32 multiply-adds, the scheme of w4a16_kernels' ``_w4a16_gemv_kernel``:

- *Programs*: (row block, column tile, K split). A row block is ROWS slots of one expert:
  with ROWS = 1 slot b alone (no grouping step: its expert is the routing's id), otherwise
  fused_moe's ``align`` padded to ROWS. A program reads its expert's codes for BLOCK_N output
  columns over its share of K once and multiplies them with each of its rows.
- *Loads*: a weight row's codes are consecutive bytes along K, read as int32 words (8 codes a
  word), a [BLOCK_N, WORDS] tile a step, contiguous along K: 16-byte loads. The scales are
  loaded as a tile of the same shape (each scale byte four times, L1 hits), so they share the
  words' register layout.
- *Conversion*: nibble i of word w is column 8w + i. Its code becomes the unscaled e2m1 value
  by building float32 bits (``e2m1_unscaled``: magnitude codes 2..7 are the float with
  exponent field e + 126 and the mantissa bit m, ``(code << 22) + 0x3F000000``; code 1 is 0.5,
  code 0 is 0; the sign is bit 3 moved to bit 31), no table and no multiply.
- *Scales once per group*: the products of a word's 8 values with the activations are summed
  unscaled and the sum times 2^(scale - 127) (a float built from the scale byte's bits) is
  added to the accumulator: one multiply per 8 weights and row instead of one per weight. The
  values and the power of two are exact, so the result differs from the dequantized weights'
  product only in the order of its float32 sums.
- *Epilogue*: gate/up takes gate row n and up row n (I rows apart) in one program, adds the
  biases and applies gpt-oss's clamped SwiGLU (mxfp4_kernels.clamped_swiglu); down adds its
  bias, rounds, and multiplies by the slot's routing weight (``weighted_down``); the combine
  sums each token's K slots in float32 (fused_moe.combine_slots).
- *Splits*: where the programs would leave multiprocessors idle, K is split over SPLIT
  programs that write float32 partials; a second small kernel sums them in split order and
  applies the epilogue (no atomics: a CUDA-graph replay gives the same bits).

Every size depends on shapes only and nothing reads the host: the layer is captured in CUDA
graphs. tests/test_mxfp4_interpreted.py runs these kernels in Triton's interpreter on the CPU;
tests/test_mxfp4_gpu.py on a GPU; ``python -m benchmarks mxfp4 --sweep`` times the tiles.
Importing this module imports triton (set ``TRITON_INTERPRET=1`` first to run on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import align, block_rows, combine_slots
from engine_core.models.mxfp4 import BLOCK, Mxfp4Experts
from engine_core.models.mxfp4_kernels import clamped_swiglu, weighted_down

CODES_PER_WORD = 8
_CODES = tl.constexpr(CODES_PER_WORD)  # as the kernels see it
_WORDS_PER_GROUP = tl.constexpr(BLOCK // CODES_PER_WORD)  # words under one scale
_HALF_BITS = tl.constexpr(0x3F000000)  # 0.5's float32 bits: exponent field 126


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class GemvTiles:
    """The decode kernels' tiles: slots a program (1: one slot, no grouping step), output
    columns a program, int32 words (8 codes each) a K step, K splits, warps."""

    rows: int
    block_n: int
    words: int
    split_k: int
    warps: int = 4


# Tiles ``python -m benchmarks mxfp4 --sweep`` times beside the rule's (rows, columns, words a
# step, K splits, warps).
GEMV_CANDIDATES = (
    GemvTiles(1, 64, 16, 1),
    GemvTiles(1, 64, 16, 2),
    GemvTiles(1, 64, 16, 4),
    GemvTiles(1, 128, 16, 2),
    GemvTiles(1, 32, 8, 4),
    GemvTiles(2, 64, 16, 2),
    GemvTiles(4, 64, 16, 1),
    GemvTiles(4, 64, 16, 2),
    GemvTiles(4, 32, 8, 2),
    GemvTiles(8, 64, 16, 1),
    GemvTiles(8, 32, 16, 1),
    GemvTiles(8, 64, 8, 2, warps=8),
)


@triton.jit
def e2m1_unscaled(codes):
    """e2m1 codes (int32, 0..15) as their float32 values (0, +-0.5 .. +-6), by their bits."""
    magnitude = codes & 7
    normal = (magnitude << 22) + _HALF_BITS  # exponent field e + 126, mantissa bit m
    bits = tl.where(magnitude < 2, magnitude * _HALF_BITS, normal) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_values(scales):
    """e8m0 scale bytes (int32) as the float32 2^(byte - 127); byte 0 (2^-127, below float32's
    normal range) reads as zero, as the tiled kernels read such products."""
    return (scales << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rows_zeros(ROWS: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """Per-row accumulators: [BLOCK_N, WORDS] for one row (no axis of length 1 for the compiler
    to lay out), else [ROWS, BLOCK_N, WORDS]."""
    if ROWS == 1:
        zeros = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    else:
        zeros = tl.zeros((ROWS, BLOCK_N, WORDS), dtype=tl.float32)
    return zeros


@triton.jit
def _rows_times(x, values, ROWS: tl.constexpr):
    """Activations x ([WORDS], or [ROWS, WORDS]) times values [BLOCK_N, WORDS], shaped as
    ``_rows_zeros``."""
    return x[None, :] * values if ROWS == 1 else x[:, None, :] * values[None, :, :]


@triton.jit
def _rows_scaled(part, scale, ROWS: tl.constexpr):
    """Per-row partials times the group scales [BLOCK_N, WORDS]."""
    return part * scale if ROWS == 1 else part * scale[None, :, :]


@triton.jit
def _gemv(
    X,  # activations, rows at x_rows (element offsets), K columns each
    x_rows,  # [ROWS] int64 (a scalar for one row)
    rows_ok,
    Words,  # this expert's codes as int32 words, [N, K / 8]
    Scales,  # this expert's scales, [N, K / 32] uint8
    cols,  # [BLOCK_N] output columns (weight rows)
    col_ok,
    stride_wn,  # words a weight row
    stride_sn,  # scale bytes a weight row
    first,  # this split's first word
    last,  # one past its last word
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
):
    """The rows' products with the weight's columns ``cols`` over words [first, last) of K:
    float32, [BLOCK_N, WORDS] for one row, else [ROWS, BLOCK_N, WORDS] (summed over the last
    axis by the caller)."""
    jw = tl.arange(0, WORDS)
    w_ptrs = Words + cols[:, None].to(tl.int64) * stride_wn + (first + jw)[None, :]
    s_ptrs = Scales + cols[:, None].to(tl.int64) * stride_sn + ((first + jw) // _WORDS_PER_GROUP)
    if ROWS == 1:
        x_ptrs = X + x_rows + (first + jw) * _CODES  # [WORDS]
    else:
        x_ptrs = X + x_rows[:, None] + ((first + jw) * _CODES)[None, :]
    acc = _rows_zeros(ROWS, BLOCK_N, WORDS)
    for w0 in range(first, last, WORDS):
        w_ok = (w0 + jw) < last
        tile_ok = col_ok[:, None] & w_ok[None, :]
        words = tl.load(w_ptrs, mask=tile_ok, other=0)
        scale = scale_values(tl.load(s_ptrs, mask=tile_ok, other=0).to(tl.int32))
        x_ok = w_ok if ROWS == 1 else rows_ok[:, None] & w_ok[None, :]
        part = _rows_zeros(ROWS, BLOCK_N, WORDS)
        for i in tl.static_range(_CODES):
            values = e2m1_unscaled((words >> (4 * i)) & 0xF)
            x = tl.load(x_ptrs + i, mask=x_ok, other=0.0).to(tl.float32)
            part += _rows_times(x, values, ROWS)
        acc += _rows_scaled(part, scale, ROWS)
        w_ptrs += WORDS
        s_ptrs += WORDS // _WORDS_PER_GROUP
        x_ptrs += WORDS * _CODES
    return acc


@triton.jit
def _summed(acc, ROWS: tl.constexpr):
    """``_gemv``'s partials summed over words: [ROWS, BLOCK_N] ([1, BLOCK_N] for one row)."""
    return tl.sum(acc, axis=1)[None, :] if ROWS == 1 else tl.sum(acc, axis=2)


@triton.jit
def _program_rows(
    SortedSlots, BlockExperts, block_m, num_slots, TOP_K: tl.constexpr, ROWS: tl.constexpr
):
    """(expert, slots [ROWS] (num_slots for padding)) of row block ``block_m``: with one row,
    slot block_m and its routing id; else align's block."""
    if ROWS == 1:
        slots = tl.full((1,), 0, tl.int32) + block_m
        expert = tl.load(BlockExperts + block_m).to(tl.int64)
    else:
        expert, slots = block_rows(SortedSlots, BlockExperts, block_m, num_slots, ROWS, False)
    return expert, slots


@triton.jit
def _x_rows(slots, rows_ok, divisor: tl.constexpr, stride, ROWS: tl.constexpr):
    """Element offsets of the activation rows the slots read (slot // divisor); a scalar for
    one row."""
    rows = tl.where(rows_ok, slots // divisor, 0).to(tl.int64) * stride
    return tl.sum(rows, axis=0) if ROWS == 1 else rows


@triton.jit(do_not_specialize=["num_slots"])  # the slot count varies (mxfp4_kernels says why)
def _gate_up_gemv_kernel(
    X,  # [T, H]
    Words,  # [E, 2I, H/8] int32: gate rows, then up rows
    Scales,  # [E, 2I, H/32] uint8
    Bias,  # [E, 2I]
    Act,  # [S, I] (SPLIT_K == 1)
    Part,  # [SPLIT_K, S, 2I] float32 (SPLIT_K > 1)
    SortedSlots,  # align's sorted slots (unread with one row a block)
    BlockExperts,  # align's block experts, or with one row the routing's ids [S]
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    num_slots,
    inter,
    words_per_split,
    row_words,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    block_m, block_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert, slots = _program_rows(SortedSlots, BlockExperts, block_m, num_slots, TOP_K, ROWS)
    if expert < 0:
        return
    rows_ok = slots < num_slots
    x_rows = _x_rows(slots, rows_ok, TOP_K, stride_xt, ROWS)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    first = split * words_per_split
    last = tl.minimum(first + words_per_split, row_words)
    words, scales = Words + expert * stride_we, Scales + expert * stride_se
    gate = _summed(_gemv(X, x_rows, rows_ok, words, scales, cols, col_ok, stride_wn, stride_sn,
                         first, last, ROWS, BLOCK_N, WORDS), ROWS)  # fmt: skip
    up_words, up_scales = words + inter * stride_wn, scales + inter * stride_sn
    up = _summed(_gemv(X, x_rows, rows_ok, up_words, up_scales, cols, col_ok, stride_wn,
                       stride_sn, first, last, ROWS, BLOCK_N, WORDS), ROWS)  # fmt: skip
    mask = rows_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        bias = Bias + expert * stride_be + cols
        gate_bias = tl.load(bias, mask=col_ok, other=0.0)[None, :]
        up_bias = tl.load(bias + inter, mask=col_ok, other=0.0)[None, :]
        dtype = Act.dtype.element_ty
        act = clamped_swiglu(gate, up, gate_bias, up_bias, limit, alpha, dtype)
        out_ptrs = Act + slots[:, None].to(tl.int64) * inter + cols[None, :]
        tl.store(out_ptrs, act.to(dtype), mask=mask)
    else:
        p_ptrs = Part + (split * num_slots + slots[:, None]).to(tl.int64) * 2 * inter
        tl.store(p_ptrs + cols[None, :], gate, mask=mask)
        tl.store(p_ptrs + inter + cols[None, :], up, mask=mask)


@triton.jit(do_not_specialize=["num_slots"])
def _down_gemv_kernel(
    Act,  # [S, I]
    Words,  # [E, H, I/8] int32
    Scales,  # [E, H, I/32] uint8
    Bias,  # [E, H]
    SlotWeights,  # [S] float32
    Out,  # [S, H] float32 (SPLIT_K == 1)
    Part,  # [SPLIT_K, S, H] float32 (SPLIT_K > 1)
    SortedSlots,
    BlockExperts,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    num_slots,
    hidden,
    inter,
    words_per_split,
    row_words,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    block_m, block_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert, slots = _program_rows(SortedSlots, BlockExperts, block_m, num_slots, 1, ROWS)
    if expert < 0:
        return
    rows_ok = slots < num_slots
    a_rows = _x_rows(slots, rows_ok, 1, inter, ROWS)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    first = split * words_per_split
    last = tl.minimum(first + words_per_split, row_words)
    acc = _summed(_gemv(Act, a_rows, rows_ok, Words + expert * stride_we,
                        Scales + expert * stride_se, cols, col_ok, stride_wn, stride_sn,
                        first, last, ROWS, BLOCK_N, WORDS), ROWS)  # fmt: skip
    mask = rows_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        bias = tl.load(Bias + expert * stride_be + cols, mask=col_ok, other=0.0)[None, :]
        weight = tl.load(SlotWeights + slots, mask=rows_ok, other=0.0)[:, None]
        out = weighted_down(acc, bias, weight, Act.dtype.element_ty)
        tl.store(Out + slots[:, None].to(tl.int64) * hidden + cols[None, :], out, mask=mask)
    else:
        p_ptrs = Part + (split * num_slots + slots[:, None]).to(tl.int64) * hidden
        tl.store(p_ptrs + cols[None, :], acc, mask=mask)


@triton.jit
def _split_sum(Part, slot, cols, col_ok, num_slots, width, SPLIT_K: tl.constexpr):
    """Slot ``slot``'s float32 partials at ``cols`` summed over the splits, in split order."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        row = (split * num_slots + slot).to(tl.int64) * width
        acc += tl.load(Part + row + cols, mask=col_ok, other=0.0)
    return acc


@triton.jit(do_not_specialize=["num_slots"])
def _finish_gate_up_kernel(
    Part, Bias, Ids, Act, stride_be, num_slots, inter, limit, alpha,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (slot, column tile): the split partials summed, then gate/up's epilogue."""
    slot = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < inter
    gate = _split_sum(Part, slot, cols, col_ok, num_slots, 2 * inter, SPLIT_K)
    up = _split_sum(Part, slot, cols + inter, col_ok, num_slots, 2 * inter, SPLIT_K)
    bias = Bias + tl.load(Ids + slot).to(tl.int64) * stride_be + cols
    gate_bias = tl.load(bias, mask=col_ok, other=0.0)
    up_bias = tl.load(bias + inter, mask=col_ok, other=0.0)
    dtype = Act.dtype.element_ty
    act = clamped_swiglu(gate, up, gate_bias, up_bias, limit, alpha, dtype)
    tl.store(Act + slot.to(tl.int64) * inter + cols, act.to(dtype), mask=col_ok)


@triton.jit(do_not_specialize=["num_slots"])
def _finish_down_kernel(
    Part, Bias, Ids, SlotWeights, Out, stride_be, num_slots, hidden,
    DTYPE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (slot, column tile): the split partials summed, then down's epilogue."""
    slot = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden
    acc = _split_sum(Part, slot, cols, col_ok, num_slots, hidden, SPLIT_K)
    expert = tl.load(Ids + slot).to(tl.int64)
    bias = tl.load(Bias + expert * stride_be + cols, mask=col_ok, other=0.0)
    out = weighted_down(acc, bias, tl.load(SlotWeights + slot), DTYPE)
    tl.store(Out + slot.to(tl.int64) * hidden + cols, out, mask=col_ok)


def as_words(blocks: torch.Tensor) -> torch.Tensor:
    """[E, rows, cols / 2] uint8 codes -> the same bytes as int32 words [E, rows, cols / 8]
    (a view: rows of whole 32-value blocks are whole 16-byte runs)."""
    if blocks.stride(-1) != 1 or any(s % 4 for s in blocks.stride()[:-1]):
        blocks = blocks.contiguous()
    return blocks.view(torch.int32)


def rule_tiles(num_slots: int, num_experts: int, hidden: int, multiprocessors: int) -> GemvTiles:
    """Tiles where the sweep has not measured: one slot a program up to 1.5 slots an expert on
    average (the slots' programs read an expert's weights side by side, the second from the
    L2), else the expected slots an expert rounded up to a power of two, at most 8; 64 columns
    and 16 words (128 weights) a step; K split in two until the programs fill the
    multiprocessors four times over or a split would get fewer than 4 steps."""
    per_expert = num_slots / max(num_experts, 1)
    rows = 1 if per_expert <= 1.5 else min(8, triton.next_power_of_2(int(per_expert + 0.999)))
    block_n, words = 64, 16
    blocks = num_slots if rows == 1 else min(num_slots, num_experts * 2)
    programs = blocks * triton.cdiv(hidden, block_n)
    steps = triton.cdiv(hidden // CODES_PER_WORD, words)
    split = 1
    while programs * split < 4 * multiprocessors and steps >= 8 * split:
        split *= 2
    return GemvTiles(rows, block_n, words, split)


def gemv_moe_mxfp4(
    x: torch.Tensor,  # [T, H]
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    tiles: GemvTiles,
) -> torch.Tensor:
    """mxfp4_kernels.fused_moe_mxfp4's result by the decode kernels: [T, H] in x's dtype.
    The caller has checked the layout (mxfp4_kernels.check_layout)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = experts.w13_blocks.shape[0]
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    # One row a block: slot b is block b, and the routing's ids are the blocks' experts.
    one_row = tiles.rows == 1
    rows = (ids, ids) if one_row else align(topk_ids, num_experts, tiles.rows)
    x = x.contiguous()
    act = _gate_up(x, experts, ids, rows, top_k, tiles)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    out = _down(act, experts, ids, weights, rows, tiles)
    return combine_slots(out, top_k, x.dtype)


def _gate_up(
    x: torch.Tensor,
    experts: Mxfp4Experts,
    ids: torch.Tensor,  # [S] int32
    rows: tuple[torch.Tensor, torch.Tensor],  # (sorted slots, block experts)
    top_k: int,
    t: GemvTiles,
) -> torch.Tensor:
    """The activations [S, I] in x's dtype."""
    e = experts
    num_slots, hidden = ids.numel(), x.shape[1]
    inter = e.w13_blocks.shape[1] // 2
    words = as_words(e.w13_blocks)
    row_words = hidden // CODES_PER_WORD
    per_split = triton.cdiv(triton.cdiv(row_words, t.split_k), t.words) * t.words
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    part = act
    if t.split_k > 1:
        part = torch.empty(t.split_k, num_slots, 2 * inter, dtype=torch.float32, device=x.device)
    sorted_slots, block_experts = rows
    grid = (block_experts.numel(), triton.cdiv(inter, t.block_n), t.split_k)
    _gate_up_gemv_kernel[grid](
        x, words, e.w13_scales, e.b13, act, part, sorted_slots, block_experts,
        x.stride(0), words.stride(0), words.stride(1), e.w13_scales.stride(0),
        e.w13_scales.stride(1), e.b13.stride(0), num_slots, inter, per_split, row_words,
        e.limit, e.alpha,
        TOP_K=top_k, ROWS=t.rows, BLOCK_N=t.block_n, WORDS=t.words, SPLIT_K=t.split_k,
        num_warps=t.warps, num_stages=1,
    )  # fmt: skip
    if t.split_k > 1:
        block = min(1024, triton.next_power_of_2(inter))
        _finish_gate_up_kernel[(num_slots, triton.cdiv(inter, block))](
            part, e.b13, ids, act, e.b13.stride(0), num_slots, inter, e.limit, e.alpha,
            SPLIT_K=t.split_k, BLOCK=block,
        )  # fmt: skip
    return act


def _down(
    act: torch.Tensor,  # [S, I]
    experts: Mxfp4Experts,
    ids: torch.Tensor,
    weights: torch.Tensor,  # [S] float32
    rows: tuple[torch.Tensor, torch.Tensor],
    t: GemvTiles,
) -> torch.Tensor:
    """Each slot's weighted expert output [S, H], float32."""
    e = experts
    num_slots, inter = act.shape
    hidden = e.w2_blocks.shape[1]
    words = as_words(e.w2_blocks)
    row_words = inter // CODES_PER_WORD
    per_split = triton.cdiv(triton.cdiv(row_words, t.split_k), t.words) * t.words
    out = torch.empty(num_slots, hidden, dtype=torch.float32, device=act.device)
    part = out
    if t.split_k > 1:
        part = torch.empty(t.split_k, num_slots, hidden, dtype=torch.float32, device=act.device)
    sorted_slots, block_experts = rows
    grid = (block_experts.numel(), triton.cdiv(hidden, t.block_n), t.split_k)
    _down_gemv_kernel[grid](
        act, words, e.w2_scales, e.b2, weights, out, part, sorted_slots, block_experts,
        words.stride(0), words.stride(1), e.w2_scales.stride(0), e.w2_scales.stride(1),
        e.b2.stride(0), num_slots, hidden, inter, per_split, row_words,
        ROWS=t.rows, BLOCK_N=t.block_n, WORDS=t.words, SPLIT_K=t.split_k,
        num_warps=t.warps, num_stages=1,
    )  # fmt: skip
    if t.split_k > 1:
        block = min(1024, triton.next_power_of_2(hidden))
        _finish_down_kernel[(num_slots, triton.cdiv(hidden, block))](
            part, e.b2, ids, weights, out, e.b2.stride(0), num_slots, hidden,
            DTYPE=_TL_DTYPES[act.dtype], SPLIT_K=t.split_k, BLOCK=block,
        )  # fmt: skip
    return out
