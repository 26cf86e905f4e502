"""Fused Triton kernels for the elementwise layers: RMSNorm and LayerNorm with the residual add,
rotary embedding in place, SiLU-and-multiply and gelu_new; models/layers.py dispatches CUDA
tensors to them.

A decode step of a small model is launch-bound: the profile of a smollm2-135m step showed RMSNorm
(7 kernels), rotary (5 per tensor) and SiLU-and-multiply (2) costing more GPU time than its
GEMMs. Numerics follow models/layers.py: float32 inside, rounded once on the way out.

Importing this module imports triton: only the CUDA branches of models/layers.py (and GPU tests)
may do so. Set ``TRITON_INTERPRET=1`` before the import to run these kernels on CPU tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine_core.attention.triton_kernels import rotate_in_place
from engine_core.models.w8a8_kernels import quantize_row_int8
from engine_core.peer_all_reduce_kernel import peer_sum
from engine_core.triton_pdl import chain_pdl, launches_dependents, pdl_wait_then_release

if TYPE_CHECKING:
    from engine_core.peer_all_reduce import PeerSumArgs


@triton.jit
def _rms_norm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    Q,
    QScale,
    QUANTIZE: tl.constexpr,
    INT8: tl.constexpr,  # Q is int8 (W8A8), else e4m3
    Q_EPS: tl.constexpr,  # the activations' dtype's eps: an int8 row of zeros' scale
    LAUNCH_DEPENDENTS: tl.constexpr,
    Peers,
    Counters,
    peer_half_elems,
    peer_data_offset,
    peer_signal_offset,
    peer_slot_elems,
    PEER_SUM: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait_then_release(PDL)
    if LAUNCH_DEPENDENTS and not PDL:
        # The FP8 GEMM after this norm may start now (programmatic dependent launch): it pulls
        # its first weight tiles into L2 and waits for this kernel's rows (fp8_kernels.py).
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if PEER_SUM:
        # x is this rank's share of a row-parallel layer's output: first its all-reduce, rounded
        # to the activations' dtype as the separate all-reduce's output is
        # (engine_core/peer_all_reduce_kernel.py).
        x = peer_sum(
            x, row * peer_slot_elems + cols, mask, row, Peers, Counters, peer_half_elems,
            peer_data_offset, peer_signal_offset, RANK, WORLD,
        ).to(x.dtype)  # fmt: skip
    if HAS_RESIDUAL:
        # The sum is rounded to the activations' dtype first, as the unfused `h = h + out` is.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)).to(
            x.dtype
        )
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, y, mask=mask)
    if QUANTIZE:
        if INT8:
            quantize_row_int8(y.to(tl.float32), Q + row * N + cols, QScale + row, mask,
                              Out.dtype.element_ty, Q_EPS)  # fmt: skip
        else:
            _quantize_row(y.to(tl.float32), Q + row * N + cols, QScale + row, mask)


@triton.jit
def _quantize_row(y, q_ptrs, scale_ptr, mask):
    """Store a whole row y (float32) as e4m3 with its absmax / 448 scale: what
    fp8_kernels.quantize_per_token computes from the stored row, so fused and unfused agree."""
    scale = e4m3_scale(tl.max(tl.abs(y), 0))
    tl.store(scale_ptr, scale)
    tl.store(q_ptrs, e4m3_clamped(y, scale).to(q_ptrs.dtype.element_ty), mask=mask)


# The expressions that every kernel quantizing per token (and every SiLU-and-mul) shares: the
# fused and the separate launches give the same bits only while they compute exactly this.
@triton.jit
def e4m3_scale(absmax):
    """A row's scale from its largest magnitude: absmax / 448 (e4m3's largest value), at least
    1e-12 so that a row of zeros still gets a finite, positive one."""
    return tl.maximum(absmax / 448.0, 1e-12)


@triton.jit
def e4m3_clamped(x, scale):
    """x / scale in e4m3's range (float32, for the caller's cast)."""
    return tl.clamp(x / scale, -448.0, 448.0)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up, both float32."""
    return gate / (1.0 + tl.exp(-gate)) * up


def quantized_rows(
    num_rows: int, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty per-token quantized rows [T, N] of ``dtype`` (e4m3 or int8) and their float32
    scales [T, 1], for a fused quantizer."""
    q = torch.empty((num_rows, n), dtype=dtype, device=device)
    return q, torch.empty((num_rows, 1), dtype=torch.float32, device=device)


def rms_norm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
    quant_out: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantized_rows(T, N, ...)
    peer: PeerSumArgs | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or of ``x + residual``: then returns (normed, x + residual), one launch.
    With ``quant_out`` the same launch also quantizes each normed row into it, per token, as
    the separate quantizer would from the normed output: e4m3 (fp8_kernels.quantize_per_token)
    or int8 (w8a8_kernels.quantize_per_token), as its rows' dtype says. With ``peer`` (tensor
    parallelism) x is this rank's share of the rows, summed over the ranks first, in the same
    launch (engine_core/peer_all_reduce.py ``norm_args``)."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if num_rows == 0:
        return out if residual is None else (out, res_out)
    res_in = residual if residual is not None else x
    q, q_scale = quant_out if quant_out is not None else (out, out)
    int8 = q.dtype == torch.int8
    block = triton.next_power_of_2(n)
    pdl = chain_pdl(x)
    _rms_norm_kernel[(num_rows,)](
        x,
        res_in,
        weight,
        out,
        res_out,
        eps,
        x.stride(0),
        res_in.stride(0),
        out.stride(0),
        res_out.stride(0),
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        Q=q,
        QScale=q_scale,
        QUANTIZE=quant_out is not None,
        INT8=int8,
        Q_EPS=torch.finfo(x.dtype).eps,
        # The FP8 GEMM after an e4m3 quantizer launches as its programmatic dependent.
        LAUNCH_DEPENDENTS=quant_out is not None and not int8 and launches_dependents(x),
        **_peer_sum_args(x, peer),
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=min(max(block // 512, 1), 8),
    )
    return out if residual is None else (out, res_out)


def _peer_sum_args(x: torch.Tensor, peer: PeerSumArgs | None) -> dict[str, Any]:
    """The norm kernel's arguments for summing its input over the ranks (dummies without)."""
    if peer is None:
        return dict(
            Peers=x, Counters=x, peer_half_elems=0, peer_data_offset=0, peer_signal_offset=0,
            peer_slot_elems=0, PEER_SUM=False, RANK=0, WORLD=1,
        )  # fmt: skip
    return dict(
        Peers=peer.peers, Counters=peer.counters, peer_half_elems=peer.half_elems,
        peer_data_offset=peer.data_offset, peer_signal_offset=peer.signal_offset,
        peer_slot_elems=peer.slot_elems, PEER_SUM=True, RANK=peer.rank, WORLD=peer.world,
    )  # fmt: skip


# n and width change from step to step, and so does the tables' row stride (their width):
# specialized, their values 1 and multiples of 16 would each compile a variant mid-serving (the
# first step past 240 tokens of context stalled 85 ms with an empty Triton cache:
# docs/design/cuda-graphs-and-warm-up.md, "Nothing compiles mid-serving").
@triton.jit(do_not_specialize=["n", "width", "stride_t"])
def _stage_decode_kernel(
    Ids, Pos, Slots, SeqLens, Tables, Order, DIds, DPos, DSlots, DSeqLens, DTables, DOrder,
    n, width, stride_t, stride_dt, BLOCK_W: tl.constexpr, HAS_ORDER: tl.constexpr,
    STAGE_ORDER: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if row < n:
        tl.store(DIds + row, tl.load(Ids + row))
        tl.store(DPos + row, tl.load(Pos + row))
        tl.store(DSlots + row, tl.load(Slots + row))
        tl.store(DSeqLens + row, tl.load(SeqLens + row))
        if STAGE_ORDER:
            tl.store(DOrder + row, tl.load(Order + row) if HAS_ORDER else row)
        cols = tl.arange(0, BLOCK_W)
        src, dst = Tables + row.to(tl.int64) * stride_t, DTables + row.to(tl.int64) * stride_dt
        for start in range(0, width, BLOCK_W):
            mask = start + cols < width
            tl.store(dst + start + cols, tl.load(src + start + cols, mask=mask), mask=mask)
    else:  # a padding row: it writes no KV slot, attends to nothing and launches in place
        tl.store(DSlots + row, -1)
        tl.store(DSeqLens + row, 0)
        if STAGE_ORDER:
            tl.store(DOrder + row, row)


def stage_decode_inputs(
    inputs: tuple[torch.Tensor, ...],  # input ids, positions, slots [n] int64; seq lens [n]
    block_tables: torch.Tensor,  # [n, width] int32
    buffers: tuple[torch.Tensor, ...],  # the graph's: ids, positions, slots, seq lens [>= rows]
    table_buffer: torch.Tensor,  # the graph's block tables [>= rows, >= width] int32
    rows: int,  # the graph's batch: rows n.. are padding
    order: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> None:
    """A decode step's inputs into a CUDA graph's static buffers, its padding rows made inert
    (no KV slot, no context), in one launch instead of one copy or fill each. ``order``: the
    step's row order [n] int32 (None: the batch's) and the graph's buffer for it [>= rows]
    (None: none staged), which gets each padding row's own index."""
    n, width = block_tables.shape
    step_order, order_buffer = order
    _stage_decode_kernel[(rows,)](
        *inputs, block_tables, inputs[3] if step_order is None else step_order, *buffers,
        table_buffer, inputs[3] if order_buffer is None else order_buffer, n, width,
        block_tables.stride(0), table_buffer.stride(0), BLOCK_W=128,
        HAS_ORDER=step_order is not None, STAGE_ORDER=order_buffer is not None, num_warps=1,
    )  # fmt: skip


@triton.jit
def _rotary_kernel(
    Q,
    K,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF  # head dims like 96 have a half that is not a power of two
    # cos/sin are no output of the kernel just before (the qkv product): read while it
    # finishes (engine_core/triton_pdl.py).
    cos = tl.load(Cos + token * stride_ct + d, mask=d_mask).to(tl.float32)  # [1, HALF]
    sin = tl.load(Sin + token * stride_st + d, mask=d_mask).to(tl.float32)  # halves are equal
    pdl_wait_then_release(PDL)
    rotate_in_place(Q + token * stride_qt, h, d, stride_qh, cos, sin, (h < Q_HEADS) & d_mask, HALF)
    rotate_in_place(K + token * stride_kt, h, d, stride_kh, cos, sin, (h < K_HEADS) & d_mask, HALF)


@triton.jit
def _rotary_cos_sin_kernel(
    Positions, InvFreq, Cos, Sin, factor, HALF: tl.constexpr, BLOCK: tl.constexpr,
    SCALED: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    # As RotaryEmbedding's torch code: one float32 product, libdevice's cosf/sinf (what torch's
    # CUDA cos/sin call; the interpreter has no libdevice), the factor, one rounding to the
    # output dtype; both halves equal.
    freq = tl.load(Positions + token).to(tl.float32) * tl.load(InvFreq + d, mask=mask, other=0.0)
    if LIBDEVICE:
        cos, sin = libdevice.cos(freq), libdevice.sin(freq)
    else:
        cos, sin = tl.cos(freq), tl.sin(freq)
    if SCALED:
        cos, sin = cos * factor, sin * factor
    row = token * (2 * HALF) + d
    cos, sin = cos.to(Cos.dtype.element_ty), sin.to(Sin.dtype.element_ty)
    tl.store(Cos + row, cos, mask=mask)
    tl.store(Cos + row + HALF, cos, mask=mask)
    tl.store(Sin + row, sin, mask=mask)
    tl.store(Sin + row + HALF, sin, mask=mask)


def rotary_cos_sin(
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [rotary_dim / 2]
    attention_factor: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's (cos, sin), each [T, rotary_dim] in ``dtype``, in one launch where its
    torch code takes seven (a plain launch: the rotary kernels read cos/sin before their PDL
    wait, several kernels later, see engine_core/triton_pdl.py)."""
    inv_freq = inv_freq.float().contiguous()
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(num_tokens, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens:
        _rotary_cos_sin_kernel[(num_tokens,)](
            positions.contiguous(), inv_freq, cos, sin, float(attention_factor),
            HALF=half, BLOCK=triton.next_power_of_2(half), SCALED=attention_factor != 1.0,
            LIBDEVICE=positions.is_cuda, num_warps=1,
        )  # fmt: skip
    return cos, sin


def rotary_inplace(
    q: torch.Tensor,  # [T, heads, D], rows may be strided (a view of the qkv projection)
    k: torch.Tensor,  # [T, kv_heads, D]
    cos: torch.Tensor,  # [T, D] (both halves equal, as RotaryEmbedding builds them)
    sin: torch.Tensor,  # [T, D]
) -> None:
    """Apply rotate-half rotary embedding to q and k in place, in one launch."""
    num_tokens, q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("rotary_inplace needs the head dim contiguous")
    k_heads = k.shape[1]
    pdl = chain_pdl(q)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        Q_HEADS=q_heads,
        K_HEADS=k_heads,
        BLOCK_H=triton.next_power_of_2(max(q_heads, k_heads)),
        HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=4 if q_heads * head_dim >= 2048 else 2,
    )


@triton.jit
def _qk_norm_rotary_kernel(
    Q,
    K,
    QW,
    KW,
    Cos,
    Sin,
    q_eps,
    k_eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token program_id(0)'s q and k heads: each head RMS-normalized over its dims and scaled
    by its norm's weight (Qwen3's q_norm / k_norm, rounded as _rms_norm_kernel rounds), then
    rotated (rotate-half, as _rotary_kernel), in place: three launches in one."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    # cos/sin are no output of the kernel just before (the qkv product): read while it
    # finishes (engine_core/triton_pdl.py).
    cos = tl.load(Cos + token * stride_ct + d, mask=d_mask).to(tl.float32)  # [1, HALF]
    sin = tl.load(Sin + token * stride_st + d, mask=d_mask).to(tl.float32)
    pdl_wait_then_release(PDL)
    q_mask = (h < Q_HEADS) & d_mask
    k_mask = (h < K_HEADS) & d_mask
    _norm_rotate(Q + token * stride_qt, h, d, stride_qh, QW, q_eps, cos, sin, q_mask, HALF)
    _norm_rotate(K + token * stride_kt, h, d, stride_kh, KW, k_eps, cos, sin, k_mask, HALF)


@triton.jit
def _norm_rotate(X, h, d, stride_h, W, eps, cos, sin, mask, HALF: tl.constexpr):
    p1 = X + h * stride_h + d
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    inv = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(W + d, mask=d < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    y1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    y2 = (w2 * (f2 * inv).to(x2.dtype).to(tl.float32)).to(x2.dtype).to(tl.float32)
    tl.store(p1, (y1 * cos - y2 * sin).to(x1.dtype), mask=mask)
    tl.store(p2, (y2 * cos + y1 * sin).to(x2.dtype), mask=mask)


def qk_norm_rotary_inplace(
    q: torch.Tensor,  # [T, heads, D], rows may be strided (a view of the qkv projection)
    k: torch.Tensor,  # [T, kv_heads, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    q_eps: float,
    k_eps: float,
    cos: torch.Tensor,  # [T, D] (both halves equal, as RotaryEmbedding builds them)
    sin: torch.Tensor,  # [T, D]
) -> None:
    """Per-head RMSNorm of q and k (each with its weight) and rotary over the whole head, in
    place, in one launch: what q_norm, k_norm and rotary_inplace do in three."""
    num_tokens, q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("qk_norm_rotary_inplace needs the head dim contiguous")
    if cos.shape[1] != head_dim or head_dim % 2:
        raise ValueError("qk_norm_rotary_inplace rotates whole heads of an even size")
    k_heads = k.shape[1]
    pdl = chain_pdl(q)
    _qk_norm_rotary_kernel[(num_tokens,)](
        q, k, q_weight, k_weight, cos, sin, q_eps, k_eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        Q_HEADS=q_heads, K_HEADS=k_heads,
        BLOCK_H=triton.next_power_of_2(max(q_heads, k_heads)),
        HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        PDL=pdl, launch_pdl=pdl, num_warps=4 if q_heads * head_dim >= 2048 else 2,
    )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    stride_x,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out[row] = silu(gate) * up. GROUP 0: X[row] is [gate (N); up (N)]; else it is tiles of
    GROUP gate columns, then the same GROUP up columns (skinny_gemm.interleave_gate_up)."""
    pdl_wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    if GROUP == 0:
        gate_cols = cols
        up_cols = N + cols
    else:
        gate_cols = (cols // GROUP) * (2 * GROUP) + cols % GROUP
        up_cols = gate_cols + GROUP
    gate = tl.load(X + row * stride_x + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + up_cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul(gate, up)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, group: int = 0) -> torch.Tensor:
    """[T, 2I] (gate then up; with ``group``, tiles of that many gate columns then their up
    columns) -> silu(gate) * up, [T, I], one launch."""
    num_rows, width = gate_up.shape
    n = width // 2
    if group and n % group:
        raise ValueError(f"interleaved SiLU-and-mul: {n} columns are not whole groups of {group}")
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    pdl = chain_pdl(gate_up)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block, GROUP=group, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _argmax_chunks_kernel(
    X, MaxOut, IdxOut, n_cols, stride_x, CHUNK: tl.constexpr, PDL: tl.constexpr
):
    """Program (row, chunk): the largest of the row's CHUNK columns from chunk * CHUNK (those
    under n_cols) and the first column holding it. NaN counts as +inf."""
    pdl_wait_then_release(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    slot = row * tl.num_programs(1) + chunk
    tl.store(MaxOut + slot, best)
    tl.store(IdxOut + slot, chunk * CHUNK + at)


@triton.jit
def _argmax_merge_kernel(
    MaxIn, IdxIn, Out, chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    """One program a row: the first chunk holding the row's largest value gives its index."""
    pdl_wait_then_release(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    mask = c < chunks
    best = tl.load(MaxIn + row * chunks + c, mask=mask, other=float("-inf"))
    _, first = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Out + row, tl.load(IdxIn + row * chunks + first).to(tl.int64))


ARGMAX_CHUNK = 2048  # columns per program: a 49,152-token vocabulary in 24 programs a row


def row_argmax(x: torch.Tensor, n_cols: int, out: torch.Tensor) -> torch.Tensor:
    """out[r] = the first column of x[r, :n_cols] holding its largest value, x [R, >= n_cols]
    with unit column stride, out [R] int64: torch.argmax's answer, except that NaN counts as
    +inf here (torch ranks it above +inf; a row holding both is broken logits either way).

    Two launches, chain kernels of the decode step: many programs a row read the row's chunks at
    once, then one a row picks the best. torch.argmax runs one block a row: with the LM head
    before it, 64 rows of a 49,152-token vocabulary, 8-11 us more
    (docs/design/cuda-graphs-and-warm-up.md, "The decode tail")."""
    rows = x.shape[0]
    if x.dim() != 2 or x.stride(1) != 1 or not 0 < n_cols <= x.shape[1]:
        raise ValueError(f"row_argmax: x must be [R, >= {n_cols}] rows of unit column stride, "
                         f"n_cols at least 1; got {tuple(x.shape)}")  # fmt: skip
    if out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"row_argmax: out must be [{rows}] int64, contiguous")
    if rows == 0:
        return out
    chunks = triton.cdiv(n_cols, ARGMAX_CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    where = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    pdl = chain_pdl(x)
    _argmax_chunks_kernel[(rows, chunks)](
        x, best, where, n_cols, x.stride(0), CHUNK=ARGMAX_CHUNK, PDL=pdl, launch_pdl=pdl,
        num_warps=4,
    )  # fmt: skip
    return argmax_of_parts(best, where, out)


def argmax_of_parts(best: torch.Tensor, where: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = where[r, c] for the first part c holding the largest best[r, :]: the second
    step of an argmax whose first step (``row_argmax``'s chunks, the skinny GEMM's epilogue)
    took each part's largest value and first column. best [R, C] float32 and where [R, C]
    int32 contiguous, out [R] int64; a chain kernel of the decode step."""
    rows, parts = best.shape
    pdl = chain_pdl(best)
    block_c = max(2, triton.next_power_of_2(parts))
    _argmax_merge_kernel[(rows,)](
        best, where, out, parts, BLOCK_C=block_c, PDL=pdl, launch_pdl=pdl,
        num_warps=max(1, min(4, block_c // 256)),
    )  # fmt: skip
    return out


@triton.jit
def _layer_norm_kernel(
    X,
    R,
    W,
    B,
    Out,
    ResOut,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to the activations' dtype first, as the unfused `h = h + out` is.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)).to(
            x.dtype
        )
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 0) / N
    centered = tl.where(mask, xf - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        Out + row * stride_o + cols, (centered * rstd * w + b).to(Out.dtype.element_ty), mask=mask
    )


def layer_norm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    bias: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of x, or of ``x + residual``: then returns (normed, x + residual), one launch.
    Statistics in float32, as torch's CUDA LayerNorm keeps them."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if num_rows == 0:
        return out if residual is None else (out, res_out)
    res_in = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    _layer_norm_kernel[(num_rows,)](
        x,
        res_in,
        weight,
        bias,
        out,
        res_out,
        eps,
        x.stride(0),
        res_in.stride(0),
        out.stride(0),
        res_out.stride(0),
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 512, 1), 8),
    )
    return out if residual is None else (out, res_out)


@triton.jit
def _gelu_new_kernel(X, Out, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): one exp. Capping its argument at 80 keeps it finite
    # in float32 while x / (1 + e^80) is still 0 in the far negative tail.
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi) * (...)
    out = x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))
    tl.store(Out + offs, out.to(Out.dtype.element_ty), mask=mask)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-approximated GELU of a contiguous tensor, one launch (float32 inside)."""
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return out
    block = 1024
    _gelu_new_kernel[(triton.cdiv(numel, block),)](x, out, numel, BLOCK=block, num_warps=4)
    return out
