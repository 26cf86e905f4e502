"""Triton attention kernels for the GPU path: KV-cache write, paged decode, speculative verify
and prefill attention. (The fused elementwise layers, RMSNorm, rotary and the activations, are
models/triton_ops.py.)

The attention kernels read the paged cache layout
``[num_blocks, block_size, kv_heads, head_dim]`` through a block table, so any block size works
and prefix-cached or chunked prefills need no copy. Scores, softmax statistics and the output
accumulator are float32; Q, K and V stay in the cache dtype (bf16 on the GPU) going into the
matrix units. An FP8 (e4m3) cache is written as K / k_scale and V / v_scale; its kernels
convert tiles exactly to a 16-bit float (prefill: the query's dtype; decode: float16, below),
fold k_scale into the softmax scale and multiply the output by v_scale, so the bf16 path
compiles as it did.

Decode (one query token per sequence) is memory-bound: a program owns one (sequence, context
split) and one or more neighbouring kv heads with all their query heads, so each K/V row is read
once per group. The launch shape (tokens per iteration, kv heads per program, warps, pipeline
stages) is tuned per head size, cache dtype and grid density (``decode_tile``). The number of
splits is a launch constant chosen from the batch size and the block table's width, never from
per-step device values, so a captured CUDA graph stays valid at any context length; each
sequence then uses only the splits its own length needs (at least default_min_split's each): the
others return at once, and a sequence that one split covers is written directly, with no
partials and no merge.
An FP8 cache's tiles are widened to float16 (one instruction per pair, where bf16 goes through
float32), q with them.

Where a decode step's sequences all open with the same pages (a shared system prompt), a
shared-prefix kernel attends every sequence's queries over those pages once, and the decode
kernel reads only each sequence's own pages, starting its softmax from those partials.

A speculative verify step (every sequence its last known token and K drafts) is decode with
K + 1 queries a sequence (``paged_verify_attention``): the same programs, splits and merge, the
K + 1 queries of the group's heads as the tile's rows, each seeing the keys up to its own.

Importing this module imports triton: only the CUDA branches of the model runner and of
models/layers.py (and GPU tests) may do so. Set ``TRITON_INTERPRET=1`` before the import to run
these kernels on CPU tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_core.attention.base import ORDERED_DECODE_MIN_ROWS, is_fp8_cache
from engine_core.attention.prefill_tiles import device_tiles, prefill_block_m
from engine_core.triton_descriptors import use_descriptor_scratch
from engine_core.triton_pdl import chain_pdl, pdl_wait_then_release

LOG2E = 1.4426950408889634
# Decode context splits: a split is never shorter than MIN_SPLIT_TOKENS (shorter pieces cost
# more in partial writes and the merge than they gain in parallelism), and there are enough of
# them for PROGRAMS_PER_SM programs per multiprocessor, up to MAX_SPLITS (at 64 sequences of 256
# tokens one split beat two by 10-15% for llama-1b, llama-8b and smollm2). Where the unsplit
# grid has at most one program a multiprocessor (small batches), STARVED_MIN_SPLIT_TOKENS
# instead: there the idle multiprocessors outweigh the merge (batch 1-16 of 128-4,096 tokens,
# head size 128: 64 against 256 took 7.6-16.2 us a call against 12.4-18.7 at 384-1,024 tokens,
# ties elsewhere but one point 4% slower; docs/design/kernels-and-limits.md, "Decode
# attention").
MIN_SPLIT_TOKENS = 256
STARVED_MIN_SPLIT_TOKENS = 64
# Between the two, grids of more than one and fewer than PROGRAMS_PER_SM unsplit programs a
# multiprocessor take THIN_MIN_SPLIT_TOKENS: a short context then runs in two splits where 256
# left it in one. In the engine's decode graphs that was never slower and up to 8% faster
# (smollm2 at batch 64 and 160 tokens: 835 -> 774 us a step; under 3% or even at the other
# batches and contexts of smollm2, llama-1b and llama-8b; docs/design/kernels-and-limits.md,
# "Decode attention").
THIN_MIN_SPLIT_TOKENS = 128
PROGRAMS_PER_SM = 2
# From PROGRAMS_PER_SM to SPARSE_SPLIT_PROGRAMS_PER_SM unsplit programs a multiprocessor (llama-8b
# at 33-49 sequences on 132 multiprocessors), SPARSE_SPLITS splits: a served batch's lengths
# spread from a few dozen tokens to a few thousand, and unsplit, the longest rows' programs end
# the launch alone. H100, llama-8b, µs a call, 1 split against 4: 36 / 40 / 48 rows spread over
# 64-2,400 / 64-2,560 tokens 91.5 -> 72.4, 101.9 -> 84.0, 109.7 -> 98.8; 40 / 48 rows of 1,312
# tokens each 83.5 -> 82.4, 96.2 -> 96.3 (docs/design/kernels-and-limits.md, "Batches of mixed
# lengths"); short contexts pay 2-3 µs (512 / 256 tokens at 40 / 44 rows: 35.4 -> 38.5, 20.2 ->
# 22.4). At 64 rows 4 splits cost 7% on one length (118.4 -> 126.4) for 2% on spread ones. The
# verify and MLA decode launches take the same rule (not measured there).
SPARSE_SPLIT_PROGRAMS_PER_SM = 3
SPARSE_SPLITS = 4
MAX_SPLITS = 64


# ---- KV-cache write ----------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOTS,
    stride_kt,
    stride_vt,
    stride_kcb,
    stride_kcs,
    stride_vcb,
    stride_vcs,
    k_scale_inv,
    v_scale_inv,
    PAGE: tl.constexpr,
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
    QUANTIZE: tl.constexpr,  # an FP8 cache: store clamp(x / scale), e4m3
    PDL: tl.constexpr,
):
    token = tl.program_id(0)
    # The slots are a step input, no output of the kernel just before: read while it finishes
    # (engine_core/triton_pdl.py).
    slot = tl.load(SLOTS + token).to(tl.int64)
    pdl_wait_then_release(PDL)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        k = tl.load(K + token * stride_kt + cols, mask=mask)
        v = tl.load(V + token * stride_vt + cols, mask=mask)
        k_dst = KC + block * stride_kcb + offset * stride_kcs + cols
        v_dst = VC + block * stride_vcb + offset * stride_vcs + cols
        _store_cache_row(k_dst, k, mask, k_scale_inv, QUANTIZE)
        _store_cache_row(v_dst, v, mask, v_scale_inv, QUANTIZE)


def write_kv_cache(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter each token's K and V rows into cache slot ``slot_mapping[t]``; an FP8 cache
    stores them divided by their scales, rounded to e4m3."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    _check_cache(k_cache)
    _check_cache(v_cache)
    row = k.shape[1] * k.shape[2]
    pdl = chain_pdl(k)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        PAGE=k_cache.shape[1],
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        QUANTIZE=is_fp8_cache(k_cache),
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=_row_warps(row),
    )


@triton.jit
def rotated_halves(p1, mask, cos, sin, HALF: tl.constexpr):
    """Rotate-half of the values at p1 (first halves) and p1 + HALF: (x1 cos - x2 sin,
    x2 cos + x1 sin) in float32. Shared with models/triton_ops.py's rotary kernels."""
    f1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    f2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    return f1 * cos - f2 * sin, f2 * cos + f1 * sin


@triton.jit
def rotate_in_place(X, h, d, stride_h, cos, sin, mask, HALF: tl.constexpr):
    """Rotate-half, in place, heads h (rows stride_h apart) of the row at X over dims d."""
    p1 = X + h * stride_h + d
    y1, y2 = rotated_halves(p1, mask, cos, sin, HALF)
    tl.store(p1, y1.to(p1.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, y2.to(p1.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    Q,
    K,
    V,
    KC,
    VC,
    SLOTS,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_ct,
    stride_st,
    stride_kcb,
    stride_kcs,
    stride_vcb,
    stride_vcs,
    k_scale_inv,
    v_scale_inv,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # half the rotary dims (all of the head's, or its leading ones)
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,  # the dims past the rotary ones (partial rotary), else 0
    PAGE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, part): part 0 rotates q's heads in place; part 1 rotates k's heads and
    writes them, with v's row, to the token's cache slot (none for slot -1, a padding row), FP8
    caches as _write_kv_kernel. Two programs a token, as the two kernels it replaces had one
    each: a program doing both took longer than the pair for llama-8b's 32 query heads."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    # cos/sin and the slots are no output of the kernel just before (the qkv product): read
    # them while it finishes (engine_core/triton_pdl.py).
    cos = tl.load(Cos + token * stride_ct + d, mask=d_mask).to(tl.float32)  # [1, HALF]
    sin = tl.load(Sin + token * stride_st + d, mask=d_mask).to(tl.float32)  # halves are equal
    slot = tl.load(SLOTS + token)
    pdl_wait_then_release(PDL)
    if tl.program_id(1) == 0:
        rotate_in_place(Q + token * stride_qt, h, d, stride_qh, cos, sin, (h < Q_HEADS) & d_mask,
                        HALF)  # fmt: skip
    elif slot >= 0:
        k_src = K + token * stride_kt + h * stride_kh
        k_mask = (h < K_HEADS) & d_mask
        k_dst = KC + (slot // PAGE) * stride_kcb + (slot % PAGE) * stride_kcs + h * HEAD_DIM
        y1, y2 = rotated_halves(k_src + d, k_mask, cos, sin, HALF)
        # Rounded to k's dtype first, as the separate rotary's output is before the write.
        y1 = y1.to(K.dtype.element_ty)
        y2 = y2.to(K.dtype.element_ty)
        _store_cache_row(k_dst + d, y1, k_mask, k_scale_inv, QUANTIZE)
        _store_cache_row(k_dst + HALF + d, y2, k_mask, k_scale_inv, QUANTIZE)
        if BLOCK_REST > 0:  # partial rotary: the rest of each head goes in as it is
            rest = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
            rest_mask = (h < K_HEADS) & (rest < HEAD_DIM)
            k_rest = tl.load(k_src + rest, mask=rest_mask, other=0.0)
            _store_cache_row(k_dst + rest, k_rest, rest_mask, k_scale_inv, QUANTIZE)
        cols = tl.arange(0, BLOCK_V)
        v_mask = cols < K_HEADS * HEAD_DIM
        v = tl.load(V + token * stride_vt + cols, mask=v_mask)
        v_dst = VC + (slot // PAGE) * stride_vcb + (slot % PAGE) * stride_vcs + cols
        _store_cache_row(v_dst, v, v_mask, v_scale_inv, QUANTIZE)


@triton.jit
def _store_cache_row(ptrs, x, mask, scale_inv, QUANTIZE: tl.constexpr):
    """Store x into the cache: rounded to its dtype, an FP8 cache's divided by its scale (in
    float32) and clamped to e4m3's range first."""
    tl.store(ptrs, as_cached(x, scale_inv, ptrs.dtype.element_ty, QUANTIZE), mask=mask)


@triton.jit
def as_cached(x, scale_inv, dtype: tl.constexpr, QUANTIZE: tl.constexpr):
    """x as a cache of ``dtype`` holds it (see _store_cache_row)."""
    if QUANTIZE:
        x = tl.clamp(x.to(tl.float32) * scale_inv, -448.0, 448.0)
    return x.to(dtype)


@triton.jit
def _rotated_rows(rows, d, mask, cos, sin, HALF: tl.constexpr):
    """Rotate-half of the rows at ``rows`` [R, 1] (pointers) over dims ``d`` [D], float32: the
    first 2 * HALF dims rotated as rotated_halves computes them (the same expression for each
    half), the rest as they are. ``cos``/``sin`` [D] hold each dim's angle (dims past the
    rotary ones: 1 and 0)."""
    first = (d < HALF)[None, :]
    in_rot = (d < 2 * HALF)[None, :]
    partner = tl.where(d < HALF, d + HALF, d - HALF)[None, :]
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.load(rows + partner, mask=mask & in_rot, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    y = tl.where(first, x * c - p * s, x * c + p * s)
    return tl.where(in_rot, y, x)


def rotary_write_kv_cache(
    q: torch.Tensor,  # [T, heads, head_dim], rows may be strided (a view of the qkv projection)
    k: torch.Tensor,  # [T, kv_heads, head_dim], not yet rotated
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [T, R], R <= head_dim (both halves equal, as RotaryEmbedding builds them)
    sin: torch.Tensor,  # [T, R]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotary embedding (rotate-half over the first R dims of each head) and the KV-cache write
    in one launch: q rotated in place, k rotated into the cache, v copied there; what
    ``rotary_inplace`` and ``write_kv_cache`` do in two (one launch fewer per layer of a
    decode step, whose launches are its cost on small models)."""
    num_tokens, q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    v = _rows_contiguous(v)
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("rotary_write_kv_cache needs the head dim contiguous")
    rot = cos.shape[1]
    if rot % 2 or rot > head_dim:
        raise ValueError(f"rotary over {rot} dims of a {head_dim}-dim head")
    _check_cache(k_cache)
    _check_cache(v_cache)
    kv_heads = k.shape[1]
    pdl = chain_pdl(q)
    _rotary_write_kv_kernel[(num_tokens, 2)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), cos.stride(0),
        sin.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        Q_HEADS=q_heads, K_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=rot // 2,
        BLOCK_H=triton.next_power_of_2(max(q_heads, kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(rot // 2),
        BLOCK_REST=triton.next_power_of_2(head_dim - rot) if rot < head_dim else 0,
        PAGE=k_cache.shape[1], BLOCK_V=triton.next_power_of_2(kv_heads * head_dim),
        QUANTIZE=is_fp8_cache(k_cache), PDL=pdl, launch_pdl=pdl,
        num_warps=4 if q_heads * head_dim >= 2048 else 2,
    )  # fmt: skip


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads*D values contiguous (a row may be a strided view)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _check_cache(cache: torch.Tensor) -> None:
    if cache.stride(3) != 1 or cache.stride(2) != cache.shape[3]:
        raise ValueError("the KV cache must be contiguous within a slot ([kv_heads, head_dim])")


def _row_warps(row: int) -> int:
    return 4 if row >= 2048 else (2 if row >= 512 else 1)


# ---- shared online-softmax step ----------------------------------------------------------------


@triton.jit
def softmax_step(s, m_i, l_i, acc, v, PRECISION: tl.constexpr, USE_DOT: tl.constexpr):
    """Fold one tile of base-2 scores ``s`` [M, N] (-inf where masked) and its V [N, D] into the
    running max ``m_i`` [M], sum ``l_i`` [M] and accumulator ``acc`` [M, D]; safe for rows whose
    scores are all -inf so far."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# ---- paged decode attention --------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeTile:
    """Launch shape of the decode kernel: tokens per loop iteration, kv heads per program, warps
    and software-pipeline stages.

    A program takes ``kv_per_program`` neighbouring kv heads (fewer where the kv head count is
    not a multiple, or where their query heads would overflow a 16-row tile): their slices of a
    cache row are adjacent, so a tile reads 128-512 contiguous bytes per token instead of one
    head's 64-256 bytes of rows that sit 0.5-2 KiB apart, and their query heads share the 16-row
    matrix-unit tile that one GQA group leaves mostly empty."""

    block_n: int
    num_warps: int
    num_stages: int
    kv_per_program: int = 1


# The best geometric mean of a kernel-alone sweep over batch 1-256 and context 512-8192 of
# llama-1b (GQA 32/8, head dim 64) and llama-8b (32/8, 128) (docs/design/kernels-and-limits.md,
# "Decode attention"). Keyed by (head_dim, FP8 cache). Two kv heads per program won only for
# e4m3 at head dim 64, whose 64-byte slices are the smallest reads; elsewhere the halved
# program count cost more than it gained.
_DECODE_TILES: dict[tuple[int, bool], DecodeTile] = {
    (64, False): DecodeTile(block_n=128, num_warps=4, num_stages=2),
    (64, True): DecodeTile(block_n=64, num_warps=4, num_stages=2, kv_per_program=2),
    (128, False): DecodeTile(block_n=64, num_warps=4, num_stages=2),
    (128, True): DecodeTile(block_n=64, num_warps=2, num_stages=3),
}


# Where one program per sequence and kv head already fills the GPU WIDE_GRID_WAVES times over
# (batch x kv heads >= WIDE_GRID_WAVES x multiprocessors: llama-1b and llama-8b from batch 128
# on 132 multiprocessors), two kv heads a program read 128-256 contiguous bytes a token at no
# cost in parallelism. At batch 128 and 256 over 256-2,048 tokens: llama-1b 79-95% of the copy
# bandwidth with the tiles above, 82-100% with its wide tile; llama-8b 89-101%, 90-101%
# (docs/design/kernels-and-limits.md, "Decode attention"). At batch 64 the two were even (the
# earlier short-context sweep). bf16 caches only: FP8's head-dim-64 tile takes two kv heads a
# program already, and its head-dim-128 points were not swept.
WIDE_GRID_WAVES = 6
_WIDE_DECODE_TILES: dict[tuple[int, bool], DecodeTile] = {
    (64, False): DecodeTile(block_n=64, num_warps=4, num_stages=3, kv_per_program=2),
    (128, False): DecodeTile(block_n=32, num_warps=4, num_stages=2, kv_per_program=2),
}


# Where one program per sequence and kv head gives each multiprocessor more than one and at most
# SPARSE_GRID_PROGRAMS_PER_SM, some model shapes take their own tile, keyed by (head dim, FP8
# cache, kv heads). Measured in the engine's decode graphs, us a replay
# (docs/design/kernels-and-limits.md, "Decode attention"):
# - smollm2 (head dim 64, 3 kv heads) takes 64 tokens, 2 warps and 3 stages. At batch 64 over
#   160, 256, 384 and 1,024 tokens: 774 -> 771, 825 -> 797, 908 -> 879, 1240 -> 1226; at batch
#   48 and 256 tokens 759 -> 751. At batch 80 (1.8 programs a multiprocessor) it lost, 901 -> 905.
# - llama-1b (head dim 64, 8 kv heads) lost with the same tile, in its sparse grids too: at batch
#   24 1124 -> 1134 at 256 tokens and 1331 -> 1362 at 1,024 (at batch 32, 1437 -> 1494 at 1,024).
#   So the entry is smollm2's shape only.
SPARSE_GRID_PROGRAMS_PER_SM = 1.5
_SPARSE_DECODE_TILES: dict[tuple[int, bool, int], DecodeTile] = {
    (64, False, 3): DecodeTile(block_n=64, num_warps=2, num_stages=3),
}


def decode_tile(
    head_dim: int, kv_fp8: bool, grid: str = "default", num_kv_heads: int = 0
) -> DecodeTile:
    """The tuned launch shape for a head size and cache dtype (head dims between the tuned ones
    take the next larger one's), a grid density (``decode_grid``) and, in sparse grids, the
    kv head count."""
    tuned = min((d for d, _ in _DECODE_TILES if head_dim <= d), default=max(_DECODE_TILES)[0])
    default = _DECODE_TILES[(tuned, kv_fp8)]
    if grid == "wide":
        return _WIDE_DECODE_TILES.get((tuned, kv_fp8), default)
    if grid == "sparse":
        return _SPARSE_DECODE_TILES.get((tuned, kv_fp8, num_kv_heads), default)
    return default


def decode_grid(batch: int, num_kv_heads: int, device: torch.device) -> str:
    """How densely one program per sequence and kv head fills the GPU: "wide" where it gives
    every multiprocessor at least WIDE_GRID_WAVES of them, "sparse" where more than one and at
    most SPARSE_GRID_PROGRAMS_PER_SM, "default" else."""
    programs, sms = batch * num_kv_heads, _num_sms(device)
    if programs >= WIDE_GRID_WAVES * sms:
        return "wide"
    if sms < programs <= SPARSE_GRID_PROGRAMS_PER_SM * sms:
        return "sparse"
    return "default"


@triton.jit
def split_bounds(
    seq_len,
    window,
    chunk,
    num_splits,
    min_split,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
):
    """A sequence's split length (a multiple of BLOCK_N), the first key it attends to (the
    window's first, or the start of the query's attention chunk), and the first and last splits
    that overlap [lo, seq_len). Splits outside that range do nothing; a sequence covered by one
    split (or empty) is written by that split alone, with no merge."""
    split_len = tl.maximum(tl.cdiv(seq_len, num_splits), min_split)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    if HAS_CHUNK:  # the query (at seq_len - 1) sees from its chunk's start on
        query = tl.maximum(seq_len - 1, 0)
        lo = tl.maximum(lo, query - query % chunk)
    first = lo // split_len
    last = tl.maximum(seq_len - 1, 0) // split_len
    return split_len, lo, first, last


@triton.jit
def store_split(
    Out, PO, PL, out, m_i, l_i, seq, heads, cols, mask, head_mask, split, first, last,
    num_heads, num_splits, stride_ot, stride_oh, WIDTH: tl.constexpr,
):  # fmt: skip
    """A decode split's result: the output row itself where this split is the sequence's only
    one, else its partial [B, heads, splits, WIDTH] and log2-sum-exp [B, heads, splits] for
    merge_partials (the one layout every split-K decode kernel writes and the merge reads)."""
    if first == last:
        o_ptr = Out + seq * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask)
    else:
        part = (seq * num_heads + heads) * num_splits + split
        store_partial(PO, PL, out, m_i, l_i, part, cols, mask, head_mask, WIDTH)


@triton.jit
def store_partial(PO, PL, out, m_i, l_i, part, cols, mask, head_mask, WIDTH: tl.constexpr):
    """Rows ``part`` [H] of the split-K partial layout: each row's normalized output and its
    base-2 log-sum-exp (-inf for a row that saw no key)."""
    tl.store(PO + part[:, None] * WIDTH + cols[None, :], out, mask=mask)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(PL + part, lse, mask=head_mask)


# window == 1 or a split count of 1 must stay runtime values: Triton's specialization of an
# argument equal to 1 made the window's bounds constant-fold into IR that its coalescing pass
# asserts on (Triton 3.6). stride_bt (the step's widest block table) stays one too: specialized,
# every width class (1, a multiple of 16, other) would compile its own variant, mid-serving, the
# first time an eager step has it (see _prefill_kernel).
@triton.jit(
    do_not_specialize=["window", "chunk", "min_split", "num_splits", "shared_splits", "stride_bt"]
)
def _decode_kernel(
    Q,
    KC,
    VC,
    BT,
    SL,
    Out,
    PO,
    PL,
    KN,  # ROPE: the new token's k [B, kv heads, D], not yet rotated
    VN,  # ROPE: its v
    COS,  # ROPE: [B, 2 * HALF] (both halves equal)
    SIN,
    SLOTS,  # ROPE: [B] its cache slot (-1: none)
    SINKS,  # HAS_SINKS: [heads] float32, each head's sink logit times log2(e)
    QSL,  # MIXED: [B + 1] the step's query starts
    SHARED,  # HAS_SHARED: [2] the tokens of the pages every sequence opens with, and a row
    SPO,  # HAS_SHARED: the shared-prefix kernel's partials [B, heads, shared splits, D]
    SPL,  # HAS_SHARED: and their log2-sum-exps [B, heads, shared splits]
    ORDER,  # HAS_ORDER: [B] the sequence each launch index takes, in the order they start
    scale_log2,
    v_scale,
    k_scale_inv,
    v_scale_inv,
    window,
    chunk,  # HAS_CHUNK: Llama 4's attention chunk
    min_split,
    num_splits,
    shared_splits,  # HAS_SHARED: the shared-prefix kernel's splits
    num_heads,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cos,
    stride_sin,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    KPP: tl.constexpr,  # kv heads per program
    BLOCK_H: tl.constexpr,  # >= GROUP * KPP query rows
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per iteration; the K/V tiles have BLOCK_N * KPP rows
    HAS_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    PDL: tl.constexpr,
    ROPE: tl.constexpr,  # q and the new token's k come unrotated; this kernel writes its k, v
    HALF: tl.constexpr,  # ROPE: half the rotary dims
    HAS_SINKS: tl.constexpr = False,  # gpt-oss: a sink logit per head joins the denominator
    HAS_CHUNK: tl.constexpr = False,  # chunked local attention: keys from the chunk's start
    MIXED: tl.constexpr = False,  # a step with prompt rows: attend its one-token sequences only
    HAS_SHARED: tl.constexpr = False,  # the shared pages were attended by _shared_prefix_kernel
    SHARED_N: tl.constexpr = 64,  # HAS_SHARED: that kernel's BLOCK_N
    HAS_ORDER: tl.constexpr = False,  # the sequences start in ORDER's order, not the batch's
):
    """Attention of a sequence's last token over its cache. With ROPE (a decode step's rotary
    and KV write in the same launch, rotary_decode_attention) it also rotates q and the new
    token's k, has the split that holds the new token write its k and v to the cache, and
    attends to it from registers: the cache loop reads only the earlier tokens. With
    HAS_SHARED it reads each sequence's pages past the shared ones only, as a sequence of its
    own, and the split that opens it starts from the shared-prefix kernel's partials."""
    # The kv heads of one (sequence, split) are neighbours in launch order, so programs that
    # run together read the same cache rows.
    kv0 = tl.program_id(0) * KPP
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if HAS_ORDER:  # programs start roughly in launch order: ORDER decides which rows go first
        seq = tl.load(ORDER + seq)
    # The sequence's length and block table are step inputs, not outputs of the kernel just
    # before (the KV write): read them, and the first tile's blocks, while it finishes
    # (engine_core/triton_pdl.py). q and the new token's K/V come after the wait.
    seq_len = tl.load(SL + seq)
    row, decodes = seq, True
    if MIXED:  # its query row, and nothing to do (no store) unless it has one new token
        row, seq_len, decodes = _mixed_row(QSL, seq, seq_len)
    shared = seq_len * 0
    if HAS_SHARED:  # the sequence's own pages only, from its table's first unshared column
        shared = step_shared_len(SHARED, seq_len)
        seq_len = seq_len - shared
    split_len, lo, first, last = split_bounds(
        seq_len, window, chunk, num_splits, min_split, BLOCK_N, HAS_WINDOW, HAS_CHUNK
    )
    start = tl.maximum(split * split_len, lo)
    end = tl.minimum(split * split_len + split_len, seq_len)
    d = tl.arange(0, BLOCK_D)
    has_new = False
    if ROPE:
        # The new token (the last) is not in the cache yet: the split that holds it takes it
        # from registers before its loop, which stops short of it. Its angles and slot are
        # step inputs (read before the wait); dims past the rotary ones turn by nothing.
        has_new = (end == seq_len) & (seq_len > 0)
        end = end - has_new.to(end.dtype)
        in_rot = d < 2 * HALF
        cos = tl.load(COS + seq * stride_cos + d % HALF, mask=in_rot, other=1.0).to(tl.float32)
        sin = tl.load(SIN + seq * stride_sin + d % HALF, mask=in_rot, other=0.0).to(tl.float32)
        slot = tl.load(SLOTS + seq)
    # Tile row r holds token r // KPP of kv head kv0 + r % KPP: for KPP > 1 a token's heads are
    # adjacent rows, as they are adjacent in the cache.
    r = tl.arange(0, BLOCK_N * KPP)
    bt_row = BT + seq.to(tl.int64) * stride_bt + shared // PAGE
    next_tok = start + r // KPP
    next_blk = tl.load(bt_row + next_tok // PAGE, mask=next_tok < end, other=0)
    pdl_wait_then_release(PDL)
    if (split >= first) & (split <= last):
        rows = tl.arange(0, BLOCK_H)
        heads = kv0 * GROUP + rows
        row_mask = rows < GROUP * KPP
        row_kv = rows // GROUP  # which of the program's kv heads a query row reads
        d_mask = d < HEAD_DIM
        if MIXED:
            row_mask = tl.where(decodes, row_mask, False)
        q_mask = row_mask[:, None] & d_mask[None, :]
        q_rows = Q + row * stride_qt + heads[:, None] * stride_qh
        if ROPE:  # rounded to q's dtype, as the rotary kernels store it
            q = _rotated_rows(q_rows, d, q_mask, cos, sin, HALF).to(Q.dtype.element_ty)
        else:
            q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)  # [H, D]
        if FP8_AS_F16:
            # e4m3 widens to float16 in one instruction per pair (to bf16 through float32),
            # both exactly. float16 holds bf16's 8-bit mantissa between 6e-5 and 65504: q is
            # clamped to that top, and entries under it lose bits, not weight in the dot.
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

        r_kv = r % KPP
        same_kv = row_kv[:, None] == r_kv[None, :]  # [H, N * KPP]
        if ROPE:
            # The new token opens the softmax (its loads go out with q's, its cache write
            # before the loop): in the program of the split that holds it, all others start
            # empty. The cache's tiles fold in after it.
            m_i, l_i, acc = _open_with_new_token(
                q, KN + seq * stride_knt, VN + seq * stride_vnt, stride_knh, stride_vnh,
                KC + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks,
                VC + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs,
                stride_kh, stride_vh, has_new, slot >= 0, kv0 + row_kv, row_mask,
                rows % GROUP == 0, d, d_mask, cos, sin, scale_log2, k_scale_inv, v_scale_inv,
                HALF, KV_FP8,
            )  # fmt: skip
        else:
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        # Nested: a constexpr and a runtime value do not mix in one Triton condition.
        if HAS_SHARED:  # noqa: SIM102
            if (split == first) & (shared > 0):
                used = tl.cdiv(shared, shared_split_len(shared, shared_splits, SHARED_N))
                parts = (seq * num_heads + heads) * shared_splits
                m_i, l_i, acc = fold_partials(
                    SPO, SPL, parts, used, row_mask, d, d_mask, m_i, l_i, acc, HEAD_DIM
                )
        for _ in range(start, end, BLOCK_N):
            tok = next_tok
            n_mask = tok < end
            blk = next_blk.to(tl.int64)
            # The next tile's blocks, asked for before this tile's K/V are used.
            next_tok = tok + BLOCK_N
            next_blk = tl.load(bt_row + next_tok // PAGE, mask=next_tok < end, other=0)
            in_page = tok % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_row = blk * stride_kb + in_page * stride_ks + (kv0 + r_kv) * stride_kh
            k = tl.load(KC + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N*KPP, D]
            v_row = blk * stride_vb + in_page * stride_vs + (kv0 + r_kv) * stride_vh
            v = tl.load(VC + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N*KPP, D]
            if KV_FP8:  # exact in q's dtype; the K scale is in scale_log2, the V scale applied last
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if USE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [H, N*KPP]
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
            # A query row sees its own kv head's rows only: the others weigh exactly 0 in P @ V.
            visible = n_mask[None, :]
            if KPP > 1:
                visible = visible & same_kv
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, USE_DOT)

        # Nested: a constexpr and a runtime value do not mix in one Triton condition. A
        # split's partial leaves the sink to the merge.
        if HAS_SINKS:  # noqa: SIM102
            if first == last:
                m_i, l_i, acc = _add_sink(SINKS + heads, row_mask, m_i, l_i, acc)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]  # [H, D]; zeros for an empty (padding) row
        if KV_FP8:
            out = out * v_scale
        # Out's row is the query's (seq's own but in MIXED steps); partials stay per sequence.
        store_split(
            Out + (row - seq) * stride_ot, PO, PL, out, m_i, l_i, seq, heads, d, q_mask,
            row_mask, split, first, last, num_heads, num_splits, stride_ot, stride_oh, HEAD_DIM,
        )  # fmt: skip


@triton.jit
def _mixed_row(QSL, seq, seq_len):
    """A MIXED step's sequence: its first query row, its length where it has exactly one new
    token (else 0: nothing to attend), and whether it has (only those rows are stored)."""
    row = tl.load(QSL + seq)
    decodes = tl.load(QSL + seq + 1) - row == 1
    return row, tl.where(decodes, seq_len, 0), decodes


@triton.jit
def _open_with_new_token(
    q,
    k_new,
    v_new,
    stride_knh,
    stride_vnh,
    k_slot,
    v_slot,
    stride_kh,
    stride_vh,
    has_new,
    has_slot,
    kv_head,
    row_mask,
    writer,
    d,
    d_mask,
    cos,
    sin,
    scale_log2,
    k_scale_inv,
    v_scale_inv,
    HALF: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """A ROPE decode program's online-softmax state (max, sum, accumulator) after the new
    token alone, for the query rows of ``q`` [H, D] (``row_mask`` [H]: the real ones) when the
    program's split holds it (``has_new``; otherwise every row starts empty): its k rotated and
    rounded to k's dtype, k and v as the cache holds them, written to the slot (when it
    ``has_slot``) by the first query row of each kv head (``writer``). ``kv_head`` [H]: the kv
    head each row reads. A lone key's probability is 1, so the accumulator is its v: the loop's
    tiles then fold in after it."""
    # Scalar conditions join the row masks through tl.where: Triton's interpreter (the CPU
    # tests) refuses a mask built with & from a scalar comparison.
    rows_new = tl.where(has_new, row_mask, False)
    mask = rows_new[:, None] & d_mask[None, :]
    k_rows = k_new + kv_head[:, None] * stride_knh
    k = _rotated_rows(k_rows, d, mask, cos, sin, HALF).to(k_new.dtype.element_ty)
    v = tl.load(v_new + kv_head[:, None] * stride_vnh + d[None, :], mask=mask, other=0.0)
    k = as_cached(k, k_scale_inv, k_slot.dtype.element_ty, KV_FP8)  # [H, D]
    v = as_cached(v, v_scale_inv, v_slot.dtype.element_ty, KV_FP8)
    store = tl.where(has_slot, writer, False)[:, None] & mask
    tl.store(k_slot + kv_head[:, None] * stride_kh + d[None, :], k, mask=store)
    tl.store(v_slot + kv_head[:, None] * stride_vh + d[None, :], v, mask=store)
    k = k.to(q.dtype).to(tl.float32)  # the loop's conversions (exact)
    s = tl.sum(q.to(tl.float32) * k, 1) * scale_log2  # [H]
    m_i = tl.where(rows_new, s, float("-inf"))
    l_i = rows_new.to(tl.float32)
    acc = v.to(q.dtype).to(tl.float32)  # zeros on the other rows (masked loads)
    return m_i, l_i, acc


@triton.jit
def _add_sink(sink_ptrs, mask, m_i, l_i, acc):
    """Fold each row's sink logit (log2 units) into its softmax state: one more term in the
    denominator that weighs no value. Masked rows take a sink of 0 (their output is dropped)."""
    sink = tl.load(sink_ptrs, mask=mask, other=0.0)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


# ---- decode over the pages every sequence opens with (cascade) ----------------------------------

# A decode batch whose sequences all open with the same pages (a system prompt the prefix cache
# shares) has the decode kernel read those pages once per sequence: from L2 mostly, but at 32
# rows of 2,600 tokens, 2,000 of them shared, that still took llama-8b's layer 62 us against
# 33 us for the private tails alone (docs/design/goodput-and-multi-turn.md). The shared-prefix
# kernel attends every sequence's query rows over those pages in one pass instead, many
# sequences' heads in one matrix-unit tile (as prefill does), and leaves a partial per split
# of the shared tokens; the decode kernel then reads each sequence's own pages only and opens
# its softmax with those partials. The shared length is a step input on the device, so one
# captured graph serves any (0: the kernel's programs return at once).
# The launch: the best geometric mean of a sweep of rows a program (32-128), tokens a tile
# (32-128), warps (4, 8), stages (2, 3) and the most splits (4, 16) over llama-8b's heads at
# 8-128 rows of 2,600-3,200 tokens, 2,000 shared (H100, decode graphs: 59.9 us against 61.1
# for two stages; at 32 rows the eight best within 4%; docs/design/kernels-and-limits.md).
SHARED_BLOCK_M = 64  # query rows a program: sequences x the query heads of one kv head
SHARED_BLOCK_N = 64
SHARED_WARPS = 4
SHARED_STAGES = 3
# Splits of the shared tokens: enough (kv head, split, row tile) programs for one a
# multiprocessor, none under SHARED_MIN_SPLIT_TOKENS at the widest block table, at most
# SHARED_MAX_SPLITS (the decode kernel folds each split's partial in).
SHARED_MIN_SPLIT_TOKENS = 256
SHARED_MAX_SPLITS = 16
# Heads of up to this size only: the launch above was tuned at 128, and a 64-row tile of
# larger heads holds twice the registers (the prefill kernel takes smaller tiles there).
SHARED_MAX_HEAD_DIM = 128


@triton.jit
def step_shared_len(SHARED, seq_len):
    """The step's shared tokens for a sequence of ``seq_len``: the count at SHARED where the
    sequence is longer (every real one is: the engine keeps it below the shortest), else 0 (a
    padding row)."""
    shared = tl.load(SHARED)
    return tl.where(seq_len > shared, shared, 0)


@triton.jit
def shared_split_len(shared, num_splits, BLOCK_N: tl.constexpr):
    """Tokens in a split of the ``shared`` ones: a multiple of BLOCK_N; splits from
    cdiv(shared, this) on hold none."""
    return tl.cdiv(tl.cdiv(shared, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def fold_partials(PO, PL, parts, count, row_mask, d, d_mask, m_i, l_i, acc, WIDTH: tl.constexpr):
    """Fold ``count`` partial results (outputs ``PO`` [., WIDTH], base-2 log-sum-exps ``PL``),
    each row's at ``parts`` [H] + 0, 1, ..., into its online-softmax state: a partial's output
    times the exp2 of its log-sum-exp is its accumulator."""
    for i in range(0, count):
        lse = tl.load(PL + parts + i, mask=row_mask, other=float("-inf"))
        po_ptr = PO + (parts + i)[:, None] * WIDTH + d[None, :]
        po = tl.load(po_ptr, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        weight = tl.exp2(lse - m_use)
        l_i = l_i * alpha + weight
        acc = acc * alpha[:, None] + po * weight[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["batch", "num_splits", "stride_bt"])
def _shared_prefix_kernel(
    Q,
    KC,
    VC,
    BT,
    SL,
    SHARED,  # [2]: the shared tokens, and a sequence whose table row holds their pages
    QSL,  # MIXED: [B + 1] the step's query starts
    PO,  # [B, heads, splits, D] float32
    PL,  # [B, heads, splits] float32
    scale_log2,
    batch,
    num_splits,
    num_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    MIXED: tl.constexpr = False,  # the decode kernel's: one-token sequences only, by QSL
):
    """BLOCK_M query rows of one kv head (row r: sequence r // GROUP's head r % GROUP, so a
    tile may end inside a sequence) over one split of the shared tokens: their partial outputs
    and log2-sum-exps (no store for rows of sequences not longer than the shared tokens, or
    splits past them, or, MIXED, without one new token)."""
    kv = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    seq = rows // GROUP
    head = kv * GROUP + rows % GROUP
    # The shared length, the lengths and the table are step inputs: read them while the
    # kernel before finishes (engine_core/triton_pdl.py); q after the wait.
    shared = tl.load(SHARED)
    bt_row = BT + tl.load(SHARED + 1).to(tl.int64) * stride_bt
    split_len = shared_split_len(shared, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, shared)
    in_batch = seq < batch
    seq_len = tl.load(SL + seq, mask=in_batch, other=0)
    q_row = seq
    if MIXED:  # the decode kernel's rule; rows past the batch read sequence 0's starts, unused
        q_row, seq_len, _one_new = _mixed_row(QSL, tl.where(in_batch, seq, 0), seq_len)
    row_mask = in_batch & (seq_len > shared)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok = start + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row + tok // PAGE, mask=tok < end, other=0)
    pdl_wait_then_release(PDL)
    if start < end:
        q_mask = row_mask[:, None] & d_mask[None, :]
        q_ptr = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=q_mask, other=0.0)  # [M, D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for _ in range(start, end, BLOCK_N):
            n_mask = tok < end
            page = blk.to(tl.int64)
            in_page = tok % PAGE
            # The next tile's pages, asked for before this tile's K/V are used.
            tok = tok + BLOCK_N
            blk = tl.load(bt_row + tok // PAGE, mask=tok < end, other=0)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_row = page * stride_kb + in_page * stride_ks + kv * stride_kh
            k = tl.load(KC + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            v_row = page * stride_vb + in_page * stride_vs + kv * stride_vh
            v = tl.load(VC + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [M, N]
            s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        part = (seq * num_heads + head) * num_splits + split
        store_partial(PO, PL, out, m_i, l_i, part, d, q_mask, row_mask, HEAD_DIM)


@triton.jit(do_not_specialize=["window", "chunk", "min_split", "num_splits"])
def _decode_merge_kernel(
    PO,
    PL,
    SL,
    Out,
    SINKS,
    QSL,  # MIXED: [B + 1] the step's query starts
    SHARED,  # HAS_SHARED: [2] the decode kernel's (its first: the shared tokens)
    window,
    chunk,
    min_split,
    num_splits,
    queries,  # output rows a sequence: 1 for decode, K + 1 for a verify step
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    HAS_CHUNK: tl.constexpr = False,
    MIXED: tl.constexpr = False,  # the decode kernel's: one-token sequences only, by QSL
    HAS_SHARED: tl.constexpr = False,  # the decode kernel's: splits over the pages past them
):
    seq = tl.program_id(0)  # the output row: the sequence's, or one of its verify queries
    head = tl.program_id(1)
    part = (seq * tl.num_programs(1) + head) * num_splits
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    in_buf = s < num_splits
    # seq_len is a step input: read while the decode kernel finishes (engine_core/triton_pdl.py).
    # Every split's slot is read after the wait, whichever hold a result (they follow from
    # seq_len); unwritten slots are dropped by the selects below, never multiplied.
    seq_len = tl.load(SL + seq // queries)
    row, decodes = seq, True
    if MIXED:
        row, seq_len, decodes = _mixed_row(QSL, seq, seq_len)
    if HAS_SHARED:
        seq_len = seq_len - step_shared_len(SHARED, seq_len)
    pdl_wait_then_release(PDL)
    lse = tl.load(PL + part + s, mask=in_buf, other=float("-inf"))  # [S]
    po_ptr = PO + (part + s)[:, None] * HEAD_DIM + d[None, :]
    po = tl.load(po_ptr, mask=in_buf[:, None] & d_mask[None, :], other=0.0)  # [S, D]
    _, _, first, last = split_bounds(
        seq_len, window, chunk, num_splits, min_split, BLOCK_N, HAS_WINDOW, HAS_CHUNK
    )
    if first != last:  # otherwise the decode kernel wrote this row itself
        valid = (s >= first) & (s <= last)
        lse = tl.where(valid, lse, float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        if HAS_SINKS:
            sink = tl.load(SINKS + head)
            m = tl.maximum(m, sink)
        w = tl.exp2(lse - m)  # splits outside [first, last] weigh 0
        total = tl.sum(w, 0)
        if HAS_SINKS:
            total += tl.exp2(sink - m)
        total = tl.where(total > 0, total, 1.0)
        po = tl.where(valid[:, None], po, 0.0)
        out = tl.sum(po * w[:, None], 0) / total  # [D]
        if MIXED:
            d_mask = tl.where(decodes, d_mask, False)
        o_ptr = Out + row * stride_ot + head * stride_oh + d
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    q: torch.Tensor,  # [B, heads, head_dim]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, the query token included; 0 = padding row (output 0)
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,  # None: default_min_split's
    out: torch.Tensor | None = None,  # [B, heads, head_dim]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: DecodeTile | None = None,
    sinks: torch.Tensor | None = None,  # [heads]: gpt-oss's sink logits
    attention_chunk: int | None = None,  # Llama 4: the query sees its chunk's keys only
    mixed_starts: torch.Tensor | None = None,  # [B + 1]: a mixed step's query starts
    shared_prefix: torch.Tensor | None = None,  # [2] int32: tokens every sequence opens with
    row_order: torch.Tensor | None = None,  # [B] int32: a permutation of the sequences
) -> torch.Tensor:  # [B, heads, head_dim]
    """Attention of each sequence's last token over its whole cached context (an FP8 cache's
    values times their scales; with ``sinks``, each head's sink logit in the denominator).

    ``row_order``: the order in which the sequences' programs are launched (the GPU starts
    programs roughly in launch order): longest first, a batch of mixed lengths does not end on
    its longest sequences alone. The output rows stay the batch's.

    ``shared_prefix``: a count of tokens, a multiple of the page size, whose pages open the
    block table of every sequence longer than it (0: none), and the index of a sequence whose
    table holds them (in a mixed step, one with one new token): those
    pages are attended once for all sequences (_shared_prefix_kernel), each sequence's own
    pages by the decode kernel (in a mixed step: the one-token sequences'). A bf16/fp16/fp32
    cache, heads of 16 to SHARED_MAX_HEAD_DIM, no window or chunk.

    ``mixed_starts``: a step whose sequences have any number of new tokens, ``q`` and ``out``
    all of its [T, heads, head_dim] rows: only the sequences with exactly one new token are
    attended (at their rows ``mixed_starts[b]``), the other rows are left as they are.

    Reads nothing from the host but the tensors' shapes: ``num_splits`` defaults to a function
    of the batch size, the kv heads and the block table's width, so the launch is the same for
    every step that a CUDA graph replays. ``tile`` overrides the tuned launch shape (tests and
    the tuning sweep).
    """
    return _decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, None, sliding_window, num_splits,
        min_split_tokens, out, k_scale, v_scale, tile, sinks, attention_chunk, mixed_starts,
        shared_prefix, row_order=row_order,
    )  # fmt: skip


def sinks_log2(sinks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The sink logits [H] in the kernels' log2 units, float32 (``like``: any tensor, passed
    where there are no sinks: the kernels never read it then)."""
    return like if sinks is None else (sinks.float() * LOG2E).contiguous()


@dataclass(frozen=True)
class NewTokens:
    """What a decode step adds to the cache, as rotary_decode_attention takes it: each
    sequence's new k and v (k not yet rotated), its rotary angles and its cache slot."""

    k: torch.Tensor  # [B, kv_heads, head_dim]
    v: torch.Tensor  # [B, kv_heads, head_dim]
    cos: torch.Tensor  # [B, R], R <= head_dim (both halves equal, as RotaryEmbedding builds them)
    sin: torch.Tensor  # [B, R]
    slot_mapping: torch.Tensor  # [B] int64, -1 = padding: not written


def rotary_decode_attention(
    q: torch.Tensor,  # [B, heads, head_dim], not yet rotated; rows may be strided (a qkv view)
    new: NewTokens,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: DecodeTile | None = None,
    attention_chunk: int | None = None,
    row_order: torch.Tensor | None = None,  # [B] int32: as paged_decode_attention's
) -> torch.Tensor:  # [B, heads, head_dim]
    """A decode step's rotary, KV write and attention in the decode kernel's launch: what
    ``rotary_write_kv_cache`` then ``paged_decode_attention`` do in two (one launch fewer per
    layer: a small model's decode step is a chain of short launches). q and the new k are
    rotated (rotate-half over the first R dims), the new k and v are written to their slots,
    and each sequence attends to its cache and its new token. q and k are not written."""
    head_dim = q.shape[2]
    if q.stride(2) != 1 or new.k.stride(2) != 1 or new.v.stride(2) != 1:
        raise ValueError("rotary_decode_attention needs the head dim contiguous")
    if new.cos.stride(1) != 1 or new.sin.stride(1) != 1:
        raise ValueError("rotary_decode_attention needs each row's angles contiguous")
    rot = new.cos.shape[1]
    if rot % 2 or rot > head_dim or rot == 0:
        raise ValueError(f"rotary over {rot} dims of a {head_dim}-dim head")
    return _decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, new, sliding_window, num_splits,
        min_split_tokens, out, k_scale, v_scale, tile, None, attention_chunk,
        row_order=row_order,
    )  # fmt: skip


def served_row_order(row_order: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The launch order of a decode step of ``rows`` rows (a graph's, padding included: a
    shape) whose sequences ``row_order`` puts longest first: that order from
    ORDERED_DECODE_MIN_ROWS rows, else None (the batch's)."""
    return row_order if rows >= ORDERED_DECODE_MIN_ROWS else None


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    new: NewTokens | None,
    sliding_window: int | None,
    num_splits: int | None,
    min_split_tokens: int | None,
    out: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    tile: DecodeTile | None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    mixed_starts: torch.Tensor | None = None,
    shared_prefix: torch.Tensor | None = None,
    row_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode kernel's launch (and the merge's, and the shared-prefix kernel's before
    them), with ``new`` tokens or without."""
    _, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]  # q's rows but in a mixed step
    if row_order is not None and row_order.shape != (batch,):
        raise ValueError(f"a row order is a permutation of the {batch} sequences")
    _, page, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache)
    _check_cache(v_cache)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    kv_fp8 = is_fp8_cache(k_cache)
    if tile is None:
        # A mixed step's one-token rows are a few of its sequences (a prefill graph holds
        # max_num_seqs, padding mostly), and their count is a step value no launch reads: the
        # default tile, not the whole batch's (at 1,024 slots the wide one, which took 158
        # against 101 µs at 36 real rows; kernels-and-limits.md, "Batches of mixed lengths").
        grid = "default" if mixed_starts is not None else decode_grid(batch, num_kv_heads, q.device)
        tile = decode_tile(head_dim, kv_fp8, grid, num_kv_heads)
    # The query heads of the program's kv heads go through tl.dot as one tile padded to its
    # 16-row minimum, a group of one (MHA, GPT-2) too: the elementwise products that group 1
    # used before were reported to read at only about 1 TB/s. They remain only for head dims
    # under tl.dot's 16.
    group = num_heads // num_kv_heads
    use_dot = head_dim >= 16
    kpp = _kv_per_program(tile.kv_per_program if use_dot else 1, num_kv_heads, group)
    rows = triton.next_power_of_2(group * kpp)
    block_h = max(16, rows) if use_dot else rows
    block_n = tile.block_n if use_dot else 32
    programs = num_kv_heads // kpp
    if min_split_tokens is None:
        min_split_tokens = default_min_split(batch, programs, q.device)
    min_split = max(min_split_tokens, 1)
    if num_splits is None:
        max_context = block_tables.shape[1] * page
        num_splits = choose_num_splits(batch, programs, max_context, q.device, min_split)
    partial_out, partial_lse = partial_buffers(batch, num_heads, num_splits, head_dim, q.device)
    # Without new tokens their arguments are never read: any tensors do.
    k_new, v_new, cos, sin, slots = (
        (q, q, q[:, 0], q[:, 0], seq_lens)
        if new is None
        else (new.k, new.v, new.cos, new.sin, new.slot_mapping)
    )
    pdl = chain_pdl(q)
    sink_logits = sinks_log2(sinks, q)
    # Without a shared prefix its arguments are never read either.
    shared, shared_out, shared_lse, shared_splits = seq_lens, q, q, 1
    if shared_prefix is not None:
        if new is not None or sliding_window or attention_chunk:
            raise ValueError("a shared prefix is for plain decode (no rotary, window or chunk)")
        if shared_prefix.shape != (2,):
            raise ValueError("a shared prefix is [tokens, row]: a [2] int32 tensor")
        if kv_fp8 or not 16 <= head_dim <= SHARED_MAX_HEAD_DIM:
            raise ValueError(
                "a shared prefix needs a 16-bit or float32 cache and a head dim of 16 to "
                f"{SHARED_MAX_HEAD_DIM}"
            )
        shared = shared_prefix
        shared_out, shared_lse, shared_splits = _shared_prefix_partials(
            q, k_cache, v_cache, block_tables, seq_lens, shared_prefix, scale, pdl, mixed_starts
        )
    _decode_kernel[(programs, num_splits, batch)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        k_new,
        v_new,
        cos,
        sin,
        slots,
        sink_logits,
        seq_lens if mixed_starts is None else mixed_starts,
        shared,
        shared_out,
        shared_lse,
        seq_lens if row_order is None else row_order,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale,
        1.0 / k_scale,
        1.0 / v_scale,
        sliding_window or 0,
        attention_chunk or 1,
        min_split,
        num_splits,
        shared_splits,
        num_heads,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        KPP=kpp,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=page,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        USE_DOT=use_dot,
        PRECISION=dot_precision(q.dtype),
        KV_FP8=kv_fp8,
        FP8_AS_F16=kv_fp8 and q.dtype in (torch.bfloat16, torch.float16),
        PDL=pdl,
        ROPE=new is not None,
        HALF=1 if new is None else new.cos.shape[1] // 2,
        HAS_SINKS=sinks is not None,
        HAS_CHUNK=attention_chunk is not None,
        MIXED=mixed_starts is not None,
        HAS_SHARED=shared_prefix is not None,
        SHARED_N=SHARED_BLOCK_N,
        HAS_ORDER=row_order is not None,
        launch_pdl=pdl,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if num_splits > 1:
        merge_partials(
            partial_out, partial_lse, seq_lens, out, sliding_window, min_split, block_n, sinks,
            attention_chunk, mixed_starts=mixed_starts, shared_prefix=shared_prefix,
        )  # fmt: skip
    return out


def _shared_prefix_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    shared_prefix: torch.Tensor,
    scale: float,
    pdl: bool,
    mixed_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The shared-prefix kernel's launch: its partial outputs, log2-sum-exps and split count
    (the buffers as large as the widest block table could need, so a graph serves any).
    ``mixed_starts``: as the decode kernel's (its one-token sequences' rows only)."""
    _, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    row_tiles = -(-batch * group // SHARED_BLOCK_M)
    num_splits = choose_shared_splits(
        num_kv_heads * row_tiles, block_tables.shape[1] * page, q.device
    )
    shape = (batch, num_heads, num_splits)
    partial_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    _shared_prefix_kernel[(num_kv_heads, num_splits, row_tiles)](
        q, k_cache, v_cache, block_tables, seq_lens, shared_prefix,
        seq_lens if mixed_starts is None else mixed_starts, partial_out, partial_lse,
        scale * LOG2E, batch, num_splits, num_heads, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_M=SHARED_BLOCK_M, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page, BLOCK_N=SHARED_BLOCK_N,
        PRECISION=dot_precision(q.dtype), PDL=pdl, MIXED=mixed_starts is not None,
        launch_pdl=pdl, num_warps=SHARED_WARPS, num_stages=SHARED_STAGES,
    )  # fmt: skip
    return partial_out, partial_lse, num_splits


def choose_shared_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Splits of the shared tokens for a grid of ``programs`` (kv heads x row tiles) a split:
    about one program a multiprocessor, no split under SHARED_MIN_SPLIT_TOKENS at the longest
    context the block table holds, at most SHARED_MAX_SPLITS."""
    wanted = -(-_num_sms(device) // programs)
    longest = -(-max_context // SHARED_MIN_SPLIT_TOKENS)
    return max(1, min(wanted, longest, SHARED_MAX_SPLITS))


def _kv_per_program(wanted: int, num_kv_heads: int, group: int) -> int:
    """The largest power of two <= ``wanted`` that divides the kv heads and whose query heads
    fit in the rows the matrix-unit tile has anyway (16, or the group's own power of two)."""
    kpp = 1 << max(wanted.bit_length() - 1, 0)
    rows = max(16, triton.next_power_of_2(group))
    while kpp > 1 and (num_kv_heads % kpp or group * kpp > rows):
        kpp //= 2
    return kpp


def merge_partials(
    partial_out: torch.Tensor,  # [B, heads, S, head_dim] float32
    partial_lse: torch.Tensor,  # [B, heads, S] float32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [B, heads, head_dim]
    sliding_window: int | None,
    min_split: int,
    block_n: int,
    sinks: torch.Tensor | None = None,  # [heads]
    attention_chunk: int | None = None,
    queries: int = 1,
    mixed_starts: torch.Tensor | None = None,  # [B + 1]: a mixed step's query starts
    shared_prefix: torch.Tensor | None = None,  # [2]: the decode kernel's shared prefix
) -> None:
    """Combine each multi-split row's partial results, weighted by their log-sum-exps (and each
    head's sink logit in the denominator). ``queries``: output rows a sequence (a verify
    step's K + 1; row r is then sequence r // queries's); ``seq_lens`` has one per sequence.
    ``mixed_starts``: as the decode kernel's (its one-token sequences' rows only)."""
    batch, num_heads, num_splits, head_dim = partial_out.shape
    block_d = triton.next_power_of_2(head_dim)
    block_s = triton.next_power_of_2(num_splits)
    pdl = chain_pdl(out)
    _decode_merge_kernel[(batch, num_heads)](
        partial_out,
        partial_lse,
        seq_lens,
        out,
        sinks_log2(sinks, partial_lse),
        seq_lens if mixed_starts is None else mixed_starts,
        seq_lens if shared_prefix is None else shared_prefix,
        sliding_window or 0,
        attention_chunk or 1,
        min_split,
        num_splits,
        queries,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        PDL=pdl,
        HAS_SINKS=sinks is not None,
        HAS_CHUNK=attention_chunk is not None,
        MIXED=mixed_starts is not None,
        HAS_SHARED=shared_prefix is not None,
        launch_pdl=pdl,
        num_warps=max(1, min(4, block_s * block_d // 1024)),
    )


def partial_buffers(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split outputs [B, H, S, D] and base-2 log-sum-exps [B, H, S] (float32)."""
    if num_splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy
    shape = (batch, num_heads, num_splits)
    return (
        torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
    )


def choose_num_splits(
    batch: int,
    kv_programs: int,
    max_context: int,
    device: torch.device,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
) -> int:
    """Enough (sequence, kv heads, split) programs for PROGRAMS_PER_SM per multiprocessor
    (SPARSE_SPLITS where the unsplit ones give it PROGRAMS_PER_SM to
    SPARSE_SPLIT_PROGRAMS_PER_SM), with no split shorter than ``min_split_tokens`` at the
    longest context the block table can hold.
    ``kv_programs`` is the number of programs per sequence and split (kv heads over kv heads
    per program). Sequences shorter than the longest use fewer splits (the rest return at
    once), and one that fits in one split skips the merge."""
    if max_context <= min_split_tokens:
        return 1
    programs, sms = batch * kv_programs, _num_sms(device)
    wanted = -(-PROGRAMS_PER_SM * sms // programs)
    if PROGRAMS_PER_SM * sms <= programs < SPARSE_SPLIT_PROGRAMS_PER_SM * sms:
        wanted = SPARSE_SPLITS
    return max(1, min(wanted, -(-max_context // min_split_tokens), MAX_SPLITS))


def default_min_split(batch: int, kv_programs: int, device: torch.device) -> int:
    """The shortest context split: STARVED_MIN_SPLIT_TOKENS where one program per sequence and
    kv heads leaves multiprocessors idle (at most one program each), THIN_MIN_SPLIT_TOKENS
    where it gives them fewer than PROGRAMS_PER_SM each, MIN_SPLIT_TOKENS else."""
    programs, sms = batch * kv_programs, _num_sms(device)
    if programs <= sms:
        return STARVED_MIN_SPLIT_TOKENS
    if programs < PROGRAMS_PER_SM * sms:
        return THIN_MIN_SPLIT_TOKENS
    return MIN_SPLIT_TOKENS


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter on CPU: any small number exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands use exact products (tests compare them with HF); bf16 ignores this."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- speculative verify attention: K + 1 queries a sequence, decode-shaped --------------------

# A verify program holds every query row of its kv heads: queries x query heads of the group.
# Past VERIFY_MAX_ROWS the accumulator's registers ([rows, head_dim] float32) outgrow a
# program's share, and the prefill kernel takes the step instead (TritonBackend.forward).
VERIFY_MAX_ROWS = 64


def verify_rows(num_heads: int, num_kv_heads: int, queries: int) -> int:
    """Query rows of one verify program with one kv head: queries x its query heads."""
    return queries * (num_heads // num_kv_heads)


def verify_serves(num_heads: int, num_kv_heads: int, head_dim: int, queries: int) -> bool:
    """Whether paged_verify_attention takes steps of ``queries`` queries a sequence for these
    heads (else the prefill kernel does)."""
    rows = verify_rows(num_heads, num_kv_heads, queries)
    return queries > 1 and head_dim >= 16 and rows <= VERIFY_MAX_ROWS


# window and the split counts stay runtime values, as in _decode_kernel; so do the queries a
# sequence (a step's K + 1 or fewer, eagerly): only the tile height BLOCK_R compiles variants.
@triton.jit(do_not_specialize=["window", "min_split", "num_splits", "queries", "stride_bt"])
def _verify_kernel(
    Q,
    KC,
    VC,
    BT,
    SL,
    Out,
    PO,
    PL,
    scale_log2,
    v_scale,
    window,
    min_split,
    num_splits,
    num_heads,
    queries,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_oh,
    GROUP: tl.constexpr,
    KPP: tl.constexpr,  # kv heads per program
    BLOCK_R: tl.constexpr,  # >= queries * GROUP * KPP rows, at least 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Attention of a sequence's last ``queries`` tokens (its last known token and its drafts,
    whose K/V are in the cache already) over its cache, each query seeing the keys up to its
    own position. A program owns one (sequence, context split, kv heads) as _decode_kernel's
    do, with every query of every query head of those kv heads as the rows of one tile: row r
    is query r // (GROUP * KPP) of head kv0 * GROUP + r % (GROUP * KPP). So each K/V row of
    the context is read once per group for all K + 1 queries, where the prefill kernel reads
    it once per query head."""
    kv0 = tl.program_id(0) * KPP
    split = tl.program_id(1)
    seq = tl.program_id(2)
    # Step inputs, not outputs of the kernel just before (the KV write): read before the wait
    # (engine_core/triton_pdl.py). The first query's window reaches back furthest: the splits
    # are those of a decode query with a window queries - 1 longer.
    seq_len = tl.load(SL + seq)
    split_len, lo, first, last = split_bounds(
        seq_len, window + queries - 1, 1, num_splits, min_split, BLOCK_N, HAS_WINDOW, False
    )
    start = tl.maximum(split * split_len, lo)
    end = tl.minimum(split * split_len + split_len, seq_len)
    r = tl.arange(0, BLOCK_N * KPP)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    next_tok = start + r // KPP
    next_blk = tl.load(bt_row + next_tok // PAGE, mask=next_tok < end, other=0)
    pdl_wait_then_release(PDL)
    if (split >= first) & (split <= last):
        rows = tl.arange(0, BLOCK_R)
        query = rows // (GROUP * KPP)
        in_program = rows % (GROUP * KPP)
        heads = kv0 * GROUP + in_program
        row_mask = rows < queries * GROUP * KPP
        row_kv = in_program // GROUP  # which of the program's kv heads a row reads
        q_pos = seq_len - queries + query  # [R]: each row's query position
        token = seq * queries + query  # [R]: its row of q and of the output
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q_mask = row_mask[:, None] & d_mask[None, :]
        q_ptr = Q + token.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
        q = tl.load(q_ptr + d[None, :], mask=q_mask, other=0.0)  # [R, D]
        if FP8_AS_F16:  # as in _decode_kernel
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        same_kv = row_kv[:, None] == (r % KPP)[None, :]  # [R, N * KPP]
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for _ in range(start, end, BLOCK_N):
            tok = next_tok
            n_mask = tok < end
            blk = next_blk.to(tl.int64)
            next_tok = tok + BLOCK_N
            next_blk = tl.load(bt_row + next_tok // PAGE, mask=next_tok < end, other=0)
            in_page = tok % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            r_kv = kv0 + r % KPP
            k_row = blk * stride_kb + in_page * stride_ks + r_kv * stride_kh
            k = tl.load(KC + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N*KPP, D]
            v_row = blk * stride_vb + in_page * stride_vs + r_kv * stride_vh
            v = tl.load(VC + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [R, N*KPP]
            # Causal inside the chunk: a query sees its own position and the ones before.
            visible = n_mask[None, :] & (tok[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (tok[None, :] > q_pos[:, None] - window)
            if KPP > 1:
                visible = visible & same_kv
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # zeros for a padding sequence
        if KV_FP8:
            out = out * v_scale
        # The output [T, heads, D] (contiguous over heads) as rows token * heads + head: the
        # decode layout's (sequence, head) rows, one per query, for store_split and the merge.
        flat = token * num_heads + heads
        store_split(
            Out, PO, PL, out, m_i, l_i, 0, flat, d, q_mask, row_mask, split, first, last,
            num_heads, num_splits, 0, stride_oh, HEAD_DIM,
        )  # fmt: skip


def paged_verify_attention(
    q: torch.Tensor,  # [B * Q, heads, head_dim]: sequence b's queries are rows b*Q .. b*Q+Q-1
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, the Q queries included; 0 = padding (output 0)
    queries: int,  # Q: new tokens a sequence, all of them in the cache already
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,  # None: default_min_split's
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: DecodeTile | None = None,
) -> torch.Tensor:  # [B * Q, heads, head_dim]
    """Causal attention of each sequence's last ``queries`` tokens over its cached context: a
    speculative verify step (the last known token and K drafts), with the decode kernel's
    split context and kv-head grouping. The launch reads nothing from the host but shapes and
    ``queries`` (the split count is a function of the batch, the kv heads and the block
    table's width, as for decode), so a CUDA graph of a (batch, K) captures it."""
    tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    _check_cache(k_cache)
    _check_cache(v_cache)
    if tokens != batch * queries:
        raise ValueError(f"{tokens} query rows for {batch} sequences of {queries} queries")
    if not verify_serves(num_heads, num_kv_heads, head_dim, queries):
        raise ValueError(
            f"paged_verify_attention: {queries} queries of {num_heads // num_kv_heads} heads a "
            f"group (head dim {head_dim}) exceed its tile; use the prefill kernel"
        )
    out = q.new_empty(tokens, num_heads, head_dim)
    if batch == 0:
        return out
    kv_fp8 = is_fp8_cache(k_cache)
    if tile is None:
        grid = decode_grid(batch, num_kv_heads, q.device)
        tile = decode_tile(head_dim, kv_fp8, grid, num_kv_heads)
    group = num_heads // num_kv_heads
    kpp = _kv_per_program(tile.kv_per_program, num_kv_heads, group * queries)
    programs = num_kv_heads // kpp
    if min_split_tokens is None:
        min_split_tokens = default_min_split(batch, programs, q.device)
    min_split = max(min_split_tokens, 1)
    if num_splits is None:
        max_context = block_tables.shape[1] * page
        num_splits = choose_num_splits(batch, programs, max_context, q.device, min_split)
    partial_out, partial_lse = partial_buffers(tokens, num_heads, num_splits, head_dim, q.device)
    # The first query's window: the splits and the merge bound the context by it.
    window = None if sliding_window is None else sliding_window + queries - 1
    pdl = chain_pdl(q)
    _verify_kernel[(programs, num_splits, batch)](
        q, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0), v_scale, sliding_window or 0, min_split,
        num_splits, num_heads, queries, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), out.stride(1),
        GROUP=group, KPP=kpp, BLOCK_R=max(16, triton.next_power_of_2(group * kpp * queries)),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page,
        BLOCK_N=tile.block_n, HAS_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(q.dtype), KV_FP8=kv_fp8,
        FP8_AS_F16=kv_fp8 and q.dtype in (torch.bfloat16, torch.float16), PDL=pdl,
        launch_pdl=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_partials(
            partial_out, partial_lse, seq_lens, out, window, min_split, tile.block_n,
            queries=queries,
        )  # fmt: skip
    return out


# ---- varlen prefill attention over the paged cache ---------------------------------------------


@triton.jit
def work_list_row(TILES, QSL):
    """This program's row of a prefill step's tile list (prefill_tiles.py): the sequence as
    named (-1: a CUDA graph's padding row), the sequence to read (0 for padding), its query
    tile, and its query start and length. The list is walked from its end: a sequence's last
    tiles see the most keys, so they start first and the short ones fill the last wave."""
    t = tl.num_programs(0) - 1 - tl.program_id(0)
    named = tl.load(TILES + 2 * t)
    seq = tl.maximum(named, 0)
    tile = tl.load(TILES + 2 * t + 1)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    return named, seq, tile, q_start, q_len


# stride_bt is the step's widest block table, which an eager step (over the prefill graphs'
# bounds) packs at its own width: specialized on it, the kernel compiled a new variant whenever a
# width class (1, a multiple of 16, other) first came up while serving, a stall of hundreds of
# milliseconds in the busy loop on a machine whose Triton cache did not hold it yet
# (docs/design/cuda-graphs-and-warm-up.md, "Nothing compiles mid-serving").
@triton.jit(do_not_specialize=["chunk", "stride_bt"])
def _prefill_kernel(
    Q,
    KC,
    VC,
    BT,
    SL,
    QSL,
    TILES,
    Out,
    SINKS,  # HAS_SINKS: [heads] float32, sink logits times log2(e)
    KEY_ENDS,  # HAS_KEY_ENDS: [T] int32, one past the last key each query row sees
    scale_log2,
    v_scale,
    window,
    chunk,  # HAS_CHUNK: Llama 4's attention chunk
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # of Q and K
    BLOCK_D: tl.constexpr,
    V_DIM: tl.constexpr,  # of V and the output: HEAD_DIM but in MLA's expanded prefill
    BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    HAS_CHUNK: tl.constexpr = False,
    MIN_QUERY: tl.constexpr = 1,  # 2: one-token sequences are the decode kernel's (MIXED)
    HAS_KEY_ENDS: tl.constexpr = False,  # rows that see past themselves (Gemma 3's images)
):
    # A padding row of the tile list, or a sequence of fewer than MIN_QUERY new tokens, has
    # nothing to do.
    named, seq, tile, q_start, q_len = work_list_row(TILES, QSL)
    head = tl.program_id(1)
    if named >= 0 and tile * BLOCK_M < q_len and q_len >= MIN_QUERY:
        seq_len = tl.load(SL + seq)
        context = seq_len - q_len  # tokens before this chunk (prefix cache, earlier chunks)
        kvh = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = context + rows  # [M]
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q_mask = row_mask[:, None] & d_mask[None, :]
        dv = tl.arange(0, BLOCK_DV)
        dv_mask = dv < V_DIM
        q_rows = (q_start + rows).to(tl.int64)
        q_ptr = Q + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=q_mask, other=0.0)  # [M, D]
        if FP8_AS_F16:  # as in the decode kernel: e4m3 widens to float16 in one instruction
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

        # The tile's last row sees up to its own position; the window (or the attention chunk)
        # of its first row bounds the first key: no row reads before it.
        hi = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)
        if HAS_KEY_ENDS:
            # A row sees up to max(itself, its key end): past itself inside an image, whose
            # whole run is in the cache (the scheduler never ends a chunk inside one). Every
            # row still sees up to itself, so the unmasked tiles below stay unmasked.
            ends = tl.load(KEY_ENDS + q_rows, mask=row_mask, other=0)
            row_end = tl.where(row_mask, tl.maximum(q_pos + 1, ends), 0)  # [M]
            hi = tl.minimum(seq_len, tl.maximum(hi, tl.max(row_end, 0)))
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(context + tile * BLOCK_M - window + 1, 0)
        if HAS_CHUNK:
            first_row = context + tile * BLOCK_M
            lo = tl.maximum(lo, first_row - first_row % chunk)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        bt_row = BT + seq.to(tl.int64) * stride_bt
        # Whole key tiles at or before the tile's first row are seen by every row: no mask.
        masked_from = lo
        if not HAS_WINDOW and not HAS_CHUNK:
            masked_from = lo + (context + tile * BLOCK_M + 1 - lo) // BLOCK_N * BLOCK_N
            for n0 in range(lo, masked_from, BLOCK_N):
                offs = n0 + tl.arange(0, BLOCK_N)
                blk = tl.load(bt_row + offs // PAGE).to(tl.int64)
                in_page = offs % PAGE
                k_ptr = KC + blk[:, None] * stride_kb + in_page[:, None] * stride_ks
                k = tl.load(k_ptr + kvh * stride_kh + d[None, :], mask=d_mask[None, :], other=0.0)
                v_ptr = VC + blk[:, None] * stride_vb + in_page[:, None] * stride_vs
                v = tl.load(v_ptr + kvh * stride_vh + dv[None, :], mask=dv_mask[None, :], other=0.0)
                if KV_FP8:
                    k = k.to(q.dtype)
                    v = v.to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
                m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        for n0 in range(masked_from, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs < hi
            blk = tl.load(bt_row + offs // PAGE, mask=n_mask, other=0).to(tl.int64)
            in_page = offs % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_ptr = KC + blk[:, None] * stride_kb + in_page[:, None] * stride_ks + kvh * stride_kh
            k = tl.load(k_ptr + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            v_ptr = VC + blk[:, None] * stride_vb + in_page[:, None] * stride_vs + kvh * stride_vh
            v_mask = n_mask[:, None] & dv_mask[None, :]
            v = tl.load(v_ptr + dv[None, :], mask=v_mask, other=0.0)  # [N, DV]
            if KV_FP8:  # exact in q's dtype; the scales as in the decode kernel
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [M, N]
            if HAS_KEY_ENDS:
                visible = n_mask[None, :] & (offs[None, :] < row_end[:, None])
            else:
                visible = n_mask[None, :] & (offs[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (offs[None, :] > q_pos[:, None] - window)
            if HAS_CHUNK:
                visible = visible & (offs[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk)
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)

        if HAS_SINKS:
            m_i, l_i, acc = _add_sink(SINKS + head + 0 * rows, row_mask, m_i, l_i, acc)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if KV_FP8:
            out = out * v_scale
        o_ptr = Out + q_rows[:, None] * stride_ot + head * stride_oh + dv[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & dv_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, heads, head_dim]: sequence i's rows query_start_loc[i]:[i+1]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, v_dim]: v_dim may differ (MLA)
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, heads, v_dim]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tiles: torch.Tensor | None = None,  # [rows, 2] int32, see prefill_tiles.py
    launch: PrefillLaunch | None = None,
    sinks: torch.Tensor | None = None,  # [heads]: gpt-oss's sink logits
    attention_chunk: int | None = None,  # Llama 4: a query at p sees [p // C * C, p] only
    skip_decodes: bool = False,  # one-token sequences left alone (their rows of ``out`` too)
    key_ends: torch.Tensor | None = None,  # [T] int32: one past the last key each row sees
) -> torch.Tensor:  # [T, heads, v_dim]
    """Causal attention of every new token over its sequence's cached context (itself included).

    Sequence i's new tokens sit at positions ``seq_lens[i] - query_len_i ..``; its earlier
    context (prefix-cache hits, earlier chunks) is read from the cache like the new tokens, whose
    K/V must already be written. Rows of query length 1 (decodes in a mixed batch) work as well.
    ``tiles`` is the step's (sequence, query tile) work list (prefill_tiles.py), built for
    ``prefill_block_m(T)``; without it, it is worked out here. ``launch`` overrides the key
    tile, warps and stages (tests and the tuning sweep).

    ``key_ends`` (Gemma 3's images, whose tokens attend to each other both ways): row t sees
    the keys before ``max(its position + 1, key_ends[t])`` (absolute positions), from its
    window's or chunk's start; the keys up to the end must be in the cache. Without it the
    kernel compiles as the causal one (HAS_KEY_ENDS is a constexpr).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache)
    _check_cache(v_cache)
    v_dim = v_cache.shape[-1]
    if out is None:
        out = q.new_empty(num_tokens, num_heads, v_dim)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if key_ends is not None and (key_ends.dtype != torch.int32 or key_ends.shape != (num_tokens,)):
        raise ValueError(
            f"key_ends must be [{num_tokens}] int32, one a query row, not "
            f"{list(key_ends.shape)} {key_ends.dtype}"
        )
    kv_fp8 = is_fp8_cache(k_cache)
    # The engine's launch (none asked for) of a plain causal call takes descriptor loads where
    # the cache allows them.
    plain = sliding_window is None and sinks is None and attention_chunk is None
    if launch is None and plain and key_ends is None and tma_pages_serve(q, k_cache, v_cache, out):
        return tma_page_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, tiles,
            skip_decodes=skip_decodes,
        )  # fmt: skip
    launch = launch or prefill_launch(head_dim, kv_fp8)
    block_m = launch.block_m or prefill_block_m(num_tokens)
    if tiles is None:  # the direct call of a test: work the list out here (a device sync)
        tiles = device_tiles(query_start_loc.tolist(), q.device, block_m)
    grid = (tiles.shape[0], num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        tiles,
        out,
        sinks_log2(sinks, q),
        q if key_ends is None else key_ends,  # not read without HAS_KEY_ENDS
        scale * LOG2E * (k_scale if is_fp8_cache(k_cache) else 1.0),
        v_scale,
        sliding_window or 0,
        attention_chunk or 1,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        V_DIM=v_dim,
        BLOCK_DV=triton.next_power_of_2(v_dim),
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=launch.block_n,
        HAS_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(q.dtype),
        KV_FP8=kv_fp8,
        FP8_AS_F16=kv_fp8 and q.dtype in (torch.bfloat16, torch.float16),
        HAS_SINKS=sinks is not None,
        HAS_CHUNK=attention_chunk is not None,
        MIN_QUERY=2 if skip_decodes else 1,
        HAS_KEY_ENDS=key_ends is not None,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out


# Keys a tile of the descriptor-load prefill kernel: it serves caches whose pages hold a whole
# number of such tiles (block size 32, 64, ...), each tile one load from one page.
TMA_PAGE_KEYS = 32


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ready(t: torch.Tensor, rows_stride: int) -> bool:
    """A descriptor's base and its outer stride in 16-byte units, its last dimension dense."""
    width = t.element_size()
    return t.data_ptr() % 16 == 0 and rows_stride * width % 16 == 0 and t.stride(-1) == 1


def tma_pages_serve(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> bool:
    """Whether the engine's launch of a plain causal prefill (no window, chunk, sinks or key
    ends; the caller checks those) takes ``tma_page_prefill_attention``: on a GPU with TMA
    (sm_90+), bf16 or fp16, heads of 128 (K and V alike; at 64, llama-1b's, the pointer loads
    were 10% faster than a first version of this kernel, not measured since), pages of a
    multiple of TMA_PAGE_KEYS, contiguous caches (one descriptor over all pages' rows), and Q
    rows of dense heads."""
    _, page, kv_heads, head_dim = k_cache.shape
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or not _has_tma(q.device):
        return False
    if head_dim != 128 or page % TMA_PAGE_KEYS or k_cache.dtype != q.dtype:
        return False
    for cache in (k_cache, v_cache):
        if cache.shape != k_cache.shape or not cache.is_contiguous():
            return False
        if not _tma_ready(cache, kv_heads * head_dim):
            return False
    dense_out = out is None or out.stride()[1:] == (head_dim, 1)
    return q.stride(1) == head_dim and _tma_ready(q, q.stride(0)) and dense_out


@triton.jit(do_not_specialize=["num_tokens", "stride_bt"])
def _tma_page_prefill_kernel(
    Q,
    KC,
    VC,
    BT,
    SL,
    QSL,
    TILES,
    Out,
    scale_log2,
    num_tokens,
    cache_rows,
    stride_qt,
    stride_bt,
    stride_ot,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    MIN_QUERY: tl.constexpr,
):
    # _prefill_kernel's work (plain causal attention over the cache), its Q tile and each key
    # tile one descriptor load: a key tile lies inside one page, the cache's rows one after
    # another ([cache_rows, kv heads x head dim]). (A descriptor over [blocks, page, ...] with
    # [1, BLOCK_N, HEAD_DIM] boxes costs a reshape of each tile: 15% slower at 3,600 tokens.)
    named, seq, tile, q_start, q_len = work_list_row(TILES, QSL)
    head = tl.program_id(1)
    if named >= 0 and tile * BLOCK_M < q_len and q_len >= MIN_QUERY:
        seq_len = tl.load(SL + seq)
        context = seq_len - q_len
        kv_col = head // (HEADS // KV_HEADS) * HEAD_DIM
        q_desc = tl.make_tensor_descriptor(
            Q, [num_tokens, HEADS * HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM]
        )
        rows_shape = [cache_rows, KV_HEADS * HEAD_DIM]
        k_desc = tl.make_tensor_descriptor(
            KC, rows_shape, [KV_HEADS * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]
        )
        v_desc = tl.make_tensor_descriptor(
            VC, rows_shape, [KV_HEADS * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]
        )
        first = tile * BLOCK_M
        # Rows past the sequence's end are the next sequence's (or the descriptor's zero fill):
        # their outputs are not stored.
        q = q_desc.load([q_start + first, head * HEAD_DIM])
        q_pos = context + first + tl.arange(0, BLOCK_M)
        bt_row = BT + seq.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # Key tiles at or before the tile's first row are seen by every row: no mask.
        masked_from = (context + first + 1) // BLOCK_N * BLOCK_N
        for n0 in range(0, masked_from, BLOCK_N):
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            k = k_desc.load([row, kv_col])
            v = v_desc.load([row, kv_col])
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        hi = tl.minimum(seq_len, context + first + BLOCK_M)
        for n0 in range(masked_from, hi, BLOCK_N):
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            offs = n0 + tl.arange(0, BLOCK_N)
            k = k_desc.load([row, kv_col])
            v = v_desc.load([row, kv_col])
            # A page's rows past the sequence's end hold whatever was there: zeroed, so that
            # their zero weights meet no NaN.
            v = tl.where((offs < seq_len)[:, None], v, 0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            visible = (offs[None, :] <= q_pos[:, None]) & (offs[None, :] < seq_len)
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, v, PRECISION, True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        rows = first + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        o_ptr = Out + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * HEAD_DIM
        tl.store(o_ptr + d[None, :], out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


def tma_page_prefill_attention(
    q: torch.Tensor,  # [T, heads, head_dim], heads dense
    k_cache: torch.Tensor,  # [num_blocks, page, kv_heads, head_dim], contiguous, page: 32 * n
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, heads, head_dim], heads dense
    tiles: torch.Tensor | None = None,  # [rows, 2] int32, prefill_tiles.py's for the step
    skip_decodes: bool = False,  # one-token sequences left alone (their rows of ``out`` too)
) -> torch.Tensor:  # [T, heads, head_dim]
    """paged_prefill_attention's plain causal case where tma_pages_serve: 32 keys an iteration,
    two stages, four warps (a sweep at llama-8b's heads: docs/design/kernels-and-limits.md,
    "Prefill through descriptor loads")."""
    num_tokens, heads, head_dim = q.shape
    num_blocks, page, kv_heads, _ = k_cache.shape
    if page % TMA_PAGE_KEYS or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            f"descriptor loads read contiguous caches of pages of a multiple of "
            f"{TMA_PAGE_KEYS} tokens, not {list(k_cache.stride())}-strided pages of {page}"
        )
    if out is None:
        out = q.new_empty(num_tokens, heads, head_dim)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    block_m = prefill_block_m(num_tokens)  # the height the engine packs its work list for
    if tiles is None:
        tiles = device_tiles(query_start_loc.tolist(), q.device, block_m)
    use_descriptor_scratch(q.device)
    _tma_page_prefill_kernel[(tiles.shape[0], heads)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tiles, out,
        scale * LOG2E, num_tokens, num_blocks * page, q.stride(0), block_tables.stride(0),
        out.stride(0), HEADS=heads, KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, PAGE=page, BLOCK_M=block_m, BLOCK_N=TMA_PAGE_KEYS,
        PRECISION=dot_precision(q.dtype), MIN_QUERY=2 if skip_decodes else 1, num_warps=4,
        num_stages=2,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch shape of the prefill kernel: keys per loop iteration, warps, pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    block_m: int | None = None  # query rows a tile; None: prefill_block_m's (the engine's)


def prefill_launch(head_dim: int, kv_fp8: bool) -> PrefillLaunch:
    """The prefill kernel's launch shape for a head size and cache dtype, from sweeps at llama-8b's
    heads (docs/design/kernels-and-limits.md, "Decode attention", the prefill kernel). Over a
    bf16 cache at head dim 128, 64 keys an iteration with three stages (2 x 3,600 fresh tokens:
    1.22 -> 0.85 ms; 8,192: 2.69 -> 1.82; 512 after 3,584: 0.62 -> 0.33 against 32 keys, two
    stages); taller 128-row tiles with 8 warps came within 10% and lost on short prompts. Over an
    e4m3 cache 64 keys too (4 x 3,800: 2.26 -> 1.79 ms). Larger heads (Gemma 3's 256) keep 32
    keys (and heads between 64 and 128, not measured): 64 was not measured there, and its tiles
    would hold twice the registers and shared memory."""
    if head_dim == 128 and not kv_fp8:
        return PrefillLaunch(block_n=64, num_stages=3)
    return PrefillLaunch(block_n=64 if head_dim <= 64 or (kv_fp8 and head_dim <= 128) else 32)
