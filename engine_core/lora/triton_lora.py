"""The LoRA product of a batch on CUDA: Triton kernels over a tile table, shrink then expand;
and a fused kernel of one launch a projection, which tables of up to FUSED_MAX_TILES tiles take
(none since it measured slower at decode; the benchmark still compares it).

A step's adapter rows come as tiles of up to ``TILE_ROWS`` rows of one slot
(``LoraBatch.tiles``, batch.py).

The fused kernel (a table of up to ``FUSED_MAX_TILES`` tiles: a decode graph's) is one launch
a projection: a program per tile and block of output columns of one shard (``fused_block_n``)
computes its tile's ``x[tile] @ A[slot, shard].T`` over the whole input itself, multiplies it
by its columns' rows of B and adds the product into the base projection's output in place. The
programs of one tile recompute the same shrink (a tile's x and the shard's A, read from L2
after the first), which costs reads of L2 rather than a second launch, its wait and a round
trip of the partial sums through memory; with a few tiles the GPU has room for that. On
Hopper everything but the read-add-store of the output runs before its PDL wait, while the base
projection finishes. A larger table (a prefill) would recompute the shrink for each of many
more programs: there the two kernels below do it once.

``shrink`` writes ``x[tile] @ A[slot].T`` into float32 partial
sums ``[splits, T, R]``, the reduction over the input split so that a decode step's few tiles
still fill the GPU (a program per tile, split and rank tile); ``expand`` sums the splits and
adds ``t[tile] @ B[slot].T`` into the base projection's output in place (a program per tile and
up to 512 output columns of one shard, in one product). The partial sums are added in a fixed
order, so a step's result does not depend on scheduling (atomics would). A program of a tile
whose slot is ``NO_SLOT`` returns at once (after its wait, below), and rows of the base model
are in no tile: never read or written.

On Hopper both are links of the decode chain of programmatic dependent launches
(engine_core/triton_pdl.py): the shrink becomes resident while the base projection before it
finishes and computes its product then (it reads x and A, which that kernel does not write),
storing only after its wait; the expand asks L2 for its rows of B before its wait. Every
program waits, those of unused tiles too, before it releases the kernel after it or returns,
so the chain's order holds for a step of the base model alone.

Graph-safe: the grids depend on the table's size (``tile_capacity`` of a graph's rows), the
projection's shape and the slots' rank, never on the step's mix of adapters, and the kernels
read the table, A and B from device tensors whose addresses stay put. A fused projection's
output rows of shard i (q, k, v; gate, up) read only its rank columns
``[i * rank, (i + 1) * rank)`` of B where the shard boundaries fall between expand programs
(they do on real models' shapes); the other columns are zeros (layers.py).

Tested against the torch reference (``layers.add_lora_reference``) on a GPU (tests/test_lora_gpu.py)
and through Triton's interpreter on the CPU (tests/test_lora_triton_interpreted.py, under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine_core.lora.batch import TILE_ROWS, LoraTiles
from engine_core.triton_pdl import chain_pdl, pdl_wait_then_release, prefetch_l2

# A decode step's shrink and expand are chains of dependent loads (the tile's slot and rows,
# then x and A, or the partial sums, B and the output), a few bytes each, so their time is
# round trips, not bytes: both load a tile's slot and rows together, the shrink cuts the input
# into many short splits (a program's loop one or two turns) and the expand loads up to
# EXPAND_SPLIT_LOADS partial sums at once and covers its output columns in one product and one
# read-add-store (docs/design/lora.md, "One launch a projection at decode").
BLOCK_K = 128  # the shrink's reduction tile
EXPAND_BLOCK_N = 64  # the expand's output columns come in runs of this many, all of one shard
EXPAND_INNER = 8  # runs an expand program covers at most: the splits' sum is read once for them
EXPAND_SPLIT_LOADS = 32  # partial sums an expand program loads at once
# B's tile in one expand product at most: large ranks take fewer runs, so no tile passes the one
# the kernel read a run at a time before (rank 256 x 64 columns in bf16).
EXPAND_TILE_BYTES = 32 * 1024
SPLIT_K = 128  # the least input columns per shrink program
SHRINK_PROGRAMS = 768  # shrink programs a step's table aims for (splits over its tiles)
MAX_SPLITS = 64
# Tables of up to this many tiles take the fused kernel (add_lora_tiles). None do: the pair was
# faster at every decode size measured (docs/design/lora.md, "Measured").
FUSED_MAX_TILES = 0
# Each fused program of a tile reads the tile's rows of x and its shard's A over the whole
# input: a tile has about this many input columns' worth of programs (16 at K = 4,096, 4 at
# 14,336), each of a power of two of output columns within the bounds below (fused_block_n),
# in sub-tiles of at most FUSED_SUBTILE_N columns (the registers of one product).
FUSED_TILE_READS = 65536
FUSED_MIN_BLOCK_N = 128
FUSED_MAX_BLOCK_N = 4096
FUSED_SUBTILE_N = 512
# The fused program's reduction tile: wide, so that one program keeps enough bytes in flight to
# stream its x and A (up to 0.7 MB for llama-8b's down projection) at a good share of L2's rate.
FUSED_BLOCK_K = 256


# Ints that change with the step's rows are not specialized on (their divisibility, == 1), so an
# eager step of a new size compiles nothing: only the shapes of the projections and slots do.
@triton.jit(do_not_specialize=["K_PER_SPLIT", "stride_ps"])
def _shrink_kernel(
    X,  # [T, K] the projection's input
    A,  # [S, R, K] each slot's stacked A
    Partial,  # [splits, T, R] float32, written
    TileSlots,  # [M] int32
    TileRows,  # [M * BLOCK_M] int32
    K,
    R,
    K_PER_SPLIT,
    stride_xm,
    stride_as,
    stride_ar,
    stride_ps,
    stride_pm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs multiplied as float32 (not TF32): the reference's
    PDL: tl.constexpr,  # a link of the decode chain (see the module's docstring)
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(TileSlots + tile)  # a step input, written at the step's start
    rows = tl.load(TileRows + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        pdl_wait_then_release(PDL)  # every program waits: the chain holds even for no rows
        return
    row_ok = rows >= 0
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < R
    a_base = A + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_begin + K_PER_SPLIT)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(
            X + rows[:, None] * stride_xm + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(a_base + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    # The product read x and A only, which the kernel just before (the base projection) does
    # not write: it ran while that kernel finished. Storing waits for it.
    pdl_wait_then_release(PDL)
    out = Partial + split * stride_ps + rows[:, None] * stride_pm + offs_n[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _expand_tile(t, b_slot, rank_cols, r_ok, offs_n, N, stride_bn, IEEE: tl.constexpr):
    """The shrunk rows ``t`` [M, R] times one slot's B rows ``offs_n`` at ``rank_cols``: the
    LoRA's output columns [M, BLOCK_N], float32."""
    b = tl.load(
        b_slot + offs_n[None, :] * stride_bn + rank_cols[:, None],
        mask=(offs_n < N)[None, :] & r_ok[:, None],
        other=0.0,
    )
    # The shrunk rows in the weights' dtype, as the torch form's two products leave them.
    return tl.dot(t, b, input_precision="ieee") if IEEE else tl.dot(t.to(b.dtype), b)


@triton.jit
def _add_into(Out, rows, row_ok, offs_n, N, stride_om, delta):
    """Out[rows, offs_n] += delta, added in float32 and rounded once to Out's dtype."""
    out = Out + rows[:, None] * stride_om + offs_n[None, :]
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    total = tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(out, total.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["SPLITS", "stride_ps"])
def _expand_kernel(
    Partial,  # [splits, T, R] float32
    B,  # [S, N, R] each slot's stacked B
    Out,  # [T, N] added to
    TileSlots,
    TileRows,
    N,
    SPLITS,
    RANK,  # rank columns an output tile reads (a shard's, or all R)
    SHARD1,  # the first output row of shard 1 (N where there is none)
    SHARD2,  # the first output row of shard 2 (N where there is none)
    stride_ps,
    stride_pm,
    stride_bs,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output columns per program, all of one shard
    BLOCK_K: tl.constexpr,  # >= RANK
    SPLIT_LOADS: tl.constexpr,  # splits read at once
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(TileSlots + tile)
    rows = tl.load(TileRows + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        pdl_wait_then_release(PDL)
        return
    row_ok = rows >= 0
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    n_first = tl.program_id(1) * BLOCK_N
    shard = (n_first >= SHARD1).to(tl.int32) + (n_first >= SHARD2).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_K)
    r_ok = offs_r < RANK
    offs_k = shard * RANK + offs_r
    b_slot = B + slot.to(tl.int64) * stride_bs
    if PDL:
        # This program's rows of B into L2 while the shrink finishes (B is no kernel's output).
        b_rows = n_first + tl.arange(0, BLOCK_N)
        prefetch_l2(b_slot + tl.minimum(b_rows, N - 1).to(tl.int64) * stride_bn + shard * RANK)
    pdl_wait_then_release(PDL)
    # The splits' sum, once for the program's output columns (a decode step reads it from L2
    # per program), SPLIT_LOADS splits' loads in flight at once rather than one L2 round trip
    # after another; added in split order all the same.
    t = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for first in range(0, SPLITS, SPLIT_LOADS):
        for i in tl.static_range(SPLIT_LOADS):
            live = r_ok & (offs_r * 0 + first + i < SPLITS)  # a vector: a mask must be one
            t += tl.load(
                Partial + (first + i) * stride_ps + rows[:, None] * stride_pm + offs_k[None, :],
                mask=row_ok[:, None] & live[None, :],
                other=0.0,
            )
    offs_n = n_first + tl.arange(0, BLOCK_N)
    delta = _expand_tile(t, b_slot, offs_k, r_ok, offs_n, N, stride_bn, IEEE)
    _add_into(Out, rows, row_ok, offs_n, N, stride_om, delta)


# Nothing here changes with the step's rows (the table's pointers keep their alignment): a
# projection's shapes and strides are fixed, so it compiles once per projection shape.
@triton.jit
def _fused_kernel(
    X,  # [T, K] the projection's input
    A,  # [S, R, K] each slot's stacked A
    B,  # [S, N, R] each slot's stacked B
    Out,  # [T, N] added to
    TileSlots,  # [M] int32
    TileRows,  # [M * BLOCK_M] int32
    K,
    N,
    RANK,  # rank columns a program reads (its shard's, or all R)
    SHARD1,  # the first output row of shard 1 (N where there is none)
    SHARD2,  # the first output row of shard 2 (N where there is none)
    stride_xm,
    stride_as,
    stride_ar,
    stride_bs,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output columns per sub-tile
    INNER: tl.constexpr,  # sub-tiles per program, all of one shard
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= RANK
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[tile's rows, program's columns] += (x[rows] @ A[slot, shard].T) @ B[slot, cols].T:
    shrink and expand in one program, the shrink recomputed by each program of a tile (see
    ``add_lora_fused``). The shrink and the first sub-tile's product run before the PDL wait
    (x, A and B are no output of the base projection just before), the later sub-tiles' rows
    of B asked of L2 then too."""
    tile = tl.program_id(0)
    slot = tl.load(TileSlots + tile)
    rows = tl.load(TileRows + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        pdl_wait_then_release(PDL)
        return
    row_ok = rows >= 0
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    n_first = tl.program_id(1) * (BLOCK_N * INNER)
    shard = (n_first >= SHARD1).to(tl.int32) + (n_first >= SHARD2).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    cols = shard * RANK + offs_r  # the shard's rank columns of A's rows and B's columns
    a_base = A + slot.to(tl.int64) * stride_as + cols[None, :] * stride_ar
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            X + rows[:, None] * stride_xm + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(a_base + offs_k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        t += tl.dot(x, a, input_precision="ieee") if IEEE else tl.dot(x, a)
    b_slot = B + slot.to(tl.int64) * stride_bs
    if PDL and INNER > 1:  # the program's rows of B (arange's length must be a power of two)
        b_rows = n_first + tl.arange(0, BLOCK_N * INNER)
        b_rows = tl.minimum(b_rows, N - 1).to(tl.int64)
        prefetch_l2(b_slot + b_rows * stride_bn + shard * RANK)
    for i in tl.static_range(INNER):
        offs_n = n_first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        delta = _expand_tile(t, b_slot, cols, r_ok, offs_n, N, stride_bn, IEEE)
        if i == 0:
            pdl_wait_then_release(PDL)  # out is the base projection's: read and written after
        _add_into(Out, rows, row_ok, offs_n, N, stride_om, delta)


def _block(width: int, most: int | None = None) -> int:
    """A power-of-two tile of at least 16 (tl.dot's least) covering ``width``, at most ``most``."""
    block = max(16, triton.next_power_of_2(width))
    return block if most is None else min(block, most)


def shrink_splits(k: int, tiles: int) -> tuple[int, int]:
    """(splits, input columns per split) of the shrink over ``k`` input columns for a table
    of ``tiles`` tiles: enough programs for a decode step's few tiles to fill the GPU, none
    with fewer than SPLIT_K columns, none past MAX_SPLITS (the expand reads every split)."""
    wanted = max(1, min(SHRINK_PROGRAMS // max(tiles, 1), MAX_SPLITS, triton.cdiv(k, SPLIT_K)))
    per_split = triton.cdiv(triton.cdiv(k, wanted), BLOCK_K) * BLOCK_K
    return triton.cdiv(k, per_split), per_split


class ExpandLayout(NamedTuple):
    rank: int  # rank columns an expand program reads (a shard's own, or all of them)
    shard1: int  # the first output row of shard 1 (the output's size where there is none)
    shard2: int  # the first output row of shard 2 (likewise)
    inner: int  # runs of EXPAND_BLOCK_N output columns per program


def expand_layout(output_sizes: tuple[int, ...], rank: int, width: int) -> ExpandLayout:
    """How the expand covers a projection whose shards are ``output_sizes`` with ``rank``
    columns each (``width`` in all): programs of up to EXPAND_INNER runs of EXPAND_BLOCK_N
    output columns that each read one shard's own rank columns, where the shard boundaries fall
    between programs; else programs that read all of them."""
    out = sum(output_sizes)
    starts = [sum(output_sizes[:i]) for i in range(1, len(output_sizes))]
    if len(starts) <= 2:
        for inner in (EXPAND_INNER, EXPAND_INNER // 2, EXPAND_INNER // 4, 1):
            if not any(start % (EXPAND_BLOCK_N * inner) for start in starts):
                padded = starts + [out] * (2 - len(starts))
                return ExpandLayout(rank, padded[0], padded[1], inner)
    return ExpandLayout(width, out, out, EXPAND_INNER)


def expand_columns(layout: ExpandLayout, element_bytes: int) -> int:
    """Output columns an expand program covers: the layout's runs, halved (which keeps the shard
    boundaries between programs) while B's tile, rank columns by output columns, would pass
    EXPAND_TILE_BYTES (a rank of 64 in bf16: 256 columns)."""
    inner = layout.inner
    while inner > 1 and _block(layout.rank) * EXPAND_BLOCK_N * inner * element_bytes > (
        EXPAND_TILE_BYTES
    ):
        inner //= 2
    return EXPAND_BLOCK_N * inner


class FusedLayout(NamedTuple):
    rank: int  # rank columns a fused program reads (its shard's own, or all of them)
    shard1: int  # the first output row of shard 1 (the output's size where there is none)
    shard2: int  # the first output row of shard 2 (likewise)
    block_n: int  # output columns per program

    @property
    def subtile(self) -> int:  # output columns per product (the kernel's BLOCK_N)
        return min(self.block_n, FUSED_SUBTILE_N)


def fused_block_n(n: int, k: int, tile_reads: int = FUSED_TILE_READS) -> int:
    """Output columns per fused program for a product of ``k`` input and ``n`` output columns:
    about ``tile_reads // k`` programs a tile (llama-8b: qkv 512, o 256, gate/up 2,048, down
    1,024 columns a program)."""
    programs = max(1, tile_reads // k)
    block_n = triton.next_power_of_2(triton.cdiv(n, programs))
    return max(FUSED_MIN_BLOCK_N, min(FUSED_MAX_BLOCK_N, block_n))


def fused_layout(output_sizes: tuple[int, ...], rank: int, width: int, block_n: int) -> FusedLayout:
    """How the fused kernel covers a projection whose shards are ``output_sizes`` with
    ``rank`` columns each (``width`` in all): programs of up to ``block_n`` output columns that
    each read one shard's own columns where the shard boundaries fall between programs (at 16
    columns at least, tl.dot's least); else programs that read all of them."""
    out = sum(output_sizes)
    starts = [sum(output_sizes[:i]) for i in range(1, len(output_sizes))]
    if len(starts) <= 2:
        n = block_n
        while n >= 16:
            if not any(start % n for start in starts):
                padded = starts + [out] * (2 - len(starts))
                return FusedLayout(rank, padded[0], padded[1], n)
            n //= 2
    return FusedLayout(width, out, out, block_n)


def add_lora_tiles(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tiles: LoraTiles,
    output_sizes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """out [T, O] += each tile's rows' x @ A[slot].T @ B[slot].T (x [T, I], a [S, R, I],
    b [S, O, R], R = shards * rank for ``output_sizes`` of the shards; None: one shard); rows in
    no tile are left as they are. A table of at most FUSED_MAX_TILES tiles (a decode graph's)
    takes the fused kernel, one launch; a larger one the shrink and the expand."""
    if tiles.count <= FUSED_MAX_TILES:
        return add_lora_fused(out, x, a, b, tiles, output_sizes)
    return add_lora_split(out, x, a, b, tiles, output_sizes)


def _checked(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if out.stride(1) != 1:
        raise ValueError("the LoRA expand adds into an output whose rows are contiguous")
    return x.contiguous(), a.contiguous(), b.contiguous()


def add_lora_fused(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tiles: LoraTiles,
    output_sizes: tuple[int, ...] | None = None,
    block_n: int | None = None,
    block_k: int = FUSED_BLOCK_K,
) -> torch.Tensor:
    """``add_lora_tiles`` by the fused kernel: a program per tile and ``block_n`` output
    columns (None: ``fused_block_n``), each computing its tile's shrink over the whole input
    itself, ``block_k`` input columns at a time."""
    x, a, b = _checked(out, x, a, b)
    k = x.shape[1]
    n = b.shape[1]
    width = a.shape[1]
    shards = output_sizes or (n,)
    block_n = block_n or fused_block_n(n, k)
    layout = fused_layout(tuple(shards), width // len(shards), width, block_n)
    ieee = x.dtype == torch.float32
    pdl = chain_pdl(x)
    subtile = layout.subtile
    _fused_kernel[(tiles.count, triton.cdiv(n, layout.block_n))](
        x, a, b, out, tiles.slots, tiles.rows, k, n, layout.rank, layout.shard1, layout.shard2,
        x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=TILE_ROWS, BLOCK_N=subtile, INNER=layout.block_n // subtile, BLOCK_K=block_k,
        BLOCK_R=_block(layout.rank), IEEE=ieee, PDL=pdl, launch_pdl=pdl,
        num_warps=8 if subtile >= 512 else 4,
    )  # fmt: skip
    return out


def add_lora_split(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tiles: LoraTiles,
    output_sizes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``add_lora_tiles`` by the shrink over splits of the input, then the expand."""
    x, a, b = _checked(out, x, a, b)
    rows, k = x.shape
    width = a.shape[1]
    shards = output_sizes or (b.shape[1],)
    layout = expand_layout(tuple(shards), width // len(shards), width)
    splits, per_split = shrink_splits(k, tiles.count)
    partial = torch.empty(splits, rows, width, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    pdl = chain_pdl(x)
    block_n = _block(width, 64)
    _shrink_kernel[(tiles.count, splits, triton.cdiv(width, block_n))](
        x, a, partial, tiles.slots, tiles.rows, k, width, per_split,
        x.stride(0), a.stride(0), a.stride(1), partial.stride(0), partial.stride(1),
        BLOCK_M=TILE_ROWS, BLOCK_N=block_n, BLOCK_K=BLOCK_K, IEEE=ieee, PDL=pdl,
        launch_pdl=pdl,
    )  # fmt: skip
    n = b.shape[1]
    expand_n = expand_columns(layout, b.element_size())
    _expand_kernel[(tiles.count, triton.cdiv(n, expand_n))](
        partial, b, out, tiles.slots, tiles.rows, n, splits, layout.rank, layout.shard1,
        layout.shard2, partial.stride(0), partial.stride(1), b.stride(0), b.stride(1),
        out.stride(0), BLOCK_M=TILE_ROWS, BLOCK_N=expand_n, BLOCK_K=_block(layout.rank),
        SPLIT_LOADS=EXPAND_SPLIT_LOADS, IEEE=ieee, PDL=pdl, launch_pdl=pdl,
        num_warps=8 if expand_n >= 256 else 4,
    )  # fmt: skip
    return out
