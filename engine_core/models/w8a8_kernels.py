"""W8A8 INT8 on CUDA in Triton: the per-token activation quantizer and the int8 GEMM whose
epilogue applies both scales (engine_core/models/int8.py's CUDA path).

- ``quantize_per_token``: one launch, a row a program, the row read once: absmax, the scale, the
  int8 values. The arithmetic is compressed-tensors' in the activations' dtype, as the reference
  (int8.quantize_per_token) computes it: scale = absmax / 127.5 rounded to that dtype (a zero
  scale becomes its eps), x / scale rounded to that dtype, clamped to -128..127, rounded half to
  even. bf16 is rounded by its bits (Triton's interpreter truncates float32 to bf16), the
  divisions are IEEE (``div_rn``), so the values are the reference's bit for bit.
- ``int8_gemm``: A [M, K] int8 times W [N, K] int8 on the int8 tensor cores, int32 accumulation,
  then in float32 ``acc * a_scale[m] * w_scale[n]`` (+ bias), rounded once to the output dtype:
  torch's int8 path (``_int_mm`` then the scaling) in one launch, with no int32 [M, N] written.
  Prefill tiles may ask for the persistent kernel (``Tiles.persistent``: a program a
  multiprocessor walking the tiles, TMA loads, the same epilogue) and its K loop
  warp-specialized (``Tiles.ws``; ``python -m benchmarks w8a8-compile`` shows what Triton makes
  of it on sm_90).
- ``choose_tiles``: the tiles for a shape, from the sweep's ``MEASURED`` table where it has the
  shape (None there: cuBLASLt's ``_int_mm`` won), else a rule; nothing is tuned at run time (CUDA
  graphs replay what was captured; a launch depends only on shapes).

tests/test_w8a8_interpreted.py runs both kernels in Triton's interpreter on the CPU,
tests/test_w8a8_gpu.py on a GPU; ``python -m benchmarks gemm --sweep`` times the tiles. Importing
this module imports triton: only CUDA code paths and GPU tests may (or set ``TRITON_INTERPRET=1``
first to run it on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engine_core.triton_descriptors import use_descriptor_scratch

# int8.HALF_RANGE, not imported (int8 imports this module): compressed-tensors' scale divisor.
_HALF_RANGE = tl.constexpr(127.5)
# 1.5 * 2**23: a float32 in [-2**22, 2**22] added to it is rounded to an integer, half to even,
# and that integer is the sum's bits less these (no float-to-int conversion, no libdevice: the
# interpreter has none).
_ROUNDER = tl.constexpr(12582912.0)
_ROUNDER_BITS = tl.constexpr(0x4B400000)
_BF16_MASK = tl.constexpr(-65536)  # 0xFFFF0000 as int32: the bits a bf16 keeps of a float32


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 x rounded to dtype's precision (to nearest, ties to even), kept in float32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & _BF16_MASK
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _quantize_int8_kernel(
    X,  # [M, K] bf16 / fp16 / float32
    Q,  # [M, K] int8
    Scale,  # [M] float32
    stride_x,
    stride_q,
    K,
    EPS: tl.constexpr,  # the activations' dtype's eps: a row of zeros' scale
    BLOCK: tl.constexpr,
):
    """Program row: Q[row] and Scale[row] as int8.quantize_per_token gives them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    quantize_row_int8(x, Q + row * stride_q + cols, Scale + row, mask, X.dtype.element_ty, EPS)


# The per-token int8 arithmetic every kernel that quantizes activations to int8 shares (this
# quantizer, and the norm and SiLU-and-mul launches that write the int8 rows beside their
# output: triton_ops): fused and separate launches give the same bits only while they compute
# exactly this.
@triton.jit
def int8_scale(absmax, DTYPE: tl.constexpr, EPS: tl.constexpr):
    """A row's scale from its largest magnitude (float32; the values are DTYPE's): absmax /
    127.5 rounded to DTYPE, DTYPE's eps where that is zero."""
    scale = _round_to(tl.math.div_rn(absmax, _HALF_RANGE), DTYPE)
    return tl.where(scale == 0.0, EPS, scale)


@triton.jit
def int8_values(x, scale, DTYPE: tl.constexpr):
    """x / scale rounded to DTYPE, clamped to -128..127 and rounded half to even, as int8."""
    q = _round_to(tl.math.div_rn(x, scale), DTYPE)
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    return ((q + _ROUNDER).to(tl.int32, bitcast=True) - _ROUNDER_BITS).to(tl.int8)


@triton.jit
def quantize_row_int8(x, q_ptrs, scale_ptr, mask, DTYPE: tl.constexpr, EPS: tl.constexpr):
    """Store a whole row x (float32, values of DTYPE; zeros where masked) as int8 at q_ptrs and
    its scale at scale_ptr (a row in one block: the quantizer's and the norm's launches)."""
    scale = int8_scale(tl.max(tl.abs(x), 0), DTYPE, EPS)
    tl.store(q_ptrs, int8_values(x, scale, DTYPE), mask=mask)
    tl.store(scale_ptr, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], scale [M, 1] float32: the activations' dtype's value)."""
    rows, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    _quantize_int8_kernel[(rows,)](
        x, q, scale, x.stride(0), q.stride(0), k,
        EPS=torch.finfo(x.dtype).eps, BLOCK=block, num_warps=min(max(block // 512, 1), 8),
    )  # fmt: skip
    return q, scale


@triton.jit
def _scaled_store(acc, rm, rn, M, N, C, AScale, WScale, Bias, stride_cm, HAS_BIAS: tl.constexpr):
    """C[rm, rn] = acc (int32) * a_scale[rm] * w_scale[rn] (+ bias[rn]) in float32, rounded once
    to C's dtype: torch's order (int8.int_mm_product)."""
    m_ok = rm < M
    n_ok = rn < N
    a_scale = tl.load(AScale + rm, mask=m_ok, other=0.0)
    w_scale = tl.load(WScale + rn, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _round_to(out, C.dtype.element_ty)
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _pointer_product(
    A, W, rm, rn, M, N, K, first_k, last_k, stride_am, stride_wn, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """A[rm] @ W[rn].T over columns [first_k, last_k) of K, int32, by per-thread loads. Rows
    past M and N read row 0 (no masks in the loop); the store drops them."""
    rk = first_k + tl.arange(0, BLOCK_K)
    a_ptrs = A + tl.where(rm < M, rm, 0)[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = W + tl.where(rn < N, rn, 0)[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(first_k, last_k, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - (k0 - first_k), other=0)
            w = tl.load(w_ptrs, mask=rk[:, None] < K - (k0 - first_k), other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _tma_product(
    a_desc, w_desc, off_m, off_n, first_k, last_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The same product with both tiles brought in by the tensor memory accelerator (bulk
    copies into shared memory; rows and columns past the tensor read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(first_k, last_k, BLOCK_K):
        a = a_desc.load([off_m, k0])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([off_n, k0])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
    return acc


# M, the step's tokens, changes from step to step: specialized, counts of 1, multiples of 16 and
# others would each compile a variant mid-serving (docs/design/cuda-graphs-and-warm-up.md).
@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    A,  # [M, K] int8 (TMA: its descriptor, [BLOCK_M, BLOCK_K] tiles)
    W,  # [N, K] int8 (TMA: its descriptor, [BLOCK_N, BLOCK_K] tiles)
    C,  # [M, N] (not SPLIT)
    Part,  # [SPLIT_K, M, N] int32 (SPLIT)
    AScale,  # [M] float32
    WScale,  # [N] float32
    Bias,  # [N] (unread without HAS_BIAS)
    M,
    N,
    K,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    stride_am,
    stride_wn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no masks along K
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # write int32 partial sums; _sum_splits_kernel scales them
    TMA: tl.constexpr,
):
    """Program (tile, split): the [BLOCK_M, BLOCK_N] tile of C = (A @ W.T) * a_scale * w_scale
    (+ bias), or (SPLIT) its int32 partial sum over columns [split * K_PER_SPLIT, +K_PER_SPLIT)
    of K."""
    pid, split = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Grouped ordering: neighbouring programs share W tiles, which keeps them in L2.
    pid_m, pid_n = tl.swizzle2d(pid // num_n, pid % num_n, num_m, num_n, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first_k = split * K_PER_SPLIT
    last_k = tl.minimum(first_k + K_PER_SPLIT, K)
    if TMA:
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = _tma_product(A, W, off_m, off_n, first_k, last_k, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _pointer_product(A, W, rm, rn, M, N, K, first_k, last_k, stride_am, stride_wn,
                               BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
    if SPLIT:
        p_ptrs = Part + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(p_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        _scaled_store(acc, rm, rn, M, N, C, AScale, WScale, Bias, stride_cm, HAS_BIAS)


# The persistent form: one program a multiprocessor (or fewer), each walking the tiles
# NUM_SMS apart in the grouped order the one-tile-a-program kernel uses. No program waits for a
# last wave (o's 512 tiles of 128 x 128 on 132 multiprocessors are 3.9 waves), and a program's
# next tile's loads can start under the last one's epilogue. M unspecialized as above.
@triton.jit(do_not_specialize=["M"])
def _int8_gemm_persistent_kernel(
    A,  # [M, K] int8, rows 16-byte aligned
    W,  # [N, K] int8, rows 16-byte aligned
    C,  # [M, N]
    AScale,  # [M] float32
    WScale,  # [N] float32
    Bias,  # [N] (unread without HAS_BIAS)
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOG2_M: tl.constexpr,  # log2(BLOCK_M)
    LOG2_N: tl.constexpr,  # log2(BLOCK_N)
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_SMS: tl.constexpr,  # the grid's size where there are as many tiles: a tile's stride
    WS: tl.constexpr,  # ask the compiler to warp-specialize the K loop (producer / consumer)
):
    """Program p: the tiles p, p + NUM_SMS, ... of C = (A @ W.T) * a_scale * w_scale (+ bias),
    each as ``_int8_gemm_kernel`` computes its tile with TMA loads and no K split: the same
    int32 sums and the same epilogue, so the same bits.

    Two things Triton 3.6's warp specialization on sm_90 needs of it, each measured as a hang or
    wrong results on Hopper without it (docs/design/quantization.md): the descriptors are
    made here (a descriptor made on the host keeps the whole tile's box, while each consumer
    warp group's copy fills half of it: the copies overrun and the barriers' byte counts never
    balance); and the epilogue's rows and columns come from shifts of the tile's indices, not
    from the offsets the loads take (the pass moves those offsets by half a tile for the second
    consumer, and an epilogue sharing them wrote half a tile too far)."""
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])  # fmt: skip
    w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[stride_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])  # fmt: skip
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    # flatten (without WS): the tile loop and the K loop become one loop to the software
    # pipeliner, so the next tile's first loads are issued while this tile's last products run.
    # With WS it must stay nested: Triton 3.6 does not warp-specialize a flattened loop (the
    # sm_90 compile keeps one role then, benchmarks/w8a8_compile.py).
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=not WS):
        pid_m, pid_n = tl.swizzle2d(tile // num_n, tile % num_n, num_m, num_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        # WS: on sm_90 Triton 3.6 splits this loop into a producer warp group issuing the TMA
        # loads and two consumer warp groups, each with half the tile's rows on the tensor
        # cores (CUTLASS's cooperative kernel's roles), at num_warps=4 only (then 12 warps run).
        for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS):
            a = a_desc.load([off_m, k0])  # [BLOCK_M, BLOCK_K]; zeros past M and K
            w = w_desc.load([off_n, k0])  # [BLOCK_N, BLOCK_K]; zeros past N and K
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
        rm = (pid_m << LOG2_M) + tl.arange(0, BLOCK_M)  # not off_m: see the docstring
        rn = (pid_n << LOG2_N) + tl.arange(0, BLOCK_N)
        _scaled_store(acc, rm, rn, M, N, C, AScale, WScale, Bias, stride_cm, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    Part,  # [SPLITS, M, N] int32
    C,
    AScale,
    WScale,
    Bias,
    M,
    N,
    stride_cm,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program: a [BLOCK_M, BLOCK_N] tile of C from the splits' int32 partial sums (integers:
    the same sum in any order, so replays give the same bits), scaled as the GEMM scales."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    p_ptrs = Part + rm[:, None].to(tl.int64) * N + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for _ in range(SPLITS):
        acc += tl.load(p_ptrs, mask=ok, other=0)
        p_ptrs += M * N
    _scaled_store(acc, rm, rn, M, N, C, AScale, WScale, Bias, stride_cm, HAS_BIAS)


@dataclass(frozen=True)
class Tiles:
    """The GEMM's launch: rows, weight rows (output columns) and K a program; warps, pipeline
    stages, row tiles a group of programs walks before the next column tile, K splits (their
    int32 partial sums added and scaled by a second launch), and whether the tensor memory
    accelerator brings the tiles in (where K and the operands are 16-byte aligned). Prefill
    only: ``persistent`` launches a program a multiprocessor that walks the tiles (TMA, no K
    split), ``ws`` asks the compiler to warp-specialize its K loop. Both default off, so every
    ``MEASURED`` entry written before them means the launch it meant."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    group_m: int = 8
    split_k: int = 1
    tma: bool = False
    persistent: bool = False
    ws: bool = False

    def __post_init__(self) -> None:
        # The persistent kernel has only TMA loads and only the one-launch epilogue; ws is a
        # flag of its K loop. A table entry asking otherwise is a mistake, not a fallback.
        if self.persistent and (not self.tma or self.split_k != 1):
            raise ValueError(f"persistent tiles take tma=True and split_k=1: {self}")
        if self.ws and not self.persistent:
            raise ValueError(f"ws is a flag of the persistent kernel: {self}")


# Row counts up to this are decode steps: they take MEASURED's entry for their own bucket only
# (a prefill bucket's tiles would leave most multiprocessors idle at a few rows), else the rule.
DECODE_ROWS = 64
# The sweep's fastest choice (`python -m benchmarks gemm --sweep`) by (row bucket, N, K): tiles,
# or None where cuBLASLt's _int_mm won. Measured at llama-8b's four projections: 256 rows by
# `gemm --rows 256,2048 --sweep --budget 100`, 2,048 and 8,192 (a full prefill step) by
# `gemm --rows 2048,8192 --sweep --budget 240` (the warp-specialized kernel won every shape);
# shapes and buckets it does not hold take ``rule_tiles``.
MEASURED: dict[tuple[int, int, int], Tiles | None] = {
    (256, 4096, 4096): Tiles(64, 128, 128, warps=4, stages=4, group_m=8, split_k=1, tma=False),
    (2048, 4096, 4096): Tiles(128, 256, 128, stages=3, tma=True, persistent=True, ws=True),
    (256, 4096, 14336): Tiles(64, 128, 128, warps=4, stages=4, group_m=8, split_k=1, tma=False),
    (2048, 4096, 14336): Tiles(128, 256, 128, stages=4, tma=True, persistent=True, ws=True),
    (256, 6144, 4096): Tiles(64, 128, 128, warps=4, stages=4, group_m=8, split_k=1, tma=True),
    (2048, 6144, 4096): Tiles(128, 256, 128, stages=4, tma=True, persistent=True, ws=True),
    (256, 28672, 4096): Tiles(128, 128, 64, warps=4, stages=5, group_m=8, split_k=1, tma=True),
    (2048, 28672, 4096): Tiles(128, 256, 128, stages=3, tma=True, persistent=True, ws=True),
    (8192, 4096, 4096): Tiles(128, 256, 128, stages=4, tma=True, persistent=True, ws=True),
    (8192, 4096, 14336): Tiles(128, 256, 128, stages=3, tma=True, persistent=True, ws=True),
    (8192, 6144, 4096): Tiles(128, 256, 128, stages=4, tma=True, persistent=True, ws=True),
    (8192, 28672, 4096): Tiles(128, 128, 128, stages=4, tma=True, persistent=True, ws=True),
}


_MULTIPROCESSORS: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count, asked once a device (the persistent grid's size; a
    property query on every launch would cost host time in eager steps)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


def row_bucket(m: int) -> int:
    """The power of two a product of M rows is measured and tabled under."""
    return 1 << max(0, (m - 1).bit_length())


def choose_tiles(m: int, n: int, k: int, multiprocessors: int) -> Tiles | None:
    """The Triton GEMM's tiles for an [M, K] x [N, K] product, or None for cuBLASLt: MEASURED's
    entry for M's bucket where the sweep timed it; past DECODE_ROWS the entry of the smallest
    measured prefill bucket that holds M rows, else of the largest (the sweep times a few row
    counts, not every power of two); otherwise the rule's tiles. The rule's Triton GEMM beat
    cuBLASLt's _int_mm at 1 and 16 rows on all four of llama-8b's projections and at 64 rows on
    two (tied on one, 6% slower on the down projection), so no shape falls back to cuBLASLt
    unless the sweep says so."""
    exact = (row_bucket(m), n, k)
    if exact in MEASURED:
        return MEASURED[exact]
    if m > DECODE_ROWS:
        buckets = sorted(b for b, bn, bk in MEASURED if (bn, bk) == (n, k) and b > DECODE_ROWS)
        if buckets:
            bucket = next((b for b in buckets if b >= row_bucket(m)), buckets[-1])
            return MEASURED[(bucket, n, k)]
    return rule_tiles(m, n, k, multiprocessors)


def rule_tiles(m: int, n: int, k: int, multiprocessors: int) -> Tiles:
    """Tiles for a shape the sweep has not measured: up to 64 rows a row tile of the rows' size
    over 256 columns of K, K split in two while the programs do not fill the multiprocessors
    twice and a split keeps 4 K steps (the weights stream; idle multiprocessors read nothing);
    beyond, 128 x 256 tiles with 128 columns of K (48 KiB a stage, three stages in shared
    memory), the usual shape of a compute-bound int8 GEMM on the tensor cores."""
    if m > 128:
        return Tiles(128, 256, 128, warps=8, stages=3)
    if m > 64:
        return Tiles(64, 128, 128, warps=4, stages=4)
    block_m, block_n, block_k = (16 if m <= 16 else 64), 64, 256
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while programs * split < 2 * multiprocessors and k >= 8 * split * block_k:
        split *= 2
    return Tiles(block_m, block_n, block_k, warps=4, stages=4, split_k=split)


def int8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    tiles: Tiles,
    num_sms: int | None = None,
) -> torch.Tensor:
    """a [M, K] int8 with a_scale [M, 1] (or [M]) float32, weight [N, K] int8 with weight_scale
    [N] float32 -> [M, N] out_dtype: (a @ weight.T) * a_scale * weight_scale (+ bias), int32
    accumulation, one rounding, launched as ``tiles`` say. ``num_sms``: the persistent grid's
    size (default: the device's multiprocessors; the tests pass fewer so a program walks
    several tiles)."""
    m, k = a.shape
    n = weight.shape[0]
    if weight.shape[1] != k or a.dtype != torch.int8 or weight.dtype != torch.int8:
        raise ValueError(
            f"int8_gemm takes int8 [M, K] and [N, K], got {a.dtype} {tuple(a.shape)} and "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    a = a if a.stride(-1) == 1 else a.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    per_split = triton.cdiv(triton.cdiv(k, tiles.block_k), tiles.split_k) * tiles.block_k
    splits = triton.cdiv(k, per_split)  # at most split_k, none of them empty
    part = out
    if splits > 1:
        part = torch.empty((splits, m, n), dtype=torch.int32, device=a.device)
    a_scale, bias_or_any = a_scale.reshape(-1), bias if bias is not None else out
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), splits)
    tma = tiles.tma and all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, weight))
    if tma and tiles.persistent:  # (unaligned operands take the pointer kernel below)
        sms = num_sms if num_sms is not None else multiprocessors(a.device)
        use_descriptor_scratch(a.device)
        _int8_gemm_persistent_kernel[(min(grid[0], sms),)](
            a, weight, out, a_scale, weight_scale, bias_or_any, m, n, k, a.stride(0),
            weight.stride(0), out.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, LOG2_M=tiles.block_m.bit_length() - 1,
            LOG2_N=tiles.block_n.bit_length() - 1, GROUP_M=tiles.group_m,
            HAS_BIAS=bias is not None, NUM_SMS=sms, WS=tiles.ws, num_warps=tiles.warps,
            num_stages=tiles.stages,
        )  # fmt: skip
        return out
    a_arg, w_arg = a, weight
    if tma:
        a_arg = TensorDescriptor.from_tensor(a, [tiles.block_m, tiles.block_k])
        w_arg = TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k])
    _int8_gemm_kernel[grid](
        a_arg, w_arg, out, part, a_scale, weight_scale, bias_or_any,
        m, n, k, per_split, a.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, EVEN_K=k % tiles.block_k == 0, HAS_BIAS=bias is not None,
        SPLIT=splits > 1, TMA=tma, num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    if splits > 1:
        block_m, block_n = min(16, triton.next_power_of_2(m)), 256
        _sum_splits_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            part, out, a_scale, weight_scale, bias_or_any, m, n, out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return out
