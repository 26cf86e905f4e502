"""The W4A16 GEMM on CUDA: C = A @ W.T for activations A [M, K] (bf16/fp16/float32) and a 4-bit
weight in the kernel's layout of engine_core/models/w4a16.py (``tile_qweight``: qweight int32
[Kp / 8, N], blocks of 128 columns interleaved so that nibble i of a block's 16 word rows holds
16 consecutive columns; scales float32 [G, N]; zeros uint8 [G, N] or none).

Three paths, chosen by ``choose_tiles`` (the sweep's table, else a rule), nothing tuned at run
time (CUDA graphs replay what was captured; a grid depends only on shapes):

- up to GEMV_ROWS rows (decode), ``_w4a16_gemv_kernel`` on CUDA cores, reading the weight at
  HBM speed is the whole job. A program takes BLOCK_N weight columns and BLOCK_M rows over a
  range of 128-column blocks; per block one [16, BLOCK_N] tile of words (16-byte loads along
  N, the next block's in flight). Each nibble is masked where it lies in its word and OR'd into
  the mantissa of 2**23 (nibbles 5-7 after one shift of the word by 20), so the float is
  2**23 + q * 16**e; subtracting 2**23 + zero * 16**e leaves (q - zero) * 16**e exactly, and
  the activation, divided by 16**e, takes the place value off: three instructions a weight
  (mask-and-OR, subtract, multiply-add) besides the product's own. The partial sums are scaled
  once per group, not per weight (the reference rounds each weight to the activations' dtype
  first; this kernel does not, so it is as close to the exact product or closer).
- up to 127 rows, ``_w4a16_kernel`` on the tensor cores, dequantizing in registers. A program
  takes BLOCK_N weight columns and BLOCK_M activation rows over a range of 128-column blocks.
  Per block it loads one [16, BLOCK_N] tile of words (contiguous along N) and makes eight
  [16, BLOCK_N] weight slices out of it, one per nibble: shift, mask, OR into the mantissa of
  2**23 (a float whose last mantissa bit is worth 1), subtract 2**23 + zero, times the scale,
  rounded once to the activations' dtype as the reference rounds it. No integer-to-float
  conversion, no reshape of the tile: each slice is 16 consecutive columns of K and goes to the
  tensor cores as it is, against the matching 16 columns of A ("swap AB": the weight columns on
  the matrix unit's wide side, a few decode rows on its narrow one). The next block's words are
  loaded before this block is multiplied, so a load is always in flight. ``Tiles.joined`` takes
  ``_w4a16_joined_kernel`` instead: the eight slices joined into one [BLOCK_N, 128] operand,
  which reaches wgmma from registers with no bf16 tile stored to shared memory (about 6
  instructions a weight in the loop against 9, compiled for sm_90), which the sweep found
  fastest at 16 and 64 rows on every llama-8b projection, so MEASURED takes it there (1.3-1.5x
  the first kernel's speed). Both decode kernels split the blocks over SPLIT_K programs when the
  weight tiles alone would leave multiprocessors idle; their float32 partials are summed by a
  second small kernel (in a fixed order: the same sums on every replay, unlike atomics).
- from 128 rows (and for group sizes that are not whole 16-column slices): the weight is
  dequantized by a kernel into a [K, N] buffer in the activations' dtype, then cuBLAS. The
  product is compute-bound there, and a tensor-core GEMM in cuBLAS's hands beats dequantizing
  the same weight tile once per row tile (at 256 rows measured 2x the kernel's speed).

tests/test_w4a16_interpreted.py runs these kernels in Triton's interpreter on the CPU;
tests/test_w4a16_gpu.py checks them on a GPU over the presets' shapes; `python -m benchmarks
w4a16` sweeps the tiles on a GPU. Importing this module imports triton: only CUDA code paths and
GPU tests may do so (or set ``TRITON_INTERPRET=1`` first to run it on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The layout's constants (w4a16.TILE_K, PLANE; not imported: w4a16 imports this module).
TILE_K = 128  # columns of one interleaved block
PLANE = 16  # columns one nibble position of a block holds: one slice of K
MAGIC = 8388608.0  # 2**23: a float32 whose last mantissa bit is worth 1
ONE_GROUP = 2**30  # the group size passed for one group over all of K
SYMMETRIC_ZERO = 8
DEQUANTIZE_ROWS = 128  # from this many rows on, dequantize the weight and use cuBLAS
# ... if the dequantized weight is at most this many values (512 MiB in bf16): its buffer comes
# out of the activations' headroom (memory_plan.CUDA_HEADROOM_BYTES, 2 GiB).
DEQUANTIZE_MAX_VALUES = 2**28
# The same constants as the kernels see them (a kernel reads only constexpr globals).
_TILE_K = tl.constexpr(TILE_K)
_PLANE = tl.constexpr(PLANE)
_MAGIC = tl.constexpr(MAGIC)
_MAGIC_BITS = tl.constexpr(0x4B000000)  # MAGIC's bits
_SYMMETRIC_ZERO = tl.constexpr(float(SYMMETRIC_ZERO))


@triton.jit
def _nibbles(words, i: tl.constexpr):
    """Nibble i of each int32 word as the float32 2**23 + q (q in 0..15): the nibble OR'd into
    the mantissa of 2**23, read as a float, instead of converted."""
    bits = (words >> (4 * i)) & 0xF
    return (bits | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _group_params(
    Scales, Zeros, k, N, cols, cols_ok, GROUPS, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr
):
    """(scale, 2**23 + zero) of the group holding column(s) k (``_scale_zero``'s), the offset
    a nibble read as 2**23 + q takes away."""
    scale, zero = _scale_zero(Scales, Zeros, k, N, cols, cols_ok, GROUPS, GROUP, HAS_ZEROS)
    return scale, zero + _MAGIC


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    A,  # [M, K]
    QWeight,  # [Kp / 8, N] int32, tiled
    Scales,  # [G, N] float32
    Zeros,  # [G, N] uint8 (unread without HAS_ZEROS)
    C,  # [M, N] (not SPLIT)
    Part,  # [SPLIT_K, M, N] float32 (SPLIT)
    M,
    N,
    K,
    GROUPS,
    stride_am,
    stride_cm,
    TILES,  # Kp / 128
    TILES_PER_SPLIT,
    GROUP: tl.constexpr,
    PLANES_PER_GROUP: tl.constexpr,  # slices between scale loads: 1, 2, 4 or 8 (once a block)
    HAS_ZEROS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,  # weights as the product's left operand: C.T = W @ A.T
):
    """Program (row tile, column tile, split): the [BLOCK_N, BLOCK_M] tile of C.T (SWAP), or the
    [BLOCK_M, BLOCK_N] tile of C = A @ W.T, over blocks [split * TILES_PER_SPLIT,
    +TILES_PER_SPLIT) of K. The weight slice [PLANE, BLOCK_N] is the right operand as it is; SWAP
    transposes it to put the weight columns on the matrix unit's wide side."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, _PLANE)
    first = split * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, TILES)
    w_ptrs = QWeight + (first * _PLANE + rj)[:, None].to(tl.int64) * N + rn[None, :]
    # Rows, weight columns and K as the two axes of the activations' tile and the output's.
    if SWAP:
        rows, cols, ks = rm[None, :], rn[:, None], rj[:, None]  # a [PLANE, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        rows, cols, ks = rm[:, None], rn[None, :], rj[None, :]  # a [BLOCK_M, PLANE]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = A + rows.to(tl.int64) * stride_am + ks
    # [PLANE, BLOCK_N]; rj < 16 * (blocks left): all rows while a block is left, none after.
    n_ok = rn[None, :] < N
    words = tl.load(w_ptrs, mask=(rj[:, None] < (last - first) * _PLANE) & n_ok, other=0)
    for tile in range(first, last):
        w_ptrs += _PLANE * N
        ahead_ok = (rj[:, None] < (last - tile - 1) * _PLANE) & n_ok
        ahead = tl.load(w_ptrs, mask=ahead_ok, other=0)  # in flight while this block runs
        for i in tl.static_range(8):
            k = tile * _TILE_K + i * _PLANE
            if i % PLANES_PER_GROUP == 0:
                scale, offset = _group_params(
                    Scales, Zeros, k, N, rn[None, :], n_ok, GROUPS, GROUP, HAS_ZEROS
                )
            w = ((_nibbles(words, i) - offset) * scale).to(A.dtype.element_ty)
            a = tl.load(a_ptrs + k, mask=(rows < M) & (k + ks < K), other=0.0)
            if SWAP:
                acc = tl.dot(tl.trans(w), a, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
        words = ahead
    mask = (rows < M) & (cols < N)
    if SPLIT:
        p_ptrs = Part + (split * M + rows).to(tl.int64) * N + cols
        tl.store(p_ptrs, acc, mask=mask)
    else:
        c_ptrs = C + rows.to(tl.int64) * stride_cm + cols
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _w4a16_joined_kernel(
    A,  # [M, K]
    QWeight,  # [Kp / 8, N] int32, tiled
    Scales,  # [G, N] float32
    Zeros,  # [G, N] uint8 (unread without HAS_ZEROS)
    C,  # [M, N] (not SPLIT)
    Part,  # [SPLIT_K, M, N] float32 (SPLIT)
    M,
    N,
    K,
    GROUPS,
    stride_am,
    stride_cm,
    TILES,  # Kp / 128
    TILES_PER_SPLIT,
    GROUP: tl.constexpr,
    PLANES_PER_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """``_w4a16_kernel``'s product (weights on the left: the [BLOCK_N, BLOCK_M] tile of C.T), with
    one product a block instead of eight: the eight dequantized slices are joined into one
    [BLOCK_N, 128] operand whose column 16i + j is nibble i of word row j, which is column
    128b + 16i + j of K in the layout as it is, so the activations' [128, BLOCK_M] tile is read in
    order. Joins, a permute and a reshape only rename registers, and the words come through
    shared memory by the pipeliner's asynchronous copies (the block's words are loaded in the
    loop, not carried from the last turn), whose read back Triton lays out as the matrix unit's
    register operand: wgmma takes the weights from registers, and no bf16 tile is stored to shared
    memory (``python -m benchmarks w4a16-compile``). The words are held as [BLOCK_N, 4, 4] (row j
    = 4a + b): held as [BLOCK_N, 16], Triton copied them 4 bytes at a time, not 16."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, _TILE_K)
    first = split * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, TILES)
    cols = rn[:, None, None]  # [BLOCK_N, 1, 1]
    word_rows = 4 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    w_ptrs = QWeight + (first * _PLANE + word_rows).to(tl.int64) * N + cols
    n_ok = cols < N
    rows = rm[None, :]
    a_ptrs = A + rows.to(tl.int64) * stride_am + rk[:, None]  # [128, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for tile in range(first, last):
        words = tl.load(w_ptrs, mask=n_ok, other=0)
        w_ptrs += _PLANE * N
        k0 = tile * _TILE_K
        # Nibbles 0-4 and 5-7 each under MAGIC's exponent: one AND a nibble keeps one of them
        # and the exponent (``_in_place``).
        low = (words & 0xFFFFF) | _MAGIC_BITS
        high = ((words >> 20) & 0xFFF) | _MAGIC_BITS
        scale, zero = _scale_zero(Scales, Zeros, k0, N, cols, n_ok, GROUPS, GROUP, HAS_ZEROS)
        s0 = _in_place(low, 0, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 1, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s1 = _in_place(low, 1, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 2, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s2 = _in_place(low, 2, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 3, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s3 = _in_place(low, 3, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 4, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s4 = _in_place(low, 4, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 5, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s5 = _in_place(high, 0, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 6, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s6 = _in_place(high, 1, scale, zero, A.dtype.element_ty)
        scale, zero = _next_group(scale, zero, 7, k0, Scales, Zeros, N, cols, n_ok, GROUPS,
                                  GROUP, PLANES_PER_GROUP, HAS_ZEROS)  # fmt: skip
        s7 = _in_place(high, 2, scale, zero, A.dtype.element_ty)
        w = _joined(s0, s1, s2, s3, s4, s5, s6, s7)  # [BLOCK_N, 128]
        a = tl.load(a_ptrs + k0, mask=(rows < M) & (k0 + rk[:, None] < K), other=0.0)
        acc = tl.dot(w, a, acc, input_precision=PRECISION)
    out_cols = rn[:, None]
    mask = (rows < M) & (out_cols < N)
    if SPLIT:
        tl.store(Part + (split * M + rows).to(tl.int64) * N + out_cols, acc, mask=mask)
    else:
        c_ptrs = C + rows.to(tl.int64) * stride_cm + out_cols
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _scale_zero(Scales, Zeros, k, N, cols, cols_ok, GROUPS, GROUP: tl.constexpr,
                HAS_ZEROS: tl.constexpr):  # fmt: skip
    """(scale, zero) in float32 of the group holding column(s) k, for weight columns ``cols``
    (broadcast shapes); padded columns past K take the last group (their activations are 0)."""
    group = tl.minimum(k // GROUP, GROUPS - 1)
    scale = tl.load(Scales + group * N + cols, mask=cols_ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(Zeros + group * N + cols, mask=cols_ok, other=0).to(tl.float32)
    else:
        zero = _SYMMETRIC_ZERO
    return scale, zero


@triton.jit
def _next_group(scale, zero, i: tl.constexpr, k0, Scales, Zeros, N, cols, cols_ok, GROUPS,
                GROUP: tl.constexpr, PLANES_PER_GROUP: tl.constexpr,
                HAS_ZEROS: tl.constexpr):  # fmt: skip
    """Slice i's (scale, zero): a new group's where slice i starts one, else those given."""
    if i % PLANES_PER_GROUP == 0:
        scale, zero = _scale_zero(Scales, Zeros, k0 + i * _PLANE, N, cols, cols_ok, GROUPS,
                                  GROUP, HAS_ZEROS)  # fmt: skip
    return scale, zero


@triton.jit
def _in_place(source, e: tl.constexpr, scale, zero, dtype: tl.constexpr):
    """Nibble e of ``source`` (words holding their nibbles under MAGIC's exponent) dequantized:
    masked where it lies, the float 2**23 + q * 16**e; less 2**23 + zero * 16**e that is
    (q - zero) * 16**e exactly, and times scale / 16**e (exact: a power of two) it is the
    product (q - zero) * scale rounded as ``_w4a16_kernel`` rounds it, then to ``dtype``."""
    place = 1 << (4 * e)
    q = (source & (_MAGIC_BITS | (0xF << (4 * e)))).to(tl.float32, bitcast=True)
    return ((q - (zero * place + _MAGIC)) * (scale * (1.0 / place))).to(dtype)


@triton.jit
def _joined(s0, s1, s2, s3, s4, s5, s6, s7):
    """Eight [BLOCK_N, 4, 4] slices (word row 4a + b of slice i: column 16i + 4a + b) as one
    [BLOCK_N, 128] operand, column 16i + j holding slice i's word row j."""
    low = tl.join(tl.join(s0, s1), tl.join(s2, s3))
    high = tl.join(tl.join(s4, s5), tl.join(s6, s7))
    u = tl.join(low, high)  # [BLOCK_N, a, b, i0, i1, i2]: slice i = i0 + 2 i1 + 4 i2
    v = tl.permute(u, (0, 5, 4, 3, 1, 2))  # [BLOCK_N, i2, i1, i0, a, b]
    return tl.reshape(v, (u.shape[0], _TILE_K))


@triton.jit
def _nibble_in_place(words, high, i: tl.constexpr):
    """Nibble i of each word as the float32 2**23 + q * 16**(i % 5): the nibble masked where it
    lies (no shift) and OR'd into the mantissa of 2**23, whose 23 bits hold nibbles 0-4. Nibbles
    5-7 come from ``high``, the words shifted right by 20 once."""
    source = words if i < 5 else high
    return ((source & (0xF << (4 * (i % 5)))) | _MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(
    A,  # [M, K]
    QWeight,  # [Kp / 8, N] int32, tiled
    Scales,  # [G, N] float32
    Zeros,  # [G, N] uint8 (unread without HAS_ZEROS)
    C,  # [M, N] (not SPLIT)
    Part,  # [SPLIT_K, M, N] float32 (SPLIT)
    M,
    N,
    K,
    GROUPS,
    stride_am,
    stride_cm,
    TILES,  # Kp / 128
    TILES_PER_SPLIT,
    GROUP: tl.constexpr,
    PLANES_PER_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The decode product on CUDA cores. Program (row tile, column tile, split): C[rows, cols]
    over blocks [split * TILES_PER_SPLIT, +TILES_PER_SPLIT) of K. Each block is one [16, BLOCK_N]
    tile of words (16-byte loads along N, the next block's in flight); nibble i of word row j is
    column 16i + j of the block, so q * x sums into a [16, BLOCK_N] partial per row, exact in
    float32, from which zero * (the group's sum of x) is taken and which is scaled, once per
    group rather than once per weight. One row keeps
    its tensors two-dimensional (no axis of length 1 for the compiler to lay out)."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, _PLANE)
    m_ok = rm < M
    n_ok = rn < N
    first = split * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, TILES)
    w_ptrs = QWeight + (first * _PLANE + rj)[:, None].to(tl.int64) * N + rn[None, :]
    if BLOCK_M == 1:
        a_ptrs = A + pid_m.to(tl.int64) * stride_am + rj  # [PLANE]
    else:
        a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rj[None, :]  # [BLOCK_M, PLANE]
    words = tl.load(w_ptrs, mask=(rj[:, None] < (last - first) * _PLANE) & n_ok[None, :], other=0)
    # Per-column values loaded as [PLANE, BLOCK_N] tiles (rows alike, L1 hits) take the words'
    # register layout; a [BLOCK_N] vector would be shuffled through shared memory per use.
    cols = rj[:, None] * 0 + rn[None, :]
    cols_ok = cols < N
    acc = _row_partials(BLOCK_M, BLOCK_N)
    for tile in range(first, last):
        w_ptrs += _PLANE * N
        ahead_ok = (rj[:, None] < (last - tile - 1) * _PLANE) & n_ok[None, :]
        ahead = tl.load(w_ptrs, mask=ahead_ok, other=0)  # in flight while this block runs
        high = words >> 20
        for i in tl.static_range(8):
            k = tile * _TILE_K + i * _PLANE
            if i % PLANES_PER_GROUP == 0:
                group = tl.minimum(k // GROUP, GROUPS - 1)  # padding past K: the last group
                scale = tl.load(Scales + group * N + cols, mask=cols_ok, other=0.0)
                if HAS_ZEROS:
                    zero = tl.load(Zeros + group * N + cols, mask=cols_ok, other=0).to(tl.float32)
                part = _row_partials(BLOCK_M, BLOCK_N)
                a_sum = tl.zeros(a_ptrs.shape, dtype=tl.float32)
            place = 1 << (4 * (i % 5))  # the nibble's place value, taken off a instead
            a = tl.load(a_ptrs + k, mask=_columns_ok(m_ok, k + rj < K, BLOCK_M), other=0.0)
            a = a.to(tl.float32)
            if HAS_ZEROS:
                q = _nibble_in_place(words, high, i) - _MAGIC  # q * place, exact
                a_sum += a
            else:  # (q - 8) * place, exact: the zero is a constant of the nibble
                q = _nibble_in_place(words, high, i) - (_MAGIC + _SYMMETRIC_ZERO * place)
            part += _rows_times(a * (1.0 / place), q, BLOCK_M)
            if (i + 1) % PLANES_PER_GROUP == 0:
                if HAS_ZEROS:
                    # sum (q - zero) * a = sum q * a - zero * sum a, row by row (the rows are
                    # summed at the end): the zero point costs nothing per weight.
                    part -= _rows_times(a_sum, zero, BLOCK_M)
                acc += part * scale
        words = ahead
    out = _rows_out(acc, BLOCK_M)  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        p_ptrs = Part + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(p_ptrs, out, mask=mask)
    else:
        c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _row_partials(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros for the per-row partial sums: [PLANE, BLOCK_N] for one row, else
    [BLOCK_M, PLANE, BLOCK_N]."""
    if BLOCK_M == 1:
        zeros = tl.zeros((_PLANE, BLOCK_N), dtype=tl.float32)
    else:
        zeros = tl.zeros((BLOCK_M, _PLANE, BLOCK_N), dtype=tl.float32)
    return zeros


@triton.jit
def _columns_ok(m_ok, k_ok, BLOCK_M: tl.constexpr):
    """The activations' load mask: [PLANE] for one row (which exists), else [BLOCK_M, PLANE]."""
    return k_ok if BLOCK_M == 1 else m_ok[:, None] & k_ok[None, :]


@triton.jit
def _rows_times(a, centred, BLOCK_M: tl.constexpr):
    """Activations a ([PLANE] or [BLOCK_M, PLANE]) times the centred nibbles [PLANE, BLOCK_N],
    shaped as ``_row_partials``."""
    return a[:, None] * centred if BLOCK_M == 1 else a[:, :, None] * centred[None, :, :]


@triton.jit
def _rows_out(acc, BLOCK_M: tl.constexpr):
    """The partials summed over their 16 word rows: [BLOCK_M, BLOCK_N]."""
    return tl.sum(acc, axis=0)[None, :] if BLOCK_M == 1 else tl.sum(acc, axis=1)


@triton.jit
def _sum_splits_kernel(Part, C, SIZE, SPLITS, BLOCK: tl.constexpr):
    """C (contiguous, SIZE elements) = the sum of the SPLITS float32 partials, rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < SIZE
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    part_ptrs = Part + offs
    for _ in range(SPLITS):
        acc += tl.load(part_ptrs, mask=ok, other=0.0)
        part_ptrs += SIZE
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(
    QWeight,  # [Kp / 8, N] int32, tiled
    Scales,
    Zeros,
    Out,  # [K, N]
    N,
    K,
    GROUPS,
    GROUP: tl.constexpr,
    UNIFORM: tl.constexpr,  # a 16-column slice lies in one group
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (column tile, block): the block's 128 rows of W.T, in Out's dtype."""
    pid_n, tile = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, _PLANE)
    n_ok = rn < N
    w_ptrs = QWeight + (tile * _PLANE + rj)[:, None].to(tl.int64) * N + rn[None, :]
    words = tl.load(w_ptrs, mask=n_ok[None, :], other=0)
    for i in tl.static_range(8):
        rk = tile * _TILE_K + i * _PLANE + rj
        k = rk[:, None]
        if UNIFORM:
            k = tile * _TILE_K + i * _PLANE
        scale, offset = _group_params(
            Scales, Zeros, k, N, rn[None, :], n_ok[None, :], GROUPS, GROUP, HAS_ZEROS
        )
        w = (_nibbles(words, i) - offset) * scale
        out_ptrs = Out + rk[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(out_ptrs, w.to(Out.dtype.element_ty), mask=(rk < K)[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    """The tensor-core kernel's tiles: rows and weight columns a program, K splits; ``swap``:
    the weights as the product's left operand (``_w4a16_kernel``'s SWAP); ``joined``: one product
    a block from the joined slices, the weights wgmma's register operand (``_w4a16_joined_kernel``,
    weights on the left, ``swap`` unread). Give the joined kernel 16 weight columns a warp (64 a
    warp group): with more (128 columns on 4 warps), Triton 3.6 sends the slices through shared
    memory again (``python -m benchmarks w4a16-compile``)."""

    block_m: int
    block_n: int
    split_k: int
    warps: int = 4
    stages: int = 2
    swap: bool = True
    joined: bool = False


@dataclass(frozen=True)
class GemvTiles:
    """The CUDA-core decode kernel's tiles (``_w4a16_gemv_kernel``), the same fields."""

    block_m: int
    block_n: int
    split_k: int
    warps: int = 4
    stages: int = 1


Choice = Tiles | GemvTiles | None  # None: dequantize, then cuBLAS

# Up to this many rows the CUDA-core kernel, one program per row (its compiled loop, read off its
# sm_90 machine code: about 6 instructions a weight at one row; a row tile of 4 spills):
# each row costs a pass of its own, while the tensor-core kernel's time stays level
# (docs/design/quantization.md).
GEMV_ROWS = 2
# The sweep's fastest choice (`python -m benchmarks w4a16 --sweep`) by (row bucket, N, K), where
# measured (llama-8b's four projections; docs/design/quantization.md): tiles, or None where
# dequantizing, then cuBLAS won; other shapes take the rule in ``choose_tiles``.
MEASURED: dict[tuple[int, int, int], Choice] = {
    (1, 4096, 4096): GemvTiles(block_m=1, block_n=64, split_k=8, warps=4, stages=1),
    (2, 4096, 4096): Tiles(block_m=16, block_n=64, split_k=8, warps=4, stages=2, swap=True),
    (4, 4096, 4096): Tiles(block_m=16, block_n=64, split_k=8, warps=4, stages=2, swap=True),
    (16, 4096, 4096): Tiles(
        block_m=16, block_n=64, split_k=8, warps=4, stages=3, swap=True, joined=True
    ),
    (64, 4096, 4096): Tiles(
        block_m=64, block_n=128, split_k=4, warps=8, stages=3, swap=True, joined=True
    ),
    (1, 4096, 14336): GemvTiles(block_m=1, block_n=128, split_k=16, warps=4, stages=2),
    (2, 4096, 14336): GemvTiles(block_m=1, block_n=64, split_k=16, warps=4, stages=1),
    (4, 4096, 14336): Tiles(block_m=16, block_n=64, split_k=16, warps=4, stages=2, swap=True),
    (16, 4096, 14336): Tiles(
        block_m=16, block_n=64, split_k=8, warps=4, stages=3, swap=True, joined=True
    ),
    (64, 4096, 14336): Tiles(
        block_m=64, block_n=128, split_k=4, warps=8, stages=3, swap=True, joined=True
    ),
    (1, 6144, 4096): GemvTiles(block_m=1, block_n=64, split_k=8, warps=4, stages=2),
    (2, 6144, 4096): Tiles(block_m=16, block_n=64, split_k=8, warps=4, stages=2, swap=True),
    (4, 6144, 4096): Tiles(block_m=16, block_n=64, split_k=8, warps=4, stages=2, swap=True),
    (16, 6144, 4096): Tiles(
        block_m=16, block_n=64, split_k=4, warps=4, stages=3, swap=True, joined=True
    ),
    (64, 6144, 4096): Tiles(
        block_m=64, block_n=64, split_k=4, warps=4, stages=3, swap=True, joined=True
    ),
    (1, 28672, 4096): GemvTiles(block_m=1, block_n=128, split_k=4, warps=4, stages=1),
    (2, 28672, 4096): GemvTiles(block_m=1, block_n=128, split_k=2, warps=4, stages=1),
    (4, 28672, 4096): Tiles(block_m=16, block_n=64, split_k=4, warps=4, stages=2, swap=True),
    (16, 28672, 4096): Tiles(
        block_m=16, block_n=64, split_k=2, warps=4, stages=3, swap=True, joined=True
    ),
    (64, 28672, 4096): Tiles(
        block_m=64, block_n=128, split_k=1, warps=8, stages=3, swap=True, joined=True
    ),
}


def group_constant(group: int, k: int) -> int:
    """The kernels' GROUP: the group size, or ONE_GROUP for one group over all of K."""
    return ONE_GROUP if group >= k else group


def planes_per_group(group: int) -> int | None:
    """16-column slices between scale loads in the GEMM kernel (8: once a block), or None where
    a slice can straddle two groups (the GEMM kernel does not take those)."""
    if group % PLANE:
        return None
    if TILE_K % group == 0:
        return group // PLANE
    return 8 if group % TILE_K == 0 else 1


def row_bucket(m: int) -> int:
    """The row tile a product of M rows is measured and tabled under: a power of two."""
    return 1 << max(0, (m - 1).bit_length())


def choose_tiles(m: int, n: int, k: int, group: int, multiprocessors: int) -> Choice:
    """Tiles for an [M, K] x [N, K] product, or None: dequantize and use cuBLAS (for groups the
    kernels do not take; where MEASURED says so; else from DEQUANTIZE_ROWS rows on; the last two
    for weights of up to DEQUANTIZE_MAX_VALUES). Otherwise the sweep's tiles where MEASURED has
    the shape, else up to GEMV_ROWS rows the CUDA-core kernel and beyond it the tensor-core one,
    each with K split in two until the programs fill the multiprocessors four times over or a
    split would get fewer than 4 blocks (docs/design/quantization.md)."""
    if planes_per_group(group_constant(group, k)) is None:
        return None
    fits = n * k <= DEQUANTIZE_MAX_VALUES  # the dequantized weight's buffer
    key = (row_bucket(m), n, k)
    if key in MEASURED and (MEASURED[key] is not None or fits):
        return MEASURED[key]
    if m >= DEQUANTIZE_ROWS and fits:
        return None
    return rule_tiles(m, n, k, multiprocessors)


def rule_tiles(m: int, n: int, k: int, multiprocessors: int) -> Tiles | GemvTiles:
    """The tiles for a shape the sweep has not measured: up to GEMV_ROWS rows the CUDA-core
    kernel, one row and 128 weight columns a program (the rows' programs run side by side, so
    the second reads the weight from the L2), beyond it the tensor-core one."""
    if m <= GEMV_ROWS:
        return GemvTiles(1, 128, split_k(m, n, k, 1, 128, multiprocessors))
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return Tiles(block_m, 128, split_k(m, n, k, block_m, 128, multiprocessors))


def split_k(m: int, n: int, k: int, block_m: int, block_n: int, multiprocessors: int) -> int:
    """K split in two until the programs fill the multiprocessors four times over or a split
    would get fewer than 4 blocks of 128 columns."""
    blocks = triton.cdiv(k, TILE_K)
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while programs * split < 4 * multiprocessors and blocks >= 8 * split:
        split *= 2
    return split


def w4a16_gemm(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """a [M, K] @ W.T -> [M, N] in a's dtype, W given by the kernel's W4A16 layout."""
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = choose_tiles(a.shape[0], qweight.shape[1], a.shape[1], group_size, sms)
    return run_w4a16(a, qweight, scales, zeros, group_size, tiles)


def check_layout(qweight: torch.Tensor, scales: torch.Tensor, k: int) -> None:
    expected = (triton.cdiv(k, TILE_K) * PLANE, scales.shape[1])
    if tuple(qweight.shape) != expected:
        raise ValueError(
            f"W4A16 qweight {tuple(qweight.shape)} is not the kernel's layout for K={k} "
            f"(expected {expected}: w4a16.tile_qweight)"
        )


def run_w4a16(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    tiles: Choice,
) -> torch.Tensor:
    """``w4a16_gemm`` with the given tiles (None: dequantize, then cuBLAS)."""
    m, k = a.shape
    check_layout(qweight, scales, k)
    if tiles is None:
        return a @ dequantize_tiled(qweight, scales, zeros, group_size, k, a.dtype)
    group = group_constant(group_size, k)
    planes = planes_per_group(group)
    if planes is None:
        raise ValueError(f"the W4A16 GEMM kernels do not take groups of {group_size} columns")
    n = qweight.shape[1]
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    part = out
    if tiles.split_k > 1:
        part = torch.empty((tiles.split_k, m, n), dtype=torch.float32, device=a.device)
    blocks = triton.cdiv(k, TILE_K)
    per_split = triton.cdiv(blocks, tiles.split_k)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    args = (
        a, qweight, scales, zeros if zeros is not None else scales, out, part, m, n, k,
        scales.shape[0], a.stride(0), out.stride(0), blocks, per_split,
    )  # fmt: skip
    shape = {"GROUP": group, "PLANES_PER_GROUP": planes, "HAS_ZEROS": zeros is not None,
             "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "SPLIT": tiles.split_k > 1,
             "num_warps": tiles.warps, "num_stages": tiles.stages}  # fmt: skip
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    if isinstance(tiles, GemvTiles):
        _w4a16_gemv_kernel[grid](*args, **shape)
    elif tiles.joined:
        _w4a16_joined_kernel[grid](*args, PRECISION=precision, **shape)
    else:
        _w4a16_kernel[grid](*args, PRECISION=precision, SWAP=tiles.swap, **shape)
    if tiles.split_k > 1:
        sum_splits(part, out)
    return out


def sum_splits(part: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] = part [S, M, N] summed over S, in float32, rounded once."""
    size = out.numel()
    block = 1024
    _sum_splits_kernel[(triton.cdiv(size, block),)](part, out, size, part.shape[0], BLOCK=block)


def dequantize_tiled(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W.T [K, N] in ``dtype`` from the kernel's layout: ``(q - zero) * scale`` in float32,
    rounded once, as the reference (w4a16.dequantize) computes it."""
    n = qweight.shape[1]
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    group = group_constant(group_size, k)
    block_n = 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, TILE_K))
    _dequantize_kernel[grid](
        qweight, scales, zeros if zeros is not None else scales, out, n, k, scales.shape[0],
        GROUP=group, UNIFORM=group % PLANE == 0, HAS_ZEROS=zeros is not None, BLOCK_N=block_n,
    )  # fmt: skip
    return out
