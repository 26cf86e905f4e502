"""FP8 experts on CUDA: fused_moe's grouping with GEMMs on e4m3 weights and e4m3 activations.

An FP8 checkpoint's experts (models/moe.py ``SparseMoE.make_fp8``) hold ``w13 [E, 2I, H]`` and
``w2 [E, H, I]`` in e4m3 with float32 scales: one per output row (``w13_scale [E, 2I]``: a
per-channel checkpoint, a per-tensor one spread over its rows, or ``--quantization fp8``), or one
per block of ``block = (rows, cols)`` weights (``w13_scale [E, 2I / rows, H / cols]``: the
128 x 128 blocks of Qwen3's and DeepSeek's FP8 releases). Every such scheme quantizes the
activations dynamically (static activation scales for experts are refused at load): per token for
row scales, per token and ``cols``-column group for block scales. So this layer computes what the
CPU reference (moe.py ``SparseMoE.fp8_expert``, fp8.py's dequantizing ``fp8_linear``) computes,
as the FP8 tensor cores compute it:

1. the tokens quantized to e4m3 once (fp8_kernels' quantizers): an expert's input is the token's
   row, and a token's quantization does not depend on the expert;
2. ``align`` (fused_moe.py), skipped for a single token, whose K experts are distinct;
3. ``_gate_up_kernel``: a block of sorted rows times the expert's gate and up tiles, e4m3 by
   e4m3 on the tensor cores (``tl.dot`` of two fp8 tiles, float32 accumulation). With block
   scales every K step lies inside one column group (BLOCK_K divides ``cols``), so each step's
   product is scaled by the rows' activation scales of that group and the columns' weight scales
   of that block before it is added; with row scales the sum is scaled once at the end. Gate and
   up are rounded to the activations' dtype, as the reference's linear rounds them, then SiLU(gate)
   * up is written per slot;
4. the slots' activations quantized per slot (and group) as the scheme says, one launch;
5. ``_down_kernel``: the same product against the expert's down rows, rounded to the activations'
   dtype, times the slot's routing weight, written per slot in that dtype (as fused_moe's);
6. ``combine_slots`` (fused_moe.py): each token's K slots summed in float32, in slot order.

No step reads anything on the host, so the layer is captured in CUDA graphs like the bf16 one.

The weights are read as stored, one byte a value: a tile of BLOCK_K consecutive bytes per weight
row, the access of fused_moe's bf16 tiles at half the bytes. Why e4m3 by e4m3 rather than
widening the weights to bf16 against bf16 activations: the checkpoint's scheme quantizes the
activations too (a model whose activations stayed in bf16 would not be the model the CPU
reference, and vLLM and SGLang serving the checkpoint, compute), and both operands in e4m3 take
the FP8 tensor cores at twice the bf16 rate for prefill. The product of two e4m3 values is exact
in float32, so only the accumulation order differs from the reference.

INT8 experts (W8A8, models/int8.py) take the same kernels: int8 tiles of weights and of
activations quantized per token as compressed-tensors does (w8a8_kernels' quantizer), ``tl.dot``
accumulating in int32 (``ACC``), both row scales applied once to the sum in float32
(``fused_moe_int8``). An int8 product sums exactly, so again only the float32 scaling's order
differs from the reference.

Importing this module imports triton: only CUDA code paths and GPU tests may do so (or set
``TRITON_INTERPRET=1`` first to run on CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.models.fp8 import Fp8Experts
from engine_core.models.fp8_kernels import quantize_per_token, quantize_per_token_group
from engine_core.models.fused_moe import Blocks, align, block_rows, combine_slots
from engine_core.models.int8 import Int8Experts
from engine_core.models.w8a8_kernels import quantize_per_token as int8_per_token


@triton.jit
def _scaled_dot(
    acc, a, w, a_scale_ptrs, w_scale_ptrs, row_ok, col_ok, BLOCK_SCALED: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """acc + a @ w (e4m3 or int8 tiles [M, K] and [K, N], ACC accumulation: float32 or int32);
    with BLOCK_SCALED the product is scaled first by the rows' activation scales and the
    columns' weight scales of this K step's group (the pointers already at the step's group)."""
    product = tl.dot(a, w, out_dtype=ACC)
    if BLOCK_SCALED:
        a_scale = tl.load(a_scale_ptrs, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptrs, mask=col_ok, other=0.0)
        return acc + product * a_scale[:, None] * w_scale[None, :]
    return acc + product


@triton.jit
def _row_scaled(acc, a_scale_ptrs, w_scale_ptrs, row_ok, col_ok, BLOCK_SCALED: tl.constexpr):
    """A row-scaled product's sum times its rows' activation scales and columns' weight scales
    (block-scaled products were scaled step by step)."""
    if BLOCK_SCALED:
        return acc
    a_scale = tl.load(a_scale_ptrs, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptrs, mask=col_ok, other=0.0)
    return acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]


# The slot count changes from step to step: not specialized (fused_moe._gate_up_kernel says why).
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    Xq,  # [T, H] e4m3 (int8)
    XScale,  # [T, H / GROUP_K] (block) or [T, 1] float32
    W13,  # [E, 2I, H] e4m3 (int8)
    W13Scale,  # [E, 2I / GROUP_N, H / GROUP_K] (block) or [E, 2I] float32
    Act,  # [S, I] the activations' dtype (S = T*K slots)
    SortedSlots,  # [R] slot of each sorted row; S for padding
    BlockExperts,  # [R // BLOCK_M] expert of each block of rows; -1 past the last one
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_as,
    num_slots,
    hidden,
    inter,
    TOP_K: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    ACC: tl.constexpr,  # the products' accumulator: float32 (e4m3), int32 (int8)
    GROUP_N: tl.constexpr,  # weight rows a scale (1: row scales)
    GROUP_K: tl.constexpr,  # columns a scale group (block scales; BLOCK_K divides it)
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
    tokens = (slots // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = Xq + tokens[:, None] * stride_xt + ks[None, :]
    # Offsets within one expert's rows fit in int32 (64-bit pointers a weight would take twice
    # the registers, and spilled); the expert's start is added as int64, once.
    w_offsets = cols[None, :] * stride_wn + ks[:, None]
    gate_ptrs = W13 + expert * stride_we + w_offsets
    up_ptrs = gate_ptrs + inter * stride_wn
    # Scales: the rows' (per token) and the columns' (gate's, then up's: I rows further on).
    x_scales = XScale + tokens * stride_xst
    w_scales = W13Scale + expert * stride_wse
    gate_scales = w_scales + (cols // GROUP_N) * stride_wsn
    up_scales = w_scales + ((cols + inter) // GROUP_N) * stride_wsn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (ks + k0) < hidden
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate_w = tl.load(gate_ptrs + k0, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs + k0, mask=w_mask, other=0.0)
        group = k0 // GROUP_K
        gate = _scaled_dot(gate, x, gate_w, x_scales + group, gate_scales + group, row_ok, col_ok,
                           BLOCK_SCALED, ACC)  # fmt: skip
        up = _scaled_dot(up, x, up_w, x_scales + group, up_scales + group, row_ok, col_ok,
                         BLOCK_SCALED, ACC)  # fmt: skip
    gate = _row_scaled(gate, x_scales, gate_scales, row_ok, col_ok, BLOCK_SCALED)
    up = _row_scaled(up, x_scales, up_scales, row_ok, col_ok, BLOCK_SCALED)
    # Each linear's output rounded to the activations' dtype, as the reference's linear does.
    dtype = Act.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])  # as _gate_up_kernel
def _down_kernel(
    Aq,  # [S, I] e4m3 (int8)
    AScale,  # [S, I / GROUP_K] (block) or [S, 1] float32
    W2,  # [E, H, I] e4m3 (int8)
    W2Scale,  # [E, H / GROUP_N, I / GROUP_K] (block) or [E, H] float32
    Out,  # [S, H] the activations' dtype
    SlotWeights,  # [S] float32
    SortedSlots,
    BlockExperts,
    stride_as,
    stride_ass,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_os,
    num_slots,
    hidden,
    inter,
    BLOCK_SCALED: tl.constexpr,
    ACC: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
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
    slots64 = slots.to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = Aq + slots64[:, None] * stride_as + ks[None, :]
    w_ptrs = W2 + expert * stride_we + (cols[None, :] * stride_wn + ks[:, None])  # as gate/up's
    a_scales = AScale + slots64 * stride_ass
    w_scales = W2Scale + expert * stride_wse + (cols // GROUP_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (ks + k0) < inter
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        group = k0 // GROUP_K
        acc = _scaled_dot(acc, a, w, a_scales + group, w_scales + group, row_ok, col_ok,
                          BLOCK_SCALED, ACC)  # fmt: skip
    acc = _row_scaled(acc, a_scales, w_scales, row_ok, col_ok, BLOCK_SCALED)
    acc = acc.to(Out.dtype.element_ty).to(tl.float32)  # the reference's linear output, rounded
    weight = tl.load(SlotWeights + slots, mask=row_ok, other=0.0)
    out_ptrs = Out + slots64[:, None] * stride_os + cols[None, :]
    out = (acc * weight[:, None]).to(Out.dtype.element_ty)
    tl.store(out_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def block_sizes(num_slots: int, num_experts: int) -> Blocks:
    """Row blocks as fused_moe's (small when each expert gets few rows, large when many). Not
    yet timed on a GPU (``python -m benchmarks fp8-moe --sweep`` times the CANDIDATES). Compiled
    for sm_90 here (Triton 3.9, ptxas -v), the 16-row tile spilled 408 bytes with a K step of
    128 and 136 with 64, and the one-token tiles none, so decode steps 64 e4m3 values (64
    bytes a weight row) and larger row blocks 128; ``fit_to_group`` cuts a step to a narrower
    scale group."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 8:
        return Blocks(16, 64, 64)
    if per_expert <= 64:
        return Blocks(32, 64, 128)
    return Blocks(64, 128, 128, warps=8)


# The one-token path's tiles (one slot a row block: fused_moe's ONE_SLOT_PER_BLOCK).
ONE_TOKEN_GATE_UP = Blocks(16, 32, 128, warps=4, stages=4)
ONE_TOKEN_DOWN = Blocks(16, 64, 128)
# Tiles ``python -m benchmarks fp8-moe --sweep`` times beside block_sizes' choice.
CANDIDATES = (
    Blocks(16, 32, 128),
    Blocks(16, 64, 64),
    Blocks(16, 64, 128),
    Blocks(16, 128, 128),
    Blocks(32, 64, 64),
    Blocks(32, 64, 128),
    Blocks(32, 128, 128, warps=8),
    Blocks(64, 64, 128),
    Blocks(64, 128, 128, warps=8),
    Blocks(128, 128, 128, warps=8),
    Blocks(128, 128, 64, warps=8),
)
MIN_BLOCK_K = 32  # the FP8 tensor cores' shortest K step


def fit_to_group(blocks: Blocks, block: tuple[int, int] | None) -> Blocks:
    """``blocks`` with its K step cut to the scale group's width where that is narrower, so a
    K step never straddles two groups (block scales are applied per step)."""
    if block is None or blocks.k <= block[1]:
        return blocks
    return Blocks(blocks.m, blocks.n, block[1], blocks.warps, blocks.stages)


def fused_moe_fp8(
    x: torch.Tensor,  # [T, H] bf16, fp16 or float32
    experts: Fp8Experts | Int8Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: block_sizes' choice (a benchmark may sweep others)
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H], each
    expert a SwiGLU over FP8 weights with the activations quantized as the scheme says (module
    docstring). No host sync."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    check_layout(experts, x.shape[1])
    xq = quantize_activations(x, experts)
    if num_tokens == 1 and blocks is None:
        ids = topk_ids.reshape(-1).to(torch.int32)
        tiles = (fit_to_group(ONE_TOKEN_GATE_UP, experts.block),
                 fit_to_group(ONE_TOKEN_DOWN, experts.block))  # fmt: skip
        return _grouped_gemms(x.dtype, xq, experts, topk_weights, top_k, (None, ids), tiles)
    num_experts = experts.w13.shape[0]
    b = fit_to_group(blocks or block_sizes(topk_ids.numel(), num_experts), experts.block)
    rows = align(topk_ids, num_experts, b.m)
    return _grouped_gemms(x.dtype, xq, experts, topk_weights, top_k, rows, (b, b))


def fused_moe_int8(
    x: torch.Tensor,  # [T, H] bf16, fp16 or float32
    experts: Int8Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: block_sizes' choice
) -> torch.Tensor:
    """``fused_moe_fp8``'s layer over INT8 experts (module docstring): int8 tiles, int32 sums,
    the activations quantized per token (W8A8's scheme). No host sync."""
    return fused_moe_fp8(x, experts, topk_weights, topk_ids, blocks)


def quantize_activations(
    x: torch.Tensor, experts: Fp8Experts | Int8Experts
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 or int8 [M, K] as the experts' weights, float32 scales): per token and
    ``block[1]``-column group for block weights ([M, K / cols]), per token for row-scaled ones
    ([M, 1])."""
    if isinstance(experts, Int8Experts):
        return int8_per_token(x)
    if experts.block is None:
        return quantize_per_token(x)
    return quantize_per_token_group(x, experts.block[1])


def check_layout(experts: Fp8Experts | Int8Experts, hidden: int) -> None:
    """ValueError unless the tensors have the dtypes, shapes and inner strides the kernels
    assume."""
    num_experts, rows, _ = experts.w13.shape
    inter = rows // 2
    if experts.block is None:
        scale_13, scale_2 = (num_experts, 2 * inter), (num_experts, hidden)
    else:
        scale_rows, scale_cols = experts.block
        if scale_cols % MIN_BLOCK_K or hidden % scale_cols or inter % scale_cols:
            raise ValueError(
                f"fused_moe_fp8: scale blocks of {scale_cols} columns need widths ({hidden}, "
                f"{inter}) that are whole blocks, and a multiple of {MIN_BLOCK_K} columns"
            )
        if inter % scale_rows:
            raise ValueError(
                f"fused_moe_fp8: the width {inter} is not whole {scale_rows}-row blocks"
            )
        scale_13 = (num_experts, -(-2 * inter // scale_rows), hidden // scale_cols)
        scale_2 = (num_experts, -(-hidden // scale_rows), inter // scale_cols)
    dtype = torch.int8 if isinstance(experts, Int8Experts) else torch.float8_e4m3fn
    want = {
        "w13": (experts.w13, (num_experts, 2 * inter, hidden), dtype),
        "w13_scale": (experts.w13_scale, scale_13, torch.float32),
        "w2": (experts.w2, (num_experts, hidden, inter), dtype),
        "w2_scale": (experts.w2_scale, scale_2, torch.float32),
    }
    for name, (tensor, shape, dtype) in want.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.stride(-1) != 1:
            raise ValueError(
                f"fused_moe_fp8: {name} is {tuple(tensor.shape)} {tensor.dtype} (inner stride "
                f"{tensor.stride(-1)}); the kernels need {shape} {dtype}, rows contiguous"
            )


def _grouped_gemms(
    dtype: torch.dtype,  # the activations'
    xq: tuple[torch.Tensor, torch.Tensor],  # the tokens in e4m3 and their scales
    experts: Fp8Experts | Int8Experts,
    topk_weights: torch.Tensor,
    top_k: int,
    rows: tuple[torch.Tensor | None, torch.Tensor],  # align's (sorted slots, block experts)
    tiles: tuple[Blocks, Blocks],  # gate/up's, down's
) -> torch.Tensor:
    """Steps 3 to 6 of the module docstring over the row blocks ``rows`` describes: align's
    output, or (None, the single token's expert ids) for one slot a block."""
    sorted_slots, block_experts = rows
    one_slot = sorted_slots is None
    slots_arg = block_experts if one_slot else sorted_slots  # unread with ONE_SLOT_PER_BLOCK
    (x, x_scale), e = xq, experts
    num_tokens, hidden = x.shape
    inter = e.w13.shape[1] // 2
    num_slots, num_blocks = num_tokens * top_k, block_experts.numel()
    scaled = e.block is not None
    group_n, group_k = e.block or (1, 1)
    acc = tl.int32 if isinstance(e, Int8Experts) else tl.float32
    act = torch.empty(num_slots, inter, dtype=dtype, device=x.device)
    b = tiles[0]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, b.n))](
        x, x_scale, e.w13, e.w13_scale, act, slots_arg, block_experts,
        x.stride(0), x_scale.stride(0), e.w13.stride(0), e.w13.stride(1),
        e.w13_scale.stride(0), e.w13_scale.stride(1), act.stride(0),
        num_slots, hidden, inter,
        TOP_K=top_k, BLOCK_SCALED=scaled, ACC=acc, GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    aq, a_scale = quantize_activations(act, e)
    # Per slot in the activations' dtype, as fused_moe's: float32 would double the largest
    # buffer of a prefill (8,192 tokens x top 8 x DeepSeek-V3's 7,168 columns: 1.9 GB).
    out = torch.empty(num_slots, hidden, dtype=dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    b = tiles[1]
    _down_kernel[(num_blocks, triton.cdiv(hidden, b.n))](
        aq, a_scale, e.w2, e.w2_scale, out, weights, slots_arg, block_experts,
        aq.stride(0), a_scale.stride(0), e.w2.stride(0), e.w2.stride(1),
        e.w2_scale.stride(0), e.w2_scale.stride(1), out.stride(0),
        num_slots, hidden, inter,
        BLOCK_SCALED=scaled, ACC=acc, GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    return combine_slots(out, top_k, dtype)
