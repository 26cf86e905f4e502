"""The GGUF products on CUDA: C = A @ W.T for activations A [M, K] and a weight held as the planes
of engine_core/models/gguf.py (codes, then fp16 d and, for Q4_1, m per 32-value block; Q4_K's d,
dmin and packed 6-bit scales and mins per 256-value super-block).

Two paths, by the rows of A (nothing tuned at run time: CUDA graphs replay what was captured):

- up to GEMV_ROWS rows (decode), ``_gguf_gemv_kernel`` on CUDA cores: reading the weight is the
  whole job. A program takes BLOCK_N weight rows and one row of A, and walks K BLOCKS blocks at
  a time: the codes as int32 words (a Q4 block is 4 words, a Q8_0 block 8), each byte of a word
  unpacked by shifts (Q8_0: sign-extended; Q4: low nibble value j, high nibble value j + 16). The
  product with A is summed per block, then scaled once per block: d * sum(q * a), less
  8 d * sum(a) for Q4_0, plus m * sum(a) for Q4_1. Q4_K has a kernel of its own
  (``_q4_k_gemv_kernel``): a program walks super-blocks, each as four 64-value chunks of 8 words
  (sub-block 2c in the low nibbles, 2c + 1 in the high ones), and scales each sub-block's sum
  once: d * sc * sum(q * a) - dmin * mn * sum(a), its 6-bit sc and mn unpacked from the 12
  bytes once per super-block. Q6_K's (``_q6_k_gemv_kernel``) walks 128-value halves of its
  super-blocks: low 4 bits from 16 words, high 2 bits from 8, each 16-value sub-block's sum
  times its int8 scale, each super-block's times d.
- from GEMV_ROWS + 1 rows (prefill), ``_gguf_dequantize_kernel`` writes W [N, K] in A's dtype
  (each value computed in float32 as gguf-py does, rounded once), then cuBLAS. The buffer is at
  most DEQUANTIZE_MAX_VALUES values and comes out of the activations' headroom, as W4A16's does
  (w4a16_kernels.py); a larger weight takes the GEMV at any row count.

tests/test_gguf_interpreted.py runs these kernels in Triton's interpreter on the CPU;
tests/test_gguf_gpu.py checks them on a GPU over the default model's shapes. Importing this
module imports triton: only CUDA code paths and GPU tests may do so (or set
``TRITON_INTERPRET=1`` first to run it on CPU tensors).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine_core.models.w4a16_kernels import DEQUANTIZE_MAX_VALUES

GEMV_ROWS = 16  # up to this many rows of A, the GEMV; more: dequantize, then cuBLAS
BLOCK_N = 16  # weight rows per GEMV program
BLOCKS = 4  # 32-value blocks per step of a program's walk along K
TYPE_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}  # the kernels' TYPE


K_BLOCKS = 2  # Q4_K super-blocks per step of a program's walk along K
HALVES = 2  # Q6_K's 128-value halves of super-blocks per step


class Planes(Protocol):
    """A run's planes as gguf.py ``Planes`` holds them."""

    type_name: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    scales: torch.Tensor | None
    high: torch.Tensor | None


@triton.jit
def _words(Codes, rows, blocks, ok, nb, WORDS: tl.constexpr):
    """The int32 code words [BLOCK_N, BLOCKS, WORDS] of ``rows``' ``blocks``."""
    w = tl.arange(0, WORDS)
    offsets = rows[:, None, None] * (nb * WORDS) + blocks[None, :, None] * WORDS + w[None, None, :]
    return tl.load(Codes + offsets, mask=ok[:, :, None], other=0)


@triton.jit
def _q8(words, i: tl.constexpr):
    """Byte i of each word as a signed value (the word's value 4w + i of its block)."""
    return ((words << (24 - 8 * i)) >> 24).to(tl.float32)


@triton.jit
def _nibbles(words, i: tl.constexpr):
    """Byte i of each word's low and high nibble (values 4w + i and 16 + 4w + i)."""
    byte = (words >> (8 * i)) & 0xFF
    return (byte & 0xF).to(tl.float32), (byte >> 4).to(tl.float32)


@triton.jit
def _gguf_gemv_kernel(
    X, Codes, D, Mins, Out, N, NB, STEPS, stride_x, stride_out,
    TYPE: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nb = NB  # blocks along K
    w = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in range(0, STEPS):
        blocks = step * BLOCKS + tl.arange(0, BLOCKS)
        block_ok = blocks < nb
        ok = (rows < N)[:, None] & block_ok[None, :]
        words = _words(Codes, rows, blocks, ok, nb, WORDS)
        x_at = X + row * stride_x + blocks[:, None] * 32 + w[None, :] * 4  # [BLOCKS, WORDS]
        x_ok = block_ok[:, None]
        dot = tl.zeros([BLOCK_N, BLOCKS], dtype=tl.float32)
        x_sum = tl.zeros([BLOCKS], dtype=tl.float32)
        for i in tl.static_range(4):
            x_low = tl.load(x_at + i, mask=x_ok, other=0.0).to(tl.float32)
            if TYPE == 0:
                dot += tl.sum(_q8(words, i) * x_low[None], axis=2)
            else:
                x_high = tl.load(x_at + 16 + i, mask=x_ok, other=0.0).to(tl.float32)
                low, high = _nibbles(words, i)
                dot += tl.sum(low * x_low[None] + high * x_high[None], axis=2)
                x_sum += tl.sum(x_low + x_high, axis=1)
        scale_at = rows[:, None] * nb + blocks[None, :]
        d = tl.load(D + scale_at, mask=ok, other=0.0).to(tl.float32)
        if TYPE == 1:
            dot -= 8.0 * x_sum[None, :]
        acc += tl.sum(d * dot, axis=1)
        if TYPE == 2:
            m = tl.load(Mins + scale_at, mask=ok, other=0.0).to(tl.float32)
            acc += tl.sum(m * x_sum[None, :], axis=1)
    tl.store(Out + row * stride_out + rows, acc.to(Out.dtype.element_ty), mask=rows < N)


@triton.jit
def _gguf_dequantize_kernel(
    Codes, D, Mins, W, N, NB,
    TYPE: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    nb = NB  # blocks along K
    ok = (rows < N)[:, None] & (blocks < nb)[None, :]
    words = _words(Codes, rows, blocks, ok, nb, WORDS)
    scale_at = rows[:, None] * nb + blocks[None, :]
    d = tl.load(D + scale_at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
    m = d
    if TYPE == 2:
        m = tl.load(Mins + scale_at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
    w = tl.arange(0, WORDS)
    at = W + rows[:, None, None] * (nb * 32) + blocks[None, :, None] * 32 + w[None, None, :] * 4
    ok = ok[:, :, None]
    dtype = W.dtype.element_ty
    for i in tl.static_range(4):
        if TYPE == 0:
            tl.store(at + i, (d * _q8(words, i)).to(dtype), mask=ok)
        else:
            low, high = _nibbles(words, i)
            if TYPE == 1:
                tl.store(at + i, (d * (low - 8.0)).to(dtype), mask=ok)
                tl.store(at + 16 + i, (d * (high - 8.0)).to(dtype), mask=ok)
            else:
                tl.store(at + i, (d * low + m).to(dtype), mask=ok)
                tl.store(at + 16 + i, (d * high + m).to(dtype), mask=ok)


@triton.jit
def _k_scale_and_min(Scales, at, ok, s: tl.constexpr):
    """Q4_K sub-block ``s``'s 6-bit scale and min [BLOCK_N, K_BLOCKS] from the super-blocks' 12
    bytes at ``at``: bytes 0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 mins 0-3
    (and the top bits of mins 4-7), 8-11 the low nibbles of scales 4-7 and mins 4-7."""
    if s < 4:
        scale = tl.load(Scales + at + s, mask=ok, other=0).to(tl.int32) & 63
        low_min = tl.load(Scales + at + s + 4, mask=ok, other=0).to(tl.int32) & 63
        return scale.to(tl.float32), low_min.to(tl.float32)
    low = tl.load(Scales + at + s + 4, mask=ok, other=0).to(tl.int32)
    high_scale = tl.load(Scales + at + s - 4, mask=ok, other=0).to(tl.int32) >> 6
    high_min = tl.load(Scales + at + s, mask=ok, other=0).to(tl.int32) >> 6
    scale = (low & 0xF) | (high_scale << 4)
    return scale.to(tl.float32), ((low >> 4) | (high_min << 4)).to(tl.float32)


@triton.jit
def _q4_k_gemv_kernel(
    X, Codes, D, Dmin, Scales, Out, N, NB, STEPS, stride_x, stride_out,
    BLOCK_N: tl.constexpr, K_BLOCKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in range(0, STEPS):
        blocks = step * K_BLOCKS + tl.arange(0, K_BLOCKS)  # super-blocks
        block_ok = blocks < NB
        ok = (rows < N)[:, None] & block_ok[None, :]
        scale_at = rows[:, None] * NB + blocks[None, :]
        d = tl.load(D + scale_at, mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load(Dmin + scale_at, mask=ok, other=0.0).to(tl.float32)
        for c in tl.static_range(4):  # 64-value chunk c: sub-blocks 2c (low), 2c + 1 (high)
            chunk = blocks * 4 + c  # 32-byte chunks along the row: 8 words each
            words = _words(Codes, rows, chunk, ok, NB * 4, 8)
            x_at = X + row * stride_x + chunk[:, None] * 64 + w[None, :] * 4  # [K_BLOCKS, 8]
            x_ok = block_ok[:, None]
            dot_low = tl.zeros([BLOCK_N, K_BLOCKS], dtype=tl.float32)
            dot_high = tl.zeros([BLOCK_N, K_BLOCKS], dtype=tl.float32)
            sum_low = tl.zeros([K_BLOCKS], dtype=tl.float32)
            sum_high = tl.zeros([K_BLOCKS], dtype=tl.float32)
            for i in tl.static_range(4):
                x_low = tl.load(x_at + i, mask=x_ok, other=0.0).to(tl.float32)
                x_high = tl.load(x_at + 32 + i, mask=x_ok, other=0.0).to(tl.float32)
                low, high = _nibbles(words, i)
                dot_low += tl.sum(low * x_low[None], axis=2)
                dot_high += tl.sum(high * x_high[None], axis=2)
                sum_low += tl.sum(x_low, axis=1)
                sum_high += tl.sum(x_high, axis=1)
            scale, mins = _k_scale_and_min(Scales, scale_at * 12, ok, 2 * c)
            acc += tl.sum(d * scale * dot_low - dmin * mins * sum_low[None, :], axis=1)
            scale, mins = _k_scale_and_min(Scales, scale_at * 12, ok, 2 * c + 1)
            acc += tl.sum(d * scale * dot_high - dmin * mins * sum_high[None, :], axis=1)
    tl.store(Out + row * stride_out + rows, acc.to(Out.dtype.element_ty), mask=rows < N)


@triton.jit
def _q4_k_dequantize_kernel(
    Codes, D, Dmin, Scales, W, N, NB, BLOCK_N: tl.constexpr, K_BLOCKS: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blocks = tl.program_id(1) * K_BLOCKS + tl.arange(0, K_BLOCKS)
    ok = (rows < N)[:, None] & (blocks < NB)[None, :]
    scale_at = rows[:, None] * NB + blocks[None, :]
    d = tl.load(D + scale_at, mask=ok, other=0.0).to(tl.float32)
    dmin = tl.load(Dmin + scale_at, mask=ok, other=0.0).to(tl.float32)
    w = tl.arange(0, 8)
    dtype = W.dtype.element_ty
    for c in tl.static_range(4):
        chunk = blocks * 4 + c
        words = _words(Codes, rows, chunk, ok, NB * 4, 8)
        at = W + rows[:, None, None] * (NB * 256) + chunk[None, :, None] * 64 + w[None, None, :] * 4
        scale, mins = _k_scale_and_min(Scales, scale_at * 12, ok, 2 * c)
        step_low, min_low = (d * scale)[:, :, None], (dmin * mins)[:, :, None]
        scale, mins = _k_scale_and_min(Scales, scale_at * 12, ok, 2 * c + 1)
        step_high, min_high = (d * scale)[:, :, None], (dmin * mins)[:, :, None]
        for i in tl.static_range(4):
            low, high = _nibbles(words, i)
            tl.store(at + i, (step_low * low - min_low).to(dtype), mask=ok[:, :, None])
            tl.store(at + 32 + i, (step_high * high - min_high).to(dtype), mask=ok[:, :, None])


@triton.jit
def _q6_k_values(low_words, high_words, g: tl.constexpr, i: tl.constexpr):
    """q - 32 of values 32g + 4w + i of a 128-value half: 4 bits from its low words (bytes 0-31
    for g = 0, 2, bytes 32-63 for g = 1, 3: the caller's choice), 2 from its high words."""
    low = (low_words >> (8 * i + 4 * (g // 2))) & 0xF
    high = (high_words >> (8 * i + 2 * g)) & 0x3
    return ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _q6_k_scales(Scales, rows, halves, ok, NH, g: tl.constexpr):
    """The int8 scales [BLOCK_N, HALVES, 8] of the sub-blocks of values 32g + 4w (w = 0..7)."""
    w = tl.arange(0, 8)
    at = rows[:, None, None] * (NH * 8) + halves[None, :, None] * 8 + 2 * g + w[None, None, :] // 4
    scales = tl.load(Scales + at, mask=ok[:, :, None], other=0)
    return scales.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _q6_k_gemv_kernel(
    X, Codes, High, Scales, D, Out, N, NH, STEPS, stride_x, stride_out,
    BLOCK_N: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in range(0, STEPS):
        halves = step * HALVES + tl.arange(0, HALVES)
        half_ok = halves < NH
        ok = (rows < N)[:, None] & half_ok[None, :]
        low_a = _words(Codes, rows, halves * 2, ok, NH * 2, 8)
        low_b = _words(Codes, rows, halves * 2 + 1, ok, NH * 2, 8)
        high = _words(High, rows, halves, ok, NH, 8)
        d = tl.load(D + rows[:, None] * (NH // 2) + halves[None, :] // 2, mask=ok, other=0.0)
        x_at = X + row * stride_x + halves[:, None] * 128 + w[None, :] * 4  # [HALVES, 8]
        x_ok = half_ok[:, None]
        total = tl.zeros([BLOCK_N, HALVES], dtype=tl.float32)
        for g in tl.static_range(4):
            low = low_a if g % 2 == 0 else low_b
            part = tl.zeros([BLOCK_N, HALVES, 8], dtype=tl.float32)
            for i in tl.static_range(4):
                x = tl.load(x_at + 32 * g + i, mask=x_ok, other=0.0).to(tl.float32)
                part += _q6_k_values(low, high, g, i) * x[None]
            total += tl.sum(part * _q6_k_scales(Scales, rows, halves, ok, NH, g), axis=2)
        acc += tl.sum(d.to(tl.float32) * total, axis=1)
    tl.store(Out + row * stride_out + rows, acc.to(Out.dtype.element_ty), mask=rows < N)


@triton.jit
def _q6_k_dequantize_kernel(
    Codes, High, Scales, D, W, N, NH, BLOCK_N: tl.constexpr, HALVES: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    halves = tl.program_id(1) * HALVES + tl.arange(0, HALVES)
    ok = (rows < N)[:, None] & (halves < NH)[None, :]
    low_a = _words(Codes, rows, halves * 2, ok, NH * 2, 8)
    low_b = _words(Codes, rows, halves * 2 + 1, ok, NH * 2, 8)
    high = _words(High, rows, halves, ok, NH, 8)
    d = tl.load(D + rows[:, None] * (NH // 2) + halves[None, :] // 2, mask=ok, other=0.0)
    w = tl.arange(0, 8)
    at = W + rows[:, None, None] * (NH * 128) + halves[None, :, None] * 128 + w[None, None, :] * 4
    dtype = W.dtype.element_ty
    for g in tl.static_range(4):
        low = low_a if g % 2 == 0 else low_b
        step = d.to(tl.float32)[:, :, None] * _q6_k_scales(Scales, rows, halves, ok, NH, g)
        for i in tl.static_range(4):
            value = step * _q6_k_values(low, high, g, i)
            tl.store(at + 32 * g + i, value.to(dtype), mask=ok[:, :, None])


def kernel_args(planes: Planes) -> tuple[torch.Tensor, ...]:
    """(code words int32, d, m) as the kernels take them (m: d where the type has none)."""
    words = planes.codes.view(torch.int32)
    return words, planes.d, planes.m if planes.m is not None else planes.d


def shape_args(planes: Planes) -> dict[str, int]:
    type_id = TYPE_IDS[planes.type_name]
    return {"TYPE": type_id, "WORDS": 8 if type_id == 0 else 4, "BLOCK_N": BLOCK_N,
            "BLOCKS": BLOCKS}  # fmt: skip


def gemv(a: torch.Tensor, planes: Planes, out: torch.Tensor) -> None:
    """out [M, N] (a view whose rows may be strided) = a [M, K] @ W.T, by the GEMV kernel."""
    n, blocks = planes.d.shape
    strides = (a.stride(0), out.stride(0))
    grid = (triton.cdiv(n, BLOCK_N), a.shape[0])
    if planes.type_name == "Q4_K":
        steps = triton.cdiv(blocks, K_BLOCKS)
        _q4_k_gemv_kernel[grid](a, *k_args(planes), out, n, blocks, steps, *strides,
                                BLOCK_N=BLOCK_N, K_BLOCKS=K_BLOCKS)  # fmt: skip
        return
    if planes.type_name == "Q6_K":
        steps = triton.cdiv(2 * blocks, HALVES)
        _q6_k_gemv_kernel[grid](a, *q6_k_args(planes), out, n, 2 * blocks, steps, *strides,
                                BLOCK_N=BLOCK_N, HALVES=HALVES)  # fmt: skip
        return
    steps = triton.cdiv(blocks, BLOCKS)
    _gguf_gemv_kernel[grid](a, *kernel_args(planes), out, n, blocks, steps, *strides,
                            **shape_args(planes))  # fmt: skip


def dequantize(planes: Planes, k: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype``, each value computed in float32 and rounded once."""
    n, blocks = planes.d.shape
    out = torch.empty((n, k), dtype=dtype, device=planes.d.device)
    if planes.type_name == "Q4_K":
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(blocks, K_BLOCKS))
        _q4_k_dequantize_kernel[grid](*k_args(planes), out, n, blocks, BLOCK_N=BLOCK_N,
                                      K_BLOCKS=K_BLOCKS)  # fmt: skip
        return out
    if planes.type_name == "Q6_K":
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(2 * blocks, HALVES))
        _q6_k_dequantize_kernel[grid](*q6_k_args(planes), out, n, 2 * blocks, BLOCK_N=BLOCK_N,
                                      HALVES=HALVES)  # fmt: skip
        return out
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(blocks, BLOCKS))
    _gguf_dequantize_kernel[grid](*kernel_args(planes), out, n, blocks, **shape_args(planes))
    return out


def k_args(planes: Planes) -> tuple[torch.Tensor, ...]:
    """(code words int32, d, dmin, packed scales) as the Q4_K kernels take them."""
    assert planes.m is not None and planes.scales is not None
    return planes.codes.view(torch.int32), planes.d, planes.m, planes.scales


def q6_k_args(planes: Planes) -> tuple[torch.Tensor, ...]:
    """(low words, high words, int8 scales as bytes, d) as the Q6_K kernels take them."""
    assert planes.high is not None and planes.scales is not None
    return planes.codes.view(torch.int32), planes.high.view(torch.int32), planes.scales, planes.d


def gguf_matmul(a: torch.Tensor, runs: list[tuple[int, Planes]], n: int) -> torch.Tensor:
    """a [M, K] @ W.T -> [M, N] in a's dtype, W given by its runs' planes."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    m, k = a.shape
    dequantizes = [m > GEMV_ROWS and p.d.shape[0] * k <= DEQUANTIZE_MAX_VALUES for _, p in runs]
    if len(runs) == 1 and dequantizes[0]:
        return F.linear(a, dequantize(runs[0][1], k, a.dtype))
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    for (start, planes), dense in zip(runs, dequantizes, strict=True):
        target = out[:, start : start + planes.d.shape[0]]
        if dense:
            target.copy_(F.linear(a, dequantize(planes, k, a.dtype)))
        else:
            gemv(a, planes, target)
    return out
