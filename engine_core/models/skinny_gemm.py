"""The skinny GEMM: decode-sized products (a few rows of activations against a weight matrix) as
a Triton kernel that streams the weights with the tokens on the matrix unit's narrow side.

- ``skinny_gemm``: C = A @ W.T for A [M, K] (the rows in one tile, or in tiles side by side),
  W [N, K]: FP8 operands with their row-wise scales (engine_core/models/fp8_kernels.py
  ``fp8_rowwise_gemm``), or bf16/fp16 ones.
- ``decode_linear``: where plain (bf16/fp16) weights take it instead of cuBLAS (``F.linear``):
  products of at most DENSE_MAX_ROWS rows on Hopper, with the tiles brought in by TMA (past
  ONE_TILE_ROWS rows, in row tiles). The model's layers ask for it only inside
  ``for_graphs()`` (the runner's CUDA-graph warm-up and capture): eagerly, its launch costs the
  host several times cuBLAS's.

On Hopper the kernel launches as a programmatic dependent of the kernel before it
(engine_core/triton_pdl.py): it asks L2 for the start of its weights, which do not depend on that
kernel, while that kernel finishes, then waits for the activations. In a decode layer every
projection follows a chain kernel that lets it start early (a norm, the attention, SiLU-and-mul),
and it lets the chain kernel after it start early in turn.

Everything is CUDA-graph safe: launches depend only on shapes and the operands' alignment, which a
graph's static buffers keep. Importing this module imports triton: only CUDA branches may.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engine_core.models.gate_up_layout import GLU_HALF
from engine_core.models.triton_ops import argmax_of_parts, silu_mul
from engine_core.triton_pdl import (
    chain_pdl,
    hopper_or_later,
    pdl_wait_then_release,
    prefetch_l2,
)


@triton.jit
def _skinny_epilogue(
    acc,
    C,
    AScale,
    WScale,
    Bias,
    Part,
    ArgBest,
    ArgAt,
    argmax_cols,
    pid_m,
    pid_n,
    split,
    M,
    N,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    GLU: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    """Scale the [BLOCK_N, BLOCK_M] tile of C.T (FP8 operands: SCALED) and write it: to C with
    SPLIT_K == 1, else to Part[split] as float32 for _skinny_reduce_kernel to sum. With GLU the
    tile's first half of weight rows are gate rows and its second half their up rows
    (interleave_gate_up): it writes silu(gate) * up, [BLOCK_N / 2, BLOCK_M] of C [M, N / 2].
    With ARGMAX (SPLIT_K == 1) it also writes each row's argmax over the tile's columns under
    argmax_cols to ArgBest/ArgAt (_tile_argmax)."""
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    if SCALED:
        w_s = tl.load(WScale + rn, mask=n_mask, other=0.0)
        a_s = tl.load(AScale + rm, mask=m_mask, other=0.0)
        acc = acc * w_s[:, None] * a_s[None, :]
    mask = n_mask[:, None] & m_mask[None, :]
    if GLU:
        # Rounded to C's dtype first, as the separate product would be before SiLU-and-mul.
        pair = tl.reshape(acc.to(C.dtype.element_ty).to(tl.float32), (2, BLOCK_N // 2, BLOCK_M))
        gate, up = tl.split(tl.permute(pair, (1, 2, 0)))
        rh = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        h_mask = (rh < N // 2)[:, None] & m_mask[None, :]
        h_ptrs = C + rm[None, :].to(tl.int64) * stride_cm + rh[:, None]
        tl.store(h_ptrs, silu_mul(gate, up).to(C.dtype.element_ty), mask=h_mask)
    elif SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        c_ptrs = C + rm[None, :].to(tl.int64) * stride_cm + rn[:, None]
        tile = acc.to(C.dtype.element_ty)
        tl.store(c_ptrs, tile, mask=mask)
        if ARGMAX:
            _tile_argmax(tile, rn, rm, m_mask, pid_n, ArgBest, ArgAt, argmax_cols, BLOCK_N)
    else:
        p_ptrs = Part + (split * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(p_ptrs, acc, mask=mask)


@dataclass(frozen=True)
class TileArgmax:
    """Where the skinny GEMM's epilogue writes, for each row of C and each weight tile, the
    largest of the tile's columns under ``n_cols`` and the first column holding it
    (triton_ops.argmax_of_parts then picks each row's answer)."""

    best: torch.Tensor  # [M, N tiles] float32
    at: torch.Tensor  # [M, N tiles] int32
    n_cols: int

    @classmethod
    def allocate(cls, rows: int, n_tiles: int, n_cols: int, device: torch.device) -> TileArgmax:
        return cls(
            torch.empty((rows, n_tiles), dtype=torch.float32, device=device),
            torch.empty((rows, n_tiles), dtype=torch.int32, device=device),
            n_cols,
        )

    def check(self, rows: int, n: int, block_n: int, fits: bool) -> None:
        """Refuse what the epilogue cannot write: a product of ``rows`` x ``n`` in weight
        tiles of ``block_n``, in one split without GLU where ``fits``."""
        if not fits:
            raise ValueError("the skinny GEMM's argmax epilogue takes one split and no GLU")
        n_tiles = triton.cdiv(n, block_n)
        for t, dtype in ((self.best, torch.float32), (self.at, torch.int32)):
            if t.shape != (rows, n_tiles) or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"the tile argmax needs contiguous [{rows}, {n_tiles}] {dtype} "
                                 f"parts, got {tuple(t.shape)} {t.dtype}")  # fmt: skip
        if not 0 < self.n_cols <= n:
            raise ValueError(f"the tile argmax takes 1 to {n} columns, got {self.n_cols}")


@triton.jit
def _tile_argmax(tile, rn, rm, m_mask, pid_n, Best, At, n_cols, BLOCK_N: tl.constexpr):
    """For each row of the [BLOCK_N, BLOCK_M] tile of C.T (C's values as stored, rounded), the
    largest of its columns under n_cols and the first column holding it, into Best and At
    [M, N tiles] at the tile's column: what triton_ops.argmax_of_parts reduces per row. NaN counts
    as +inf, as in triton_ops.row_argmax; a tile past n_cols gives -inf at its first column."""
    vals = tile.to(tl.float32)
    vals = tl.where(vals != vals, float("inf"), vals)
    vals = tl.where((rn < n_cols)[:, None], vals, float("-inf"))
    best, at = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    slot = rm.to(tl.int64) * tl.num_programs(1) + pid_n
    tl.store(Best + slot, best, mask=m_mask)
    tl.store(At + slot, pid_n * BLOCK_N + at, mask=m_mask)


@dataclass(frozen=True)
class NormOut:
    """What a product writes beside its output for the RMSNorm after it (the first half of
    decode_norm_between): its output becomes the residual stream, output + ``residual``."""

    residual: torch.Tensor  # [M, N], the output's dtype, unit column stride
    weight: torch.Tensor  # [N], the norm's
    scaled: torch.Tensor  # [M, N] written: the stream times the norm's weight
    parts: torch.Tensor  # [N tiles, M] float32 written: each row's sum of squares per tile

    def check(self, m: int, n: int, n_tiles: int, dtype: torch.dtype) -> None:
        """Refuse what the epilogue cannot read or write for an [m, n] output of ``dtype``."""
        for name, t in (("residual", self.residual), ("scaled", self.scaled)):
            if t.shape != (m, n) or t.dtype != dtype or t.stride(1) != 1:
                raise ValueError(f"the norm epilogue's {name} must be [{m}, {n}] {dtype} rows, "
                                 f"got {tuple(t.shape)} {t.dtype}")  # fmt: skip
        if self.weight.shape != (n,):
            raise ValueError(f"the norm epilogue's weight must be [{n}], got "
                             f"{tuple(self.weight.shape)}")  # fmt: skip
        _check_parts(self.parts, n_tiles, m)


@dataclass(frozen=True)
class NormIn:
    """The second half of decode_norm_between: the product's A is a NormOut's ``scaled`` and
    each row of its result is multiplied by the row's 1 / RMS, from the NormOut's ``parts``."""

    parts: torch.Tensor  # [P, M] float32
    eps: float

    def check(self, m: int) -> None:
        _check_parts(self.parts, self.parts.shape[0], m)


def _check_parts(parts: torch.Tensor, n_parts: int, m: int) -> None:
    if parts.shape != (n_parts, m) or parts.dtype != torch.float32 or not parts.is_contiguous():
        raise ValueError(f"the norm's sums of squares must be contiguous [{n_parts}, {m}] "
                         f"float32, got {tuple(parts.shape)} {parts.dtype}")  # fmt: skip


# M (the step's rows) stays a runtime value: specialized, each row-count class (1, a multiple of 16,
# other) would compile its own variant the first time an eager step has it, mid-serving. The row
# tile BLOCK_M is a power of two from 16 to SKINNY_MOST_ROWS, compiled when the CUDA graphs are.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    A,
    W,
    C,
    AScale,
    WScale,
    Bias,
    Part,
    ArgBest,
    ArgAt,
    argmax_cols,
    M,
    N,
    stride_am,
    stride_wn,
    stride_cm,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    GLU: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    """Program (row tile, n tile, k split): the [BLOCK_N, BLOCK_M] tile of C.T over one K slice, as
    W_tile @ A.T, so the weights' rows fill the matrix unit's M side and the few tokens its N
    side ("swap AB"). With SPLIT_K == 1 it writes C; otherwise its scaled fp32 partial goes to
    Part[split] and _skinny_reduce_kernel sums them."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        w = tl.load(w_ptrs, mask=(rn < N)[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
        a = tl.load(a_ptrs, mask=(rm < M)[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        # Each tile's product is added to acc in float32 rather than accumulated into it: on
        # Hopper an FP8 dot's own accumulator keeps fewer bits (Triton's default there), so
        # over a long K the error would grow; per tile it stays that of one BLOCK_K product.
        acc += tl.dot(w, tl.trans(a))
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    _skinny_epilogue(acc, C, AScale, WScale, Bias, Part, ArgBest, ArgAt, argmax_cols, pid_m,
                     pid_n, split, M, N, stride_cm, BLOCK_M, BLOCK_N, SPLIT_K, HAS_BIAS, SCALED,
                     GLU, ARGMAX)  # fmt: skip


@triton.jit
def _row_inverse_norms(InParts, in_parts, M, rm, m_mask, n_cols, eps, IN_PARTS: tl.constexpr):
    """Each row's 1 / RMS from the sums of squares that a NORM_OUT product left per weight tile
    (InParts [in_parts, M] float32), summed in a fixed order: [BLOCK_M] float32."""
    rp = tl.arange(0, IN_PARTS)
    mask = (rp < in_parts)[:, None] & m_mask[None, :]
    parts = tl.load(InParts + rp[:, None] * M + rm[None, :], mask=mask, other=0.0)
    return tl.rsqrt(tl.sum(parts, 0) / n_cols + eps)


@triton.jit
def _norm_out_epilogue(acc, C, Bias, Residual, NormW, Scaled, OutParts, rn, rm, n_mask, m_mask,
                       pid_n, M, stride_cm, stride_rm, stride_sm,
                       HAS_BIAS: tl.constexpr):  # fmt: skip
    """The NORM_OUT product's epilogue, over its [BLOCK_N, BLOCK_M] tile of C.T: C gets the
    residual stream h = product (+ bias) + residual, each sum rounded as the norm kernel rounds
    it (triton_ops._rms_norm_kernel); Scaled gets h * the norm's weight, rounded; OutParts
    [pid_n] each row's sum of h squared over the tile's columns (float32), from which the
    consumer takes the rows' norms (_row_inverse_norms)."""
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ty = C.dtype.element_ty
    mask = n_mask[:, None] & m_mask[None, :]
    rows = rm[None, :].to(tl.int64)
    residual = tl.load(Residual + rows * stride_rm + rn[:, None], mask=mask, other=0.0)
    h = (acc.to(out_ty).to(tl.float32) + residual.to(tl.float32)).to(out_ty)
    tl.store(C + rows * stride_cm + rn[:, None], h, mask=mask)
    hf = h.to(tl.float32)
    norm_w = tl.load(NormW + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Scaled + rows * stride_sm + rn[:, None], (hf * norm_w[:, None]).to(out_ty), mask=mask)
    tl.store(OutParts + pid_n * M + rm, tl.sum(hf * hf, 0), mask=m_mask)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_tma_kernel(
    a_desc,
    w_desc,
    W,
    stride_wn,
    C,
    AScale,
    WScale,
    Bias,
    Part,
    ArgBest,
    ArgAt,
    argmax_cols,
    M,
    N,
    stride_cm,
    K_PER_SPLIT,
    Residual,
    NormW,
    Scaled,
    OutParts,
    InParts,
    in_parts,
    eps,
    stride_rm,
    stride_sm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    GLU: tl.constexpr,
    ARGMAX: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,  # weight elements per 128-byte line
    RELEASE: tl.constexpr,
    NORM_OUT: tl.constexpr,
    NORM_IN: tl.constexpr,
    IN_PARTS: tl.constexpr,
):
    """_skinny_gemm_kernel with both operands' tiles brought in by the tensor memory
    accelerator (Hopper's bulk copies; rows past M or N read as zeros) instead of per-thread
    loads (measured: 3.6% less time over llama-8b's four projections at 64 rows).

    With PDL (launched as a programmatic dependent of the kernel before it, which lets it start
    early) the program first asks L2 for its weights' first PREFETCH_K columns, which do not
    depend on that kernel, and only then waits for the kernel's outputs (the activations). With
    RELEASE it then lets the kernel after it become resident (a chain kernel, which waits in turn
    for this one to complete: engine_core/triton_pdl.py).

    NORM_OUT and NORM_IN split an RMSNorm between two products (decode_norm_between):
    the first adds the residual to its output, writes it scaled by the norm's weight and each
    row's sum of squares per weight tile (_norm_out_epilogue); the second, reading that scaled
    output as its A, multiplies each row of its product by the row's 1 / RMS
    (_row_inverse_norms). The norm then costs no launch of its own."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    off_n = pid_n * BLOCK_N
    k_start = split * K_PER_SPLIT
    if PDL:
        if PREFETCH_K >= LINE:
            rn = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1)
            lines = k_start + tl.arange(0, PREFETCH_K // LINE) * LINE
            prefetch_l2(W + rn[:, None].to(tl.int64) * stride_wn + lines[None, :])
        tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()
    rn = off_n + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, m_mask = rn < N, rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        w = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
        a = a_desc.load([pid_m * BLOCK_M, k])  # [BLOCK_M, BLOCK_K]
        acc += tl.dot(w, tl.trans(a))  # float32 per tile, as in _skinny_gemm_kernel
    # What the norm halves read beside the operands is read after the product: read before it,
    # it held registers across the product's loop, and smollm2's and llama-1b's decode graphs
    # ran 21 and about 50 us slower than with the loads here (docs/design/kernels-and-limits.md,
    # "The post-attention RMSNorm split").
    if NORM_IN:
        inv = _row_inverse_norms(InParts, in_parts, M, rm, m_mask, K_PER_SPLIT, eps, IN_PARTS)
        acc = acc * inv[None, :]
    if NORM_OUT:
        _norm_out_epilogue(acc, C, Bias, Residual, NormW, Scaled, OutParts, rn, rm, n_mask,
                           m_mask, pid_n, M, stride_cm, stride_rm, stride_sm,
                           HAS_BIAS)  # fmt: skip
    else:
        _skinny_epilogue(acc, C, AScale, WScale, Bias, Part, ArgBest, ArgAt, argmax_cols,
                         pid_m, pid_n, split, M, N, stride_cm, BLOCK_M, BLOCK_N, SPLIT_K,
                         HAS_BIAS, SCALED, GLU, ARGMAX)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _skinny_reduce_kernel(
    Part,
    C,
    Bias,
    M,
    N,
    stride_cm,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    """C[m, n tile] = sum over splits of Part[split, m, n tile] (+ bias). With PDL a link of the
    decode chain (engine_core/triton_pdl.py): resident while the GEMM's programs finish, and
    letting the kernel after it start early in turn."""
    pdl_wait_then_release(PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(Part + (split * M + m).to(tl.int64) * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + m.to(tl.int64) * stride_cm + rn, acc.to(C.dtype.element_ty), mask=mask)


# The skinny GEMM with TMA starts as a programmatic dependent of the kernel before it (the norm or
# quantizer that writes its activations), prefetching this many bytes of each of its weight rows
# into L2 while that kernel finishes, and once its activations are in, lets the kernel after it
# become resident. A llama-8b FP8 decode layer's launches at 64 rows without attention: 107.0 us
# without PDL, 104.8 with it and no prefetch, 103.6 prefetching 512 bytes, 105.3 with 1024, 112.9
# with 2048; in bf16 512 bytes was best or even on smollm2, llama-1b and llama-8b. Letting the
# next kernel start early took a bf16 layer at 64 rows from 175.8 to 168.1 us on llama-8b, 62.1
# to 60.7 on llama-1b, 20.5 to 19.0 on smollm2 (docs/design/kernels-and-limits.md, "The skinny
# GEMM").
SKINNY_MOST_ROWS = 256  # the most rows one tile holds: its float32 accumulator is in registers
SKINNY_PREFETCH_BYTES = 512


def _prefetch_columns(k_per_split: int, line: int) -> int:
    """A power of two of 128-byte lines (``line`` elements each), at most SKINNY_PREFETCH_BYTES
    and no more than the program's K range; 0 (no prefetch) under one line."""
    columns = min(SKINNY_PREFETCH_BYTES // (128 // line), k_per_split)
    return 1 << (columns.bit_length() - 1) if columns >= line else 0


def _skinny_stages(n_tiles: int, tma: bool) -> int:
    """The most pipeline stages worth having, as measured at 64 rows over llama-8b's projections
    (docs/design/kernels-and-limits.md, "The skinny GEMM"): with 256 N tiles or more (gate_up's
    448) 3 stages, more programs fitting on each multiprocessor; with fewer, deeper pipelines: 5
    for per-thread loads; with TMA 4 at qkv's 96 tiles, 6 at o's and down's 64."""
    if n_tiles >= 256:
        return 3
    if not tma:
        return 5
    return 4 if n_tiles >= 96 else 6


def tma_loads_fit(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the skinny GEMM can load both operands by TMA: a Hopper (or later) GPU, 16-byte
    aligned base addresses and row strides (TMA's rules), unit stride along K."""
    if not hopper_or_later(a.device):
        return False
    return all(
        t.data_ptr() % 16 == 0
        and t.stride(0) > 0
        and t.stride(0) * t.element_size() % 16 == 0
        and t.stride(1) == 1
        for t in (a, w)
    )


def _pipeline_stages(device: torch.device, stage_bytes: int, most: int = 5) -> int:
    """Pipeline stages of stage_bytes each that fit the device's shared memory (at least 2)."""
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
    return max(2, min(most, (shared - 8 * 1024) // stage_bytes))


def skinny_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 64,
    block_k: int = 256,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int | None = None,
    tma: bool | None = None,
    glu: bool = False,
    block_m: int | None = None,
    out: torch.Tensor | None = None,
    tile_argmax: TileArgmax | None = None,
    norm_out: NormOut | None = None,
    norm_in: NormIn | None = None,
) -> torch.Tensor:
    """a [M, K] @ w [N, K].T (+ bias) -> [M, N] out_dtype, the rows in tiles of ``block_m`` (a
    power of two from 16; default: all M <= SKINNY_MOST_ROWS rows in one tile). FP8 operands
    come with their scales, a_scale [M] (or [M, 1]) and w_scale [N], that multiply the product;
    bf16/fp16 ones with none. ``tma`` (default: where the device and the operands allow it)
    loads the tiles through the tensor memory accelerator; ``num_stages`` defaults to the
    measured best that the shared memory holds. ``glu``: w is a gate/up projection's weight as
    interleave_gate_up arranges it, and the result is silu(gate) * up, [M, N / 2] (block_n
    2 * GLU_HALF, one split, no bias, no scales). ``out``: where to write the result (rows of
    unit column stride), else a new tensor. ``tile_argmax``: the epilogue also writes each
    row's argmax over each weight tile's columns there (one split, no GLU). ``norm_out`` and
    ``norm_in``: the two halves of an RMSNorm between two products (decode_norm_between; TMA,
    one split, no scales; norm_out without GLU or argmax)."""
    m, k = a.shape
    n = w.shape[0]
    if block_m is None and m > SKINNY_MOST_ROWS:
        raise ValueError(f"the skinny GEMM takes at most {SKINNY_MOST_ROWS} rows, got {m}")
    if k % (block_k * split_k):
        raise ValueError(f"skinny GEMM: K={k} is not a multiple of block_k * split_k")
    scaled = a_scale is not None
    if scaled != (w_scale is not None):
        raise ValueError("skinny GEMM: give both operands' scales (FP8) or neither")
    glu_fits = block_n == 2 * GLU_HALF and split_k == 1 and n % block_n == 0
    if glu and (not glu_fits or bias is not None or scaled):
        raise ValueError("the skinny GEMM's SiLU-and-mul epilogue takes block_n 2 * GLU_HALF, "
                         "whole tiles of N, one split, no bias and no scales")  # fmt: skip
    if tile_argmax is not None:
        tile_argmax.check(m, n, block_n, split_k == 1 and not glu)
    shape = (m, n // 2 if glu else n)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=a.device)
    elif out.shape != shape or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"skinny GEMM: out must be {shape} {out_dtype} rows, got "
                         f"{tuple(out.shape)} {out.dtype}")  # fmt: skip
    if m == 0:
        return out
    if block_m is None:
        block_m = max(16, triton.next_power_of_2(m))
    if tma is None:
        tma = tma_loads_fit(a, w)
    if norm_out is not None or norm_in is not None:
        first_half_fits = norm_out is None or (not glu and tile_argmax is None)
        if not (tma and split_k == 1 and not scaled and first_half_fits):
            raise ValueError("the skinny GEMM's norm halves take TMA loads, one split and no "
                             "scales, and the first half no GLU or argmax")  # fmt: skip
        if norm_out is not None:
            norm_out.check(m, n, triton.cdiv(n, block_n), out_dtype)
        if norm_in is not None:
            norm_in.check(m)
    if num_stages is None:
        most = _skinny_stages(triton.cdiv(n, block_n), tma)
        stage_bytes = (block_m + block_n) * block_k * a.element_size()
        num_stages = _pipeline_stages(a.device, stage_bytes, most)
    part = out
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
    if scaled:
        a_scale = a_scale.reshape(-1).float().contiguous()  # a static scale comes expanded
    else:
        a_scale = w_scale = out  # never read
    bias_arg = bias if bias is not None else out
    best, at, argmax_cols = (
        (out, out, 0)
        if tile_argmax is None
        else (tile_argmax.best, tile_argmax.at, tile_argmax.n_cols)
    )
    # Row tiles vary fastest: the programs of one weight tile run together and share its reads.
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                HAS_BIAS=bias is not None, SCALED=scaled, GLU=glu,
                ARGMAX=tile_argmax is not None, num_warps=num_warps,
                num_stages=num_stages)  # fmt: skip
    if tma:
        a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
        pdl = chain_pdl(a)
        line = 128 // w.element_size()
        _skinny_gemm_tma_kernel[grid](
            a_desc, w_desc, w, w.stride(0), out, a_scale, w_scale, bias_arg, part, best, at,
            argmax_cols, m, n, out.stride(0), k // split_k, *_norm_arguments(out, norm_out,
            norm_in), **meta, PDL=pdl, PREFETCH_K=_prefetch_columns(k // split_k, line),
            LINE=line, RELEASE=pdl, NORM_OUT=norm_out is not None,
            NORM_IN=norm_in is not None,
            IN_PARTS=triton.next_power_of_2(norm_in.parts.shape[0]) if norm_in else 1,
            launch_pdl=pdl,
        )  # fmt: skip
    else:
        _skinny_gemm_kernel[grid](
            a, w, out, a_scale, w_scale, bias_arg, part, best, at, argmax_cols, m, n,
            a.stride(0), w.stride(0), out.stride(0), k // split_k, **meta,
        )  # fmt: skip
    if split_k > 1:
        _reduce_splits(part, out, bias)
    return out


def _norm_arguments(
    out: torch.Tensor, norm_out: NormOut | None, norm_in: NormIn | None
) -> tuple[object, ...]:
    """The TMA kernel's Residual, NormW, Scaled, OutParts, InParts, in_parts, eps and the
    residual's and scaled's row strides (``out``, never read, in place of what is absent)."""
    residual = weight = scaled = out_parts = in_parts = out
    n_parts, eps, stride_r, stride_s = 0, 0.0, out.stride(0), out.stride(0)
    if norm_out is not None:
        residual, weight, scaled, out_parts = (
            norm_out.residual, norm_out.weight, norm_out.scaled, norm_out.parts,
        )  # fmt: skip
        stride_r, stride_s = residual.stride(0), scaled.stride(0)
    if norm_in is not None:
        in_parts, n_parts, eps = norm_in.parts, norm_in.parts.shape[0], norm_in.eps
    return residual, weight, scaled, out_parts, in_parts, n_parts, eps, stride_r, stride_s


def _reduce_splits(part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = the sum of the split-K partials part [splits, M, N] (+ bias), as a link of the
    decode chain where the GEMM's operands are on Hopper, so the chain has no plain launch in
    it (as a plain launch it measured no faster: docs/design/kernels-and-limits.md, "The skinny
    GEMM")."""
    splits, m, n = part.shape
    block = 1024
    pdl = chain_pdl(part)
    _skinny_reduce_kernel[(m, triton.cdiv(n, block))](
        part,
        out,
        bias if bias is not None else out,
        m,
        n,
        out.stride(0),
        SPLIT_K=splits,
        BLOCK=block,
        HAS_BIAS=bias is not None,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=4,
    )


# Plain (bf16/fp16) weights take the skinny GEMM instead of cuBLAS up to this many rows, on Hopper,
# where every projection of a decode layer then starts early under the chain kernel before it and
# lets the one after it start early. A decode layer's launches in one CUDA graph at 64 rows:
# smollm2-135m 25.7 -> 19.0 us, llama-1b 68.4 -> 60.8, llama-8b 182.5 -> 168.1. Past
# ONE_TILE_ROWS the rows go in tiles of ONE_TILE_ROWS, the programs of one weight tile side by
# side, for weights with a side of at most TILED_ROWS_MAX_SIDE (every projection of a model of
# hidden size 2,048 or less). In the engine at decode-128 that took smollm2's ITL from 1.35-1.37
# to 1.15-1.25 ms and llama-1b's from 1.79-1.81 to 1.67-1.68. llama-8b's projections keep cuBLAS
# there: in row tiles its ITL went from 8.14-8.18 to 8.63 ms, and with only its down projection
# so, to 8.19-8.20. At 256 rows cuBLAS was faster for llama-1b's and llama-8b's layers, so larger
# products keep it (docs/design/kernels-and-limits.md, "The skinny GEMM").
DENSE_MAX_ROWS = 128
DENSE_BLOCK_N = 64  # weight rows a program takes (dense_tiles)
ONE_TILE_ROWS = 64
TILED_ROWS_MAX_SIDE = 2048
# Up to 64 rows, products over a K this short (smollm2's 576 and 1,536) go in 16-row tiles where
# the weight has few tiles (dense_row_tile: smollm2's projections, not its LM head).
SHORT_K = 1536
SHORT_K_ROW_TILE = 16
LONG_K = 8192  # dense_tiles splits the K range of products this long
# The model's layers take it only for CUDA graphs (for_graphs), where its launch is recorded once.
# Eagerly its Python launch path (descriptors, PDL attributes) costs the host 86-168 us a call
# against cuBLAS's 16-24 us at 64 rows, and an eager smollm2 decode step makes 120 such calls
# (docs/design/cuda-graphs-and-warm-up.md, "Tried and dropped").
_for_graphs = False


@contextlib.contextmanager
def for_graphs() -> Iterator[None]:
    """Within this block the layers' decode-sized plain products and gate/up epilogues take the
    skinny GEMM (``graphed``): the model runner's warm-up and capture of each CUDA graph."""
    global _for_graphs
    previous, _for_graphs = _for_graphs, True
    try:
        yield
    finally:
        _for_graphs = previous


def graphed() -> bool:
    """Whether the products being launched are for a CUDA graph (``for_graphs``)."""
    return _for_graphs


def decode_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    norm_out: NormOut | None = None,
    norm_in: NormIn | None = None,
) -> torch.Tensor | None:
    """x [M, K] @ w.T (+ bias) by the skinny GEMM where it is the plain-weight path
    (takes_plain_product), into ``out`` if given; None where cuBLAS should run it. ``norm_out``
    and ``norm_in``: a half of a norm between two products (decode_norm_between)."""
    if not takes_plain_product(x, w):
        return None
    tiles = dense_tiles(w.shape[0], w.shape[1], x.device)
    block_m = dense_row_tile(x.shape[0], w.shape[0], w.shape[1], x.device)
    return skinny_gemm(x, w, x.dtype, bias=bias, block_m=block_m, out=out, norm_out=norm_out,
                       norm_in=norm_in, **tiles)  # fmt: skip


def decode_linear_argmax(
    x: torch.Tensor, w: torch.Tensor, n_cols: int, out: torch.Tensor, argmax: torch.Tensor
) -> bool:
    """out = x [M, K] @ w.T as decode_linear computes it, and argmax [M] int64 the first
    column under ``n_cols`` holding each row's largest value of out (NaN as +inf, as
    triton_ops.row_argmax): the product's epilogue takes each weight tile's best, one small
    launch each row's. False (nothing written) where decode_linear would leave the product to
    cuBLAS or split its K."""
    if not takes_plain_product(x, w):
        return False
    tiles = dense_tiles(w.shape[0], w.shape[1], x.device)
    if tiles["split_k"] != 1:
        return False
    rows, n_tiles = x.shape[0], triton.cdiv(w.shape[0], tiles["block_n"])
    parts = TileArgmax.allocate(rows, n_tiles, n_cols, x.device)
    block_m = dense_row_tile(rows, w.shape[0], w.shape[1], x.device)
    skinny_gemm(x, w, x.dtype, block_m=block_m, out=out, tile_argmax=parts, **tiles)
    argmax_of_parts(parts.best, parts.at, argmax)
    return True


def dense_row_tile(m: int, n: int, k: int, device: torch.device) -> int | None:
    """The row tile of a plain product of m rows by an [N, K] = [n, k] weight: all in one up to
    ONE_TILE_ROWS (None), in tiles of SHORT_K_ROW_TILE rows there for a short K (SHORT_K or
    less) whose weight tiles (DENSE_BLOCK_N rows) are fewer than the multiprocessors, and in
    tiles of ONE_TILE_ROWS past it (its float32 accumulator has to fit the registers).

    A short product's few weight tiles (smollm2's o projection: 9) leave most multiprocessors
    idle; 16-row tiles put four programs on each. smollm2's decode layer at 64 rows took 17.0 us
    instead of 17.85, its decode-64 ITL 0.97-0.98 ms instead of 0.99; llama-1b's layer (K 2,048
    and 8,192) gained nothing (58.2 against 58.4). At 128 rows 16-row tiles were slower for
    smollm2 (ITL 1.20-1.24 against 1.15-1.18 ms). A wide weight fills the GPU anyway: smollm2's
    LM head (768 weight tiles) took 36.5 us in 16-row tiles, 25.7 in one
    (docs/design/kernels-and-limits.md, "The skinny GEMM")."""
    if m > ONE_TILE_ROWS:
        return ONE_TILE_ROWS
    few_tiles = triton.cdiv(n, DENSE_BLOCK_N) < _multiprocessors(device)
    return SHORT_K_ROW_TILE if k <= SHORT_K and few_tiles else None


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def takes_plain_product(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the skinny GEMM runs x [M, K] @ w.T for a plain weight: at most DENSE_MAX_ROWS
    rows of bf16/fp16 (past ONE_TILE_ROWS, only for a weight with a side of at most
    TILED_ROWS_MAX_SIDE), K whole 64-column tiles, both operands loadable by TMA (on Hopper)."""
    if x.dim() != 2 or not 0 < x.shape[0] <= DENSE_MAX_ROWS:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if x.shape[0] > ONE_TILE_ROWS and min(w.shape) > TILED_ROWS_MAX_SIDE:
        return False
    return w.shape[1] % 64 == 0 and tma_loads_fit(x, w)


@functools.cache
def dense_tiles(n: int, k: int, device: torch.device) -> dict[str, int]:
    """The launch shape for a plain [N, K] weight, as measured at 64 rows: 64-row weight tiles
    and 128-column K tiles (64 where K is not a multiple of 128: smollm2's 576); two K splits
    over a long K (LONG_K or more: the down projections) where the multiprocessors hold a
    program of each split.

    Measured inside a decode layer's chain (docs/design/kernels-and-limits.md, "The skinny GEMM" and
    "Tried and dropped"): llama-8b's down projection (64 N tiles) took 174.1 us a layer unsplit and
    166.6 in two splits on one machine (166.3 and 165.7 on another), and its decode-64 ITL went from
    6.83 to 6.50 ms on the first, 6.55 to 6.46 on a third. Four splits were slower for llama-8b
    (169.1 us). For llama-1b's (32 N tiles) the chain gained 2 us a layer from two splits to four,
    but the engine's ITL did not move and four of six runs had stretches of steps four times as
    long, which no run with two had. Shorter K ranges are not split: alone, two splits were slower
    for qkv, while llama-1b's o and smollm2's down were 5-7% faster in two to four (with the
    reduction kernel); in the engine, splitting every K from 1,536 gained nothing (llama-1b's
    decode-64 ITL 1.35-1.37 -> 1.38-1.41 ms)."""
    block_n = DENSE_BLOCK_N
    block_k = 128 if k % 128 == 0 else 64
    n_tiles = triton.cdiv(n, block_n)
    room = n_tiles * 2 <= _multiprocessors(device)
    split_k = 2 if room and k >= LONG_K and k % (2 * block_k) == 0 else 1
    return {"block_n": block_n, "block_k": block_k, "split_k": split_k}


def decode_glu(
    x: torch.Tensor, w: torch.Tensor, norm_in: NormIn | None = None
) -> torch.Tensor | None:
    """silu(gate) * up [M, N / 2] of x [M, K] and an interleaved gate/up weight w [N, K], by the
    skinny GEMM's epilogue where decode_linear would take the product; None elsewhere.
    ``norm_in``: the second half of a norm between two products (decode_norm_between)."""
    if not takes_plain_product(x, w):
        return None
    block_k = dense_tiles(w.shape[0], w.shape[1], x.device)["block_k"]
    block_m = dense_row_tile(x.shape[0], w.shape[0], w.shape[1], x.device)
    return skinny_gemm(x, w, x.dtype, block_n=2 * GLU_HALF, block_k=block_k, glu=True,
                       block_m=block_m, norm_in=norm_in)  # fmt: skip


# A decode layer's post-attention RMSNorm rides in the launches of its o and gate/up products
# (decode_norm_between) where o is short (K at most NORM_BETWEEN_MAX_K). At decode-64
# smollm2's decode graph took 776.2 us instead of 794.9 this way. With o's K of 2,048 or more
# the split did not pay (llama-1b's and llama-8b's graphs within 0.3% either way), so longer
# products keep the norm's own launch. Splitting the input norm between down and the next
# layer's qkv the same way gained smollm2 nothing more; it is not done
# (docs/design/kernels-and-limits.md, "The post-attention RMSNorm split").
NORM_BETWEEN_MAX_K = SHORT_K


def norm_between_takes(x: torch.Tensor, first: torch.Tensor) -> bool:
    """Whether decode_norm_between takes ``first`` as its first product of ``x``: a short one
    (K at most NORM_BETWEEN_MAX_K) that decode_linear would run in one split."""
    if not takes_plain_product(x, first):
        return False
    n, k = first.shape
    return k <= NORM_BETWEEN_MAX_K and dense_tiles(n, k, x.device)["split_k"] == 1


def decode_norm_between(
    x: torch.Tensor,
    first: torch.Tensor,
    first_bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    second: torch.Tensor,
    second_bias: torch.Tensor | None = None,
    glu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, h) for h = x @ first.T (+ first_bias) + residual (the residual stream) and
    y = rms_norm(h, norm_weight, eps) @ second.T (+ second_bias), or with ``glu`` (no second
    bias) the SiLU-and-mul of that product through an interleaved gate/up weight ``second``:
    two launches, the norm split between them (NormOut, NormIn). The normalization moves past
    the second product (each row's 1 / RMS multiplies its result rather than its operand), so
    y differs from the separate norm's by the rounding of the operand. None where
    norm_between_takes does not take the first product, or decode_linear (decode_glu) would not
    take the second in one split."""
    if not norm_between_takes(x, first) or (glu and second_bias is not None):
        return None
    m, n = x.shape[0], first.shape[0]
    stream = torch.empty((m, n), dtype=x.dtype, device=x.device)
    scaled = torch.empty_like(stream)
    # Both products must be taken before the first runs: its output is only half a norm.
    if not takes_plain_product(scaled, second):
        return None
    if not glu and dense_tiles(second.shape[0], second.shape[1], x.device)["split_k"] != 1:
        return None
    n_tiles = triton.cdiv(n, dense_tiles(n, first.shape[1], x.device)["block_n"])
    parts = torch.empty((n_tiles, m), dtype=torch.float32, device=x.device)
    norm_out = NormOut(residual, norm_weight, scaled, parts)
    decode_linear(x, first, first_bias, out=stream, norm_out=norm_out)
    norm_in = NormIn(parts, eps)
    if glu:
        y = decode_glu(scaled, second, norm_in)
    else:
        y = decode_linear(scaled, second, second_bias, norm_in=norm_in)
    return y, stream
