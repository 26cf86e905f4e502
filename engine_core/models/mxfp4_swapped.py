"""gpt-oss's MXFP4 experts on CUDA between decode and prefill, with the weights as tl.dot's A.

mxfp4_kernels.py's tiled kernels put the slots on the product's M side, which sm_90's wgmma
cannot take below 64 rows: at 64 tokens (about 8 slots an expert) they run mma.sync on
16-row blocks, and the widened weights, tl.dot's B operand, go from registers through shared
memory before every product. Here each program computes out^T = W @ X^T (OpenAI's
triton_kernels does the same on Hopper):

- *M side*: ROWS weight rows of one expert (64 or 128; wgmma's M is 64 a warpgroup), whose
  widened values are the A operand, which wgmma reads from registers: no bf16 weight touches
  shared memory.
- *N side*: SLOTS sorted slots of that expert (fused_moe's ``align`` padded to SLOTS rows: 16
  at 64 tokens), read as X^T tiles from shared memory. Tensor-core work on padding is cheap;
  what the layer pays for is the weights' bytes and their conversion.
- *Widening* (``SCALED``): ``tl.dot_scaled(codes, scales, "e2m1", X^T, None, "bf16")`` on the
  layout as loaded (byte j of a row holds columns 2j and 2j + 1, low nibble first, which is
  dot_scaled's packing along K; one e8m0 byte a 32 columns): Triton 3.6 stages the code bytes
  (not the bf16 values) in shared memory with cp.async, loads them in the dot operand's
  register layout, widens them with byte permutes and one bf16 multiply by the scale a pair of
  weights, and hands them to wgmma. The bytes are loaded in ``_thread_order`` (a permutation
  within each scale's group, X^T's rows permuted alike), so a thread's operand bytes are one
  word of shared memory. Compiled for sm_90 without a GPU, the main loop takes about 5
  instructions a weight (4.9 gate/up, 5.8 down at 128 x 16 x 128, 8 warps) against 22 for the
  tiled kernel, and no tile in SWAPPED_CANDIDATES spills (docs/design/gpt-oss-and-
  deepseek.md). Scale bytes are read with fast_math (no NaN for byte 255, which trained
  weights do not hold); a scale byte of 0 reads as zero.
- *Loads a step ahead*: the scales (rows 90 bytes apart, too unaligned for cp.async, which is
  all Triton's pipelining stages; with ``SCALED`` only, ``_scales_ahead`` says why) and the X^T
  tile are loaded one K step before they are used, so their latency overlaps a step's work.
- *Bits* (``SCALED`` off: float32 and float16 activations, Triton's interpreter, and a sweep
  candidate in bf16): each nibble becomes its float32 value by its bits (mxfp4_gemv's
  ``e2m1_unscaled``), times the scale built from its byte, rounded to the activations' dtype;
  the low and high nibble planes multiply X^T's even and odd rows (two dots a K step, loaded
  with a stride of 2, no reshape of X).

Epilogues are the tiled kernels' (``clamped_swiglu``, ``weighted_down``, fused_moe's
``combine_slots``), so the results round where theirs do. No atomics, no host sync: a CUDA graph
captures the layer. Importing this module imports triton (set ``TRITON_INTERPRET=1`` first to
run on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import align, block_rows
from engine_core.models.mxfp4 import BLOCK, Mxfp4Experts
from engine_core.models.mxfp4_gemv import e2m1_unscaled, scale_values
from engine_core.models.mxfp4_kernels import clamped_swiglu, expert_gemms, weighted_down

_GROUP = tl.constexpr(BLOCK)  # weights per scale, as the kernels see it
_GROUP_BYTES = tl.constexpr(BLOCK // 2)  # code bytes per scale


@dataclass(frozen=True)
class Swapped:
    """Tiles of the swapped kernels: weight rows a program (M), slots a program (N, and
    align's row block), weight columns a K step, launch settings, and whether the codes widen
    through tl.dot_scaled (bf16 on CUDA only; else by their bits)."""

    rows: int = 128
    slots: int = 16
    k: int = 128
    warps: int = 8
    stages: int = 3
    scaled: bool = True


# Tiles ``python -m benchmarks mxfp4 --sweep`` times (16 to 256 tokens: 2 to 32 slots an expert
# at gpt-oss-20b's 32 experts, top 4). None spills compiled for sm_90 without a GPU (``python -m
# benchmarks mxfp4-compile``; gate/up holds gate's and up's tiles: 128 x 32 x 128 with 4 warps
# spills there, and is left out); deeper pipelines (stages) keep more code bytes in flight
# where few programs fit a multiprocessor. Their speed is unmeasured.
SWAPPED_CANDIDATES = (
    Swapped(128, 16, 128, warps=8),
    Swapped(128, 16, 128, warps=8, stages=4),
    Swapped(128, 16, 128, warps=4),
    Swapped(128, 16, 256, warps=8),
    Swapped(64, 16, 128, warps=4),
    Swapped(64, 16, 128, warps=4, stages=4),
    Swapped(64, 16, 64, warps=4, stages=5),
    Swapped(128, 16, 64, warps=4),
    Swapped(128, 16, 64, warps=8),
    Swapped(64, 32, 128, warps=4),
    Swapped(128, 32, 128, warps=8),
    Swapped(128, 32, 64, warps=8),
    Swapped(128, 16, 64, warps=4, scaled=False),
)


@triton.jit
def _codes_tile(code_rows, rows_ok, k0, width, BLOCK_K: tl.constexpr):
    """Weight rows' code bytes [ROWS, BLOCK_K / 2] from column k0 on, zeros past the row's end
    (width columns), in _thread_order. code_rows: [ROWS, 1] pointers to the rows' starts."""
    b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ok = rows_ok[:, None] & (b < width // 2)[None, :]
    return _thread_order(tl.load(code_rows + b[None, :], mask=ok, other=0))


@triton.jit
def _thread_order(codes):
    """A code tile with each 16-byte (one scale's) group reordered: place 4i + c takes the
    loaded byte 4c + i. wgmma's A operand gives a thread bytes c, c + 4, c + 8, c + 12 of a
    group's row; reordered so, they are 4 loaded bytes in a row, which Triton reads from shared
    memory in whole words (ldmatrix) instead of byte by byte, then packing them (compiled for
    sm_90 at 128 x 16 x 128, 8 warps: the main loop's instructions a weight 5.9 -> 4.9 in
    gate/up, 6.6 -> 5.8 in down). The order is a permutation within a scale group, so the
    scales stay as loaded; X^T's rows follow it (``_source_bytes``)."""
    rows: tl.constexpr = codes.shape[0]
    width: tl.constexpr = codes.shape[1]
    groups = tl.reshape(codes, (rows, width // _GROUP_BYTES, 4, 4))
    return tl.reshape(tl.trans(groups, 0, 1, 3, 2), (rows, width))


@triton.jit
def _source_bytes(places):
    """The loaded byte (within the step) that each place of a _thread_order tile holds."""
    group = places // _GROUP_BYTES * _GROUP_BYTES
    return group + (places % 4) * 4 + (places % _GROUP_BYTES) // 4


@triton.jit
def _scales_tile(scale_rows, rows_ok, k0, width, BLOCK_K: tl.constexpr):
    """The rows' scale bytes [ROWS, BLOCK_K / 32] from column k0 on, as _codes_tile's."""
    g = k0 // _GROUP + tl.arange(0, BLOCK_K // _GROUP)
    ok = rows_ok[:, None] & (g < width // _GROUP)[None, :]
    return tl.load(scale_rows + g[None, :], mask=ok, other=0)


@triton.jit
def _scales_ahead(scale_rows, rows_ok, k0, width, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    """The scales a K step hands _product, loaded a step ahead so that their latency (their
    rows are 90 bytes apart: no cp.async, so Triton's pipelining leaves them) overlaps a step.
    The bits path loads its own in the step (a placeholder here): a scale tile carried from the
    step before reaches the widening in a layout Triton then cannot convert on the codes, and
    the widened bf16 tile goes through shared memory (compiled for sm_90)."""
    if SCALED:
        scales = _scales_tile(scale_rows, rows_ok, k0, width, BLOCK_K)
    else:
        scales = tl.zeros((1, 1), dtype=tl.uint8)
    return scales


@triton.jit
def _slots_tile(slot_rows, slots_ok, cols, width):
    """X^T [len(cols), SLOTS]: the slots' rows of X (slot_rows: [1, SLOTS] pointers to their
    starts) at columns ``cols``, zeros past the width and for padding slots."""
    ok = (cols < width)[:, None] & slots_ok[None, :]
    return tl.load(slot_rows + cols[:, None], mask=ok, other=0.0)


@triton.jit
def _slots_tiles(slot_rows, slots_ok, k0, width, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    """The K step's X^T operands, rows in the codes' _thread_order: with SCALED all of them
    (byte j's columns 2j and 2j + 1 side by side; twice, for one signature), else the low
    nibbles' columns and the high nibbles'."""
    if SCALED:
        j = tl.arange(0, BLOCK_K)
        x_a = _slots_tile(slot_rows, slots_ok, k0 + 2 * _source_bytes(j // 2) + j % 2, width)
        x_b = x_a
    else:
        low = k0 + 2 * _source_bytes(tl.arange(0, BLOCK_K // 2))
        x_a = _slots_tile(slot_rows, slots_ok, low, width)
        x_b = _slots_tile(slot_rows, slots_ok, low + 1, width)
    return x_a, x_b


@triton.jit
def _widened_planes(codes, scales, dtype: tl.constexpr):
    """A weight tile's low and high nibble planes (columns 2j and 2j + 1), each [ROWS,
    BLOCK_K / 2] in dtype, by their bits (module docstring)."""
    rows: tl.constexpr = codes.shape[0]
    groups: tl.constexpr = scales.shape[1]
    scales = tl.broadcast_to(scales[:, :, None], (rows, groups, _GROUP_BYTES))
    factor = scale_values(tl.reshape(scales, (rows, groups * _GROUP_BYTES)).to(tl.int32))
    codes = codes.to(tl.int32)
    low = (e2m1_unscaled(codes & 0xF) * factor).to(dtype)
    return low, (e2m1_unscaled(codes >> 4) * factor).to(dtype)


@triton.jit
def _product(acc, code_rows, scale_rows, rows_ok, scales, x_a, x_b, k0, width,
             PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    """acc [ROWS, SLOTS] + the weight rows' K step at k0 (its codes loaded here, its scales
    _scales_ahead's) times the slots' (_slots_tiles' pair); the module docstring says what
    ``SCALED`` does."""
    codes = _codes_tile(code_rows, rows_ok, k0, width, BLOCK_K)
    if SCALED:
        acc = tl.dot_scaled(codes, scales, "e2m1", x_a, None, "bf16", acc, fast_math=True)
    else:
        scales = _scales_tile(scale_rows, rows_ok, k0, width, BLOCK_K)
        low, high = _widened_planes(codes, scales, x_a.dtype)
        acc = tl.dot(low, x_a, acc, input_precision=PRECISION)
        acc = tl.dot(high, x_b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_slots"])  # as mxfp4_kernels._gate_up_kernel
def _gate_up_swapped_kernel(
    X,  # [T, H]
    Codes,  # [E, 2I, H/2] uint8: gate rows, then up rows
    Scales,  # [E, 2I, H/32] uint8
    Bias,  # [E, 2I]
    Act,  # [S, I] (S = T*K slots)
    SortedSlots,  # [R] slot of each sorted row; S for padding
    BlockExperts,  # [R // SLOTS] expert of each block of rows; -1 past the last one
    stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_be, stride_as,
    num_slots, hidden, inter, limit, alpha,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    expert, slots = block_rows(SortedSlots, BlockExperts, tl.program_id(0), num_slots, SLOTS, False)
    if expert < 0:
        return
    slots_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rows_ok = rows < inter
    gate_codes = Codes + expert * stride_ce + rows[:, None] * stride_cn
    gate_scales = Scales + expert * stride_se + rows[:, None] * stride_sn
    up_codes, up_scales = gate_codes + inter * stride_cn, gate_scales + inter * stride_sn
    x_rows = X + tokens[None, :] * stride_xt
    gate = tl.zeros((ROWS, SLOTS), dtype=tl.float32)
    up = tl.zeros((ROWS, SLOTS), dtype=tl.float32)
    gate_s = _scales_ahead(gate_scales, rows_ok, 0, hidden, BLOCK_K, SCALED)
    up_s = _scales_ahead(up_scales, rows_ok, 0, hidden, BLOCK_K, SCALED)
    x_a, x_b = _slots_tiles(x_rows, slots_ok, 0, hidden, BLOCK_K, SCALED)
    for k0 in range(0, hidden, BLOCK_K):
        k1 = k0 + BLOCK_K  # the next step's (masked off after the last step)
        gate_s1 = _scales_ahead(gate_scales, rows_ok, k1, hidden, BLOCK_K, SCALED)
        up_s1 = _scales_ahead(up_scales, rows_ok, k1, hidden, BLOCK_K, SCALED)
        x_a1, x_b1 = _slots_tiles(x_rows, slots_ok, k1, hidden, BLOCK_K, SCALED)
        gate = _product(gate, gate_codes, gate_scales, rows_ok, gate_s, x_a, x_b, k0, hidden,
                        PRECISION, BLOCK_K, SCALED)  # fmt: skip
        up = _product(up, up_codes, up_scales, rows_ok, up_s, x_a, x_b, k0, hidden, PRECISION,
                      BLOCK_K, SCALED)  # fmt: skip
        gate_s, up_s, x_a, x_b = gate_s1, up_s1, x_a1, x_b1
    bias = Bias + expert * stride_be + rows
    gate_bias = tl.load(bias, mask=rows_ok, other=0.0)[:, None]
    up_bias = tl.load(bias + inter, mask=rows_ok, other=0.0)[:, None]
    dtype = X.dtype.element_ty
    act = clamped_swiglu(gate, up, gate_bias, up_bias, limit, alpha, dtype)
    out_ptrs = Act + slots[None, :].to(tl.int64) * stride_as + rows[:, None]
    tl.store(out_ptrs, act.to(dtype), mask=rows_ok[:, None] & slots_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])  # as mxfp4_kernels._gate_up_kernel
def _down_swapped_kernel(
    Act,  # [S, I]
    Codes,  # [E, H, I/2] uint8
    Scales,  # [E, H, I/32] uint8
    Bias,  # [E, H]
    Out,  # [S, H] float32
    SlotWeights,  # [S] float32
    SortedSlots,
    BlockExperts,
    stride_as, stride_ce, stride_cn, stride_se, stride_sn, stride_be, stride_os,
    num_slots, hidden, inter,
    PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    expert, slots = block_rows(SortedSlots, BlockExperts, tl.program_id(0), num_slots, SLOTS, False)
    if expert < 0:
        return
    slots_ok = slots < num_slots
    slot_rows = slots.to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rows_ok = rows < hidden
    codes = Codes + expert * stride_ce + rows[:, None] * stride_cn
    scales = Scales + expert * stride_se + rows[:, None] * stride_sn
    act_rows = Act + slot_rows[None, :] * stride_as
    acc = tl.zeros((ROWS, SLOTS), dtype=tl.float32)
    step_scales = _scales_ahead(scales, rows_ok, 0, inter, BLOCK_K, SCALED)
    a_a, a_b = _slots_tiles(act_rows, slots_ok, 0, inter, BLOCK_K, SCALED)
    for k0 in range(0, inter, BLOCK_K):
        k1 = k0 + BLOCK_K  # as in _gate_up_swapped_kernel
        next_scales = _scales_ahead(scales, rows_ok, k1, inter, BLOCK_K, SCALED)
        a_a1, a_b1 = _slots_tiles(act_rows, slots_ok, k1, inter, BLOCK_K, SCALED)
        acc = _product(
            acc,
            codes,
            scales,
            rows_ok,
            step_scales,
            a_a,
            a_b,
            k0,
            inter,
            PRECISION,
            BLOCK_K,
            SCALED,
        )
        step_scales, a_a, a_b = next_scales, a_a1, a_b1
    bias = tl.load(Bias + expert * stride_be + rows, mask=rows_ok, other=0.0)[:, None]
    weight = tl.load(SlotWeights + slots, mask=slots_ok, other=0.0)[None, :]
    out = weighted_down(acc, bias, weight, Act.dtype.element_ty)
    out_ptrs = Out + slot_rows[None, :] * stride_os + rows[:, None]
    tl.store(out_ptrs, out, mask=rows_ok[:, None] & slots_ok[None, :])


def swapped_moe_mxfp4(
    x: torch.Tensor,  # [T, H]
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    tiles: Swapped,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H], as
    mxfp4_kernels.fused_moe_mxfp4 (the caller checks the layout), with the weights on tl.dot's
    M side. No host sync."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    rows = align(topk_ids, experts.w13_blocks.shape[0], tiles.slots)
    # dot_scaled takes bf16 X^T only, and Triton's interpreter does not run it.
    scaled = tiles.scaled and x.is_cuda and x.dtype == torch.bfloat16
    t = tiles
    constants = {"ROWS": t.rows, "SLOTS": t.slots, "BLOCK_K": t.k, "SCALED": scaled}
    return expert_gemms(
        (_gate_up_swapped_kernel, _down_swapped_kernel), x, experts, topk_weights, top_k, rows,
        t.rows, constants | {"num_warps": t.warps, "num_stages": t.stages},
    )  # fmt: skip
