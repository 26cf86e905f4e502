"""FP8 (e4m3) matmuls on CUDA: activation quantizers and the two GEMMs of engine_core/models/fp8.py.

- ``quantize_per_token`` / ``quantize_static`` / ``quantize_per_token_group``: one Triton launch
  each, a row (or a row's group) per program; scales are absmax / 448 so a row uses e4m3's range.
- ``fp8_rowwise_gemm``: per-token activation scales times per-output-row weight scales, on the
  FP8 tensor cores: decode-sized products (up to SKINNY_MAX_ROWS rows) through
  ``fp8_skinny_gemm``, the skinny GEMM of engine_core/models/skinny_gemm.py, which streams the
  weights with the few tokens on the matrix unit's narrow side; larger ones through
  ``torch._scaled_mm`` (cuBLASLt row-wise scaling).
- ``fp8_block_gemm``: the block-wise format (weights in [128, 128] tiles with a scale each,
  activations in 128-column groups with a scale each): a Triton GEMM whose K loop steps one group
  at a time, so every step multiplies its fp8 tile product by one activation scale per row and one
  weight scale per column tile.

Everything is CUDA-graph safe: no host synchronisation; launches depend on shapes and, for the
skinny GEMM's TMA path, on the operands' alignment, which a graph's static buffers keep. Importing
this module imports triton: only the CUDA branch of models/fp8.py (and GPU tests) may.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.models.fp8_config import block_gemm_takes
from engine_core.models.skinny_gemm import skinny_gemm
from engine_core.models.triton_ops import e4m3_clamped, e4m3_scale, silu_mul
from engine_core.models.w8a8_kernels import int8_scale, int8_values
from engine_core.triton_pdl import launches_dependents

FP8_DTYPE = torch.float8_e4m3fn
# The kernels take these constants from triton_ops' e4m3_scale and e4m3_clamped: e4m3's largest
# value (448) and the smallest scale (1e-12, so a row of zeros still gets a finite, positive one),
# as models/fp8.py's FP8_MAX and MIN_SCALE.


# ---- activation quantizers -----------------------------------------------------------------------


@triton.jit
def _quantize_rows_kernel(
    X,
    Out,
    Scale,
    StaticScale,
    stride_x,
    stride_o,
    N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Program (row, group): quantize X[row, group * GROUP : (group + 1) * GROUP]."""
    if LAUNCH_DEPENDENTS:  # the FP8 GEMM after it may start (fp8_skinny_gemm's PDL)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < N)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(StaticScale)
    else:
        scale = e4m3_scale(tl.max(tl.abs(x), 0))
        tl.store(Scale + row * tl.num_programs(1) + group, scale)
    q = e4m3_clamped(x, scale)
    tl.store(Out + row * stride_o + cols, q.to(Out.dtype.element_ty), mask=mask)


def _quantize(
    x: torch.Tensor, group: int, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=FP8_DTYPE, device=x.device)
    groups = -(-n // group)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scale
    block = triton.next_power_of_2(group)
    _quantize_rows_kernel[(rows, groups)](
        x,
        out,
        scale,
        scale if static_scale is None else static_scale,
        x.stride(0),
        out.stride(0),
        N=n,
        GROUP=group,
        BLOCK=block,
        STATIC=static_scale is not None,
        LAUNCH_DEPENDENTS=launches_dependents(x),
        num_warps=min(max(block // 512, 1), 8),
    )
    return out, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scale [M, 1] float32): one absmax / 448 scale per row."""
    return _quantize(x, x.shape[1], None)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> e4m3 [M, K] = clamp(x / scale) with one float32 scale (a [1] tensor)."""
    return _quantize(x, x.shape[1], scale.reshape(1).float())[0]


def quantize_per_token_group(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scale [M, K / group] float32): a scale per row per group."""
    if x.shape[1] % group:
        raise ValueError(f"per-group FP8 needs K ({x.shape[1]}) to be a multiple of {group}")
    return _quantize(x, group, None)


@triton.jit
def _silu_and_mul_quant_kernel(
    X,
    Out,
    Q,
    Scale,
    stride_x,
    stride_o,
    stride_q,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    INT8: tl.constexpr,  # Q is int8 (W8A8: w8a8_kernels' arithmetic), else e4m3
    EPS: tl.constexpr,  # the activations' dtype's eps (int8's scale of a row of zeros)
):
    """Program row: Out[row] = silu(gate) * up in Out's dtype, then Q[row] = its per-token e4m3
    or int8 form and Scale[row] the scale, as silu_and_mul followed by that format's
    quantize_per_token would give."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + offs
        mask = cols < N
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
        out = silu_mul(gate, up).to(Out.dtype.element_ty)
        tl.store(Out + row * stride_o + cols, out, mask=mask)
        amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))
    if INT8:
        scale = int8_scale(tl.max(amax, 0), Out.dtype.element_ty, EPS)
    else:
        scale = e4m3_scale(tl.max(amax, 0))
    tl.store(Scale + row, scale)
    tl.debug_barrier()  # the row's activations, written above, are read back by every thread
    for c0 in range(0, N, BLOCK):
        cols = c0 + offs
        mask = cols < N
        x = tl.load(Out + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
        if INT8:
            q = int8_values(x, scale, Out.dtype.element_ty)
        else:
            q = e4m3_clamped(x, scale).to(Q.dtype.element_ty)
        tl.store(Q + row * stride_q + cols, q, mask=mask)


# SiLU-and-mul quantizes its output in the same launch from this many rows (prefill chunks): one
# program a row, so decode batches (64 rows: 64 programs on 132 multiprocessors) keep the
# column-split SiLU launch and a separate quantizer, which was faster there (0.138 against 0.332 ms
# a step; docs/design/kernels-and-limits.md, "Tried and dropped").
FUSED_ACT_QUANT_MIN_ROWS = 512


def silu_and_mul_quant(
    gate_up: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, 2I] (gate then up) -> (silu(gate) * up [T, I], its per-token rows [T, I] of
    ``dtype``, e4m3 or int8, their scales [T, 1]): triton_ops.silu_and_mul and that format's
    quantize_per_token in one launch, one row a program; the rows' quantized form is read back
    from the row just written (L2), not from a second pass."""
    rows, width = gate_up.shape
    n = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if dtype not in (FP8_DTYPE, torch.int8):
        raise ValueError(f"SiLU-and-mul quantizes to e4m3 or int8, not {dtype}")
    q = torch.empty((rows, n), dtype=dtype, device=gate_up.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows == 0:
        return out, q, scale
    block = min(4096, triton.next_power_of_2(n))
    _silu_and_mul_quant_kernel[(rows,)](
        gate_up, out, q, scale, gate_up.stride(0), out.stride(0), q.stride(0),
        N=n, BLOCK=block, INT8=dtype == torch.int8, EPS=torch.finfo(gate_up.dtype).eps,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out, q, scale


# ---- GEMMs ---------------------------------------------------------------------------------------


def fp8_rowwise_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [M, K] e4m3 with a_scale [M, 1], w [N, K] e4m3 with w_scale [N] -> [M, N] out_dtype:
    (a * a_scale) @ (w * w_scale).T (+ bias), on the FP8 tensor cores."""
    n, k = w.shape
    if k % 16 or n % 16:
        raise ValueError(f"FP8 GEMMs need K and N to be multiples of 16, got K={k}, N={n}")
    block_k = skinny_block_k(a, w)
    if block_k:
        return fp8_skinny_gemm(a, a_scale, w, w_scale, out_dtype, bias, block_k=block_k)
    # Row-wise scaling writes bf16 only; other activation dtypes (float32 on the GPU) convert.
    out = torch._scaled_mm(
        a,
        w.t(),  # [K, N], column-major: the layout the FP8 GEMM wants for its second operand
        scale_a=a_scale.reshape(-1, 1).float().contiguous(),
        scale_b=w_scale.reshape(1, -1).float(),
        bias=bias if out_dtype == torch.bfloat16 else None,
        out_dtype=torch.bfloat16,
    )
    if out_dtype == torch.bfloat16:
        return out
    return out.to(out_dtype) if bias is None else out.to(out_dtype) + bias


# Decode-sized GEMMs (at most this many rows) run fp8_skinny_gemm: inside CUDA graphs it streamed
# llama-8b's four projections 22% faster than cuBLASLt's row-wise FP8 GEMM at 64 rows (93 against
# 120 us a layer) and 32% faster at 16; at 128 rows they were even (108 against 115, cuBLASLt
# ahead on gate_up), so larger M keeps cuBLASLt (docs/design/kernels-and-limits.md, "FP8").
SKINNY_MAX_ROWS = 64


def skinny_block_k(a: torch.Tensor, w: torch.Tensor) -> int:
    """The K tile fp8_skinny_gemm takes for this product, or 0 where cuBLASLt should run it (more
    rows than SKINNY_MAX_ROWS, K not a multiple of 64, rows of non-unit stride)."""
    if a.shape[0] > SKINNY_MAX_ROWS or a.stride(-1) != 1 or w.stride(-1) != 1:
        return 0
    k = w.shape[1]
    return next((bk for bk in (256, 128, 64) if k % bk == 0), 0)


def fp8_skinny_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    **launch: int | bool | None,
) -> torch.Tensor:
    """fp8_rowwise_gemm for few rows: the same product by the skinny GEMM
    (engine_core/models/skinny_gemm.py; ``launch``: its tile shape, splits, stages, TMA)."""
    return skinny_gemm(a, w, out_dtype, a_scale, w_scale, bias, **launch)  # type: ignore[arg-type]


# M, the step's tokens, changes from step to step: specialized, a count that is a multiple of 16
# (every prefill graph's) and one that is not would each compile a variant, the second at the
# first eager prefill of such a count, in the middle of serving (as the fused MoE kernels' slot
# count did: docs/design/cuda-graphs-and-warm-up.md, "Nothing compiles mid-serving").
@triton.jit(do_not_specialize=["M"])
def _block_gemm_kernel(
    A,
    B,
    C,
    AScale,
    BScale,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,
    stride_bs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[M, N] = sum over K groups of (A_g @ B_g.T) * a_scale[m, g] * b_scale[n // SCALE_N, g].

    BLOCK_K is the group (= the weight block's columns), so each K step has one scale per row of
    A and, since BLOCK_N divides SCALE_N, one scale for the whole N tile of B.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: neighbouring programs share B tiles, which keeps them in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    a_scale_ptrs = AScale + rm.to(tl.int64) * stride_as
    b_scale_ptr = BScale + (pid_n * BLOCK_N // SCALE_N) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = rk < K - g * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_s = tl.load(a_scale_ptrs + g, mask=m_mask, other=0.0)  # [BLOCK_M]
        b_s = tl.load(b_scale_ptr + g)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = acc.to(C.dtype.element_ty)
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, c, mask=m_mask[:, None] & n_mask[None, :])


def _block_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the number of rows: decode batches are
    memory-bound (small M tiles, many N tiles to fill the SMs), prefills compute-bound."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    if m <= 256:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a [M, K] e4m3 with a_scale [M, K / block_k] (per token per group); w [N, K] e4m3 with
    w_scale [ceil(N / block_n), ceil(K / block_k)] (the checkpoint's weight_scale_inv) ->
    [M, N] out_dtype."""
    m, k = a.shape
    n = w.shape[0]
    block_n, block_k = block
    if k % block_k or not block_gemm_takes(block):
        raise ValueError(
            f"the block-scaled FP8 GEMM takes [64k, 64 or 128] blocks and K a multiple of the "
            f"block's columns; got block {block} and K={k}"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m, tile_n, warps, stages = _block_config(m)
    # An N tile must sit inside one weight-scale block: its K steps read one scale per tile.
    tile_n = tile_n if block_n % tile_n == 0 else 64
    if any(t.stride(-1) != 1 for t in (a, w, a_scale, w_scale)):
        raise ValueError("the block-scaled FP8 GEMM needs rows with unit stride in every operand")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, tile_n),)
    _block_gemm_kernel[grid](
        a,
        w,
        out,
        a_scale,
        w_scale,
        m,
        n,
        k,
        a.stride(0),
        w.stride(0),
        out.stride(0),
        a_scale.stride(0),
        w_scale.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=tile_n,
        BLOCK_K=block_k,
        SCALE_N=block_n,
        GROUP_M=8,
        num_warps=warps,
        num_stages=stages,
    )
    return out
