"""The W4A16 GEMM on CUDA: C = A @ W.T for activations A [M, K] (bf16/fp16) and a 4-bit weight in
the layout of engine_core/models/w4a16.py (qweight int32 [N, K / 8], scales float32 [G, N],
zeros uint8 [G, N] or none), the weight dequantized in registers, never written out.

One kernel for every row count. A program takes BLOCK_N weight rows and BLOCK_M activation rows
over a K range: it loads its weight words as one contiguous [BLOCK_N, BLOCK_K / 8] tile, shifts
the eight nibbles of each word out in registers (a [BLOCK_N, BLOCK_K / 8, 8] broadcast laid flat,
which is the packing's column order), takes its group's scale (and zero) once per row,
dequantizes ``(q - zero) * scale`` in float32, rounds it to the activations' dtype (the
reference's rounding) and multiplies on the tensor cores with the weight rows on the matrix
unit's wide side ("swap AB": at decode a few tokens fill its narrow side). Loading each word once
matters: a load per column (eight per word) ran the decode products about ten times slower.
Decode is memory-bound: the weights are a quarter of bf16's bytes, and a product with few weight
tiles splits K (SPLIT_K) so that every multiprocessor streams some; the float32 partials are
summed after. Prefill-sized products take 128-row tiles without a split.

Every shape here is static and nothing syncs with the host, so the decode steps' products are
captured in CUDA graphs. Shapes the kernel does not take (a K range no 16-column tile divides,
groups under 16 columns) are dequantized and multiplied by cuBLAS instead.

tests/test_w4a16_gpu.py checks it against the reference over the presets' shapes; `python -m
benchmarks gemm` times it against bf16 and the copy bandwidth. Importing this module imports
triton: only CUDA code paths and GPU tests may do so (or set ``TRITON_INTERPRET=1`` first to run
it on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

PACK = 8  # 4-bit values per int32 word (w4a16.PACK; not imported: w4a16 imports this module)
SYMMETRIC_ZERO = 8.0


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    A,  # [M, K]
    QWeight,  # [N, K / 8] int32
    Scales,  # [G, N] float32
    Zeros,  # [G, N] uint8 (unread without HAS_ZEROS)
    C,  # [M, N] (SPLIT_K == 1)
    Part,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1)
    M,
    N,
    K,
    stride_am,
    stride_cm,
    K_PER_SPLIT,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (row tile, weight tile, K split): the [BLOCK_N, BLOCK_M] tile of C.T over its K
    range. BLOCK_K divides GROUP (or GROUP is all of K), so a K tile lies in one group."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    words = K // 8
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k0 = split * K_PER_SPLIT
    shifts = tl.arange(0, 8) * 4  # nibble j of a word is column 8 * word + j
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w_ptrs = QWeight + rn[:, None].to(tl.int64) * words + rw[None, :]
        packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0)  # [BLOCK_N, BLOCK_K / 8] int32
        nibbles = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        q = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32)
        group = k0 // GROUP
        scale = tl.load(Scales + group * N + rn, mask=n_ok, other=0.0)  # [BLOCK_N]
        if HAS_ZEROS:
            zero = tl.load(Zeros + group * N + rn, mask=n_ok, other=0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 8.0, dtype=tl.float32)
        w = ((q - zero[:, None]) * scale[:, None]).to(A.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(w, tl.trans(a), input_precision=PRECISION)
        k0 += BLOCK_K
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        c_ptrs = C + rm[None, :].to(tl.int64) * stride_cm + rn[:, None]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)
    else:
        p_ptrs = Part + (split * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(p_ptrs, acc, mask=mask)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    stages: int = 4


def block_k_for(k: int, group: int, largest: int = 128) -> int | None:
    """The K tile: the largest power of two from ``largest`` down to 16 that divides K and the
    group (so a tile lies in one group); None where there is none."""
    for block in (b for b in (128, 64, 32, 16) if b <= largest):
        if k % block == 0 and (group >= k or group % block == 0):
            return block
    return None


def choose_tiles(m: int, n: int, k: int, group: int, multiprocessors: int) -> Tiles | None:
    """Tiles for an [M, K] x [N, K] product, or None where the kernel does not take it: rows in
    one tile up to 64 (decode, 128-column K tiles, K split until the programs cover the GPU
    twice over), 128-row tiles of 64 columns beyond. The sizes are within about 20% of the
    fastest of a sweep over llama-8b's projections (docs/design/quantization.md)."""
    block_k = block_k_for(k, group, 128 if m <= 64 else 64)
    if block_k is None:
        return None
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 128
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while (
        programs * split < 2 * multiprocessors
        and k % (2 * split * block_k) == 0
        and k // (2 * split) >= 2 * block_k
    ):
        split *= 2
    return Tiles(block_m, block_n, block_k, split)


def w4a16_gemm(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """a [M, K] @ W.T -> [M, N] in a's dtype, W given by the W4A16 layout."""
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = choose_tiles(a.shape[0], qweight.shape[0], a.shape[1], group_size, sms)
    return run_w4a16(a, qweight, scales, zeros, group_size, tiles)


def run_w4a16(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    tiles: Tiles | None,
) -> torch.Tensor:
    """``w4a16_gemm`` with the given tiles (None: the dequantized product)."""
    if tiles is None:
        return dequantized_product(a, qweight, scales, zeros, group_size)
    m, k = a.shape
    n = qweight.shape[0]
    if k % (tiles.split_k * tiles.block_k) or group_size % tiles.block_k and group_size < k:
        raise ValueError(f"{tiles} do not divide K={k} in groups of {group_size}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    part = out
    if tiles.split_k > 1:
        part = torch.empty((tiles.split_k, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    _w4a16_kernel[grid](
        a, qweight, scales, zeros if zeros is not None else scales, out, part, m, n, k,
        a.stride(0), out.stride(0), k // tiles.split_k, GROUP=group_size,
        HAS_ZEROS=zeros is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k, num_warps=4, num_stages=tiles.stages,
    )  # fmt: skip
    if tiles.split_k > 1:
        out.copy_(part.sum(0))  # float32 partials, rounded once
    return out


def dequantized_product(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """The products the kernel does not take: the weight dequantized whole, then cuBLAS."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=a.device)
    q = ((qweight[..., None] >> shifts) & 0xF).flatten(1).float()  # [N, K]
    zero = zeros.float() if zeros is not None else torch.full_like(scales, SYMMETRIC_ZERO)
    z = zero.t().repeat_interleave(group_size, dim=1)
    s = scales.t().repeat_interleave(group_size, dim=1)
    return F.linear(a, ((q - z) * s).to(a.dtype))
