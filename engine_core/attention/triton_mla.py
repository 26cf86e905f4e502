"""Triton kernels of multi-head latent attention (engine_core/attention/mla.py) over the paged
latent cache ``[num_blocks, block_size, R + P]`` (R = kv_lora_rank, P = qk_rope_head_dim).

- ``write_latents``: each new token's latent and rotary key into its cache slot (slot -1, a
  padding row, is skipped), reading no host value.
- ``mla_decode_attention``: the absorbed decode. Every head of a sequence reads the same cache
  rows, so a program owns a block of BLOCK_H heads of one sequence and one context split: it
  loads a tile of BLOCK_N rows once, scores it against all its heads' absorbed queries
  (q_lat [H, R] . c + q_pe [H, P] . k_pe, two matrix-unit products) and folds the same latent
  tile into the output (P @ c), so the output stays in the latent space [B, H, R] and W_UV is
  applied outside, as the torch path does. The splits are the GQA decode kernel's ("flash
  decoding"): their count is a launch constant chosen from the batch size, the head blocks and
  the block table's width (never from device values, so the launch is the same in every replay
  of a CUDA graph); each sequence uses the splits its own length needs (at least
  default_min_split's tokens each); a sequence one split covers is written directly, the others
  as partials (and their base-2 log-sum-exps) that the GQA decode's merge kernel combines.
- ``mla_prefill_attention``: the expanded path. The latent rows of the prefilling sequences'
  contexts (prefix-cache hits and earlier chunks included) go through kv_b_proj into per-head
  K [.., H, N + P] and V [.., H, V] laid out as a paged cache of their own, one page per cache
  block they came from, and the GQA prefill kernel (which takes a V head size different from
  Q/K's) runs causal attention over it with a block table that names those pages. The
  indices of a step (which rows take which path, which blocks to gather) are built once from
  its host lengths (``step_plan``) and shared by every layer.

Importing this module imports triton (see engine_core/attention/triton_kernels.py).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine_core.attention.base import cached_values, is_fp8_cache
from engine_core.attention.prefill_tiles import prefill_block_m, tile_list
from engine_core.attention.triton_kernels import (
    LOG2E,
    as_cached,
    choose_num_splits,
    default_min_split,
    dot_precision,
    merge_partials,
    paged_prefill_attention,
    partial_buffers,
    softmax_step,
    split_bounds,
    store_split,
)

# ---- latent write ------------------------------------------------------------------------------


@triton.jit
def _write_latent_kernel(
    Lat,
    Pe,
    Cache,
    Slots,
    stride_lt,
    stride_pt,
    stride_cb,
    stride_cs,
    scale_inv,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr,  # an FP8 cache: store clamp(row / scale), e4m3
):
    token = tl.program_id(0)
    slot = tl.load(Slots + token)
    if slot >= 0:
        w = tl.arange(0, BLOCK_W)
        in_lat = w < RANK
        in_pe = (w >= RANK) & (w < RANK + ROPE)
        lat = tl.load(Lat + token * stride_lt + w, mask=in_lat, other=0.0)
        pe = tl.load(Pe + token * stride_pt + tl.maximum(w - RANK, 0), mask=in_pe, other=0.0)
        row = tl.where(in_lat, lat, pe)
        dst = Cache + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + w
        row = as_cached(row, scale_inv, Cache.dtype.element_ty, QUANTIZE)
        tl.store(dst, row, mask=w < RANK + ROPE)


def write_latents(
    cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    latent: torch.Tensor,  # [T, R]
    k_pe: torch.Tensor,  # [T, P]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding, not written
    scale: float = 1.0,  # an FP8 cache stores row / scale
) -> None:
    """Each token's [latent | k_pe] row into cache slot ``slot_mapping[t]``."""
    num_tokens, rank = latent.shape
    if num_tokens == 0:
        return
    _check_latent_cache(cache)
    latent, k_pe = _last_dim_contiguous(latent), _last_dim_contiguous(k_pe)
    width = cache.shape[-1]
    _write_latent_kernel[(num_tokens,)](
        latent,
        k_pe,
        cache,
        slot_mapping,
        latent.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        1.0 / scale,
        RANK=rank,
        ROPE=width - rank,
        BLOCK_W=triton.next_power_of_2(width),
        PAGE=cache.shape[1],
        QUANTIZE=is_fp8_cache(cache),
        num_warps=4 if width >= 512 else 1,
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_latent_cache(cache: torch.Tensor) -> None:
    if cache.dim() != 3 or cache.stride(2) != 1:
        raise ValueError("the latent cache must be [num_blocks, block_size, R + P], each row dense")


# ---- absorbed decode ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaDecodeTile:
    """Launch shape of the MLA decode kernel: heads per program, cache rows per iteration,
    warps and software-pipeline stages.

    Each latent row a program reads serves its BLOCK_H heads (the other head blocks of the same
    split read it again, from L2 if they run together); more heads a program cost a larger
    [BLOCK_H, R] float32 accumulator in registers: 16 x 512 is 64 registers a thread at 4 warps.
    """

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


# Not tuned yet: vLLM's grouped MLA decode kernel (adapted from SGLang's) takes 16 heads and
# 32 rows an iteration at R = 512 on NVIDIA GPUs; ``python -m benchmarks mla --sweep`` times
# the alternatives.
DEFAULT_MLA_DECODE_TILE = MlaDecodeTile()


@triton.jit(do_not_specialize=["min_split", "num_splits", "stride_bt"])
def _mla_decode_kernel(
    QL,  # [B, H, R] absorbed queries q_nope . W_UK
    QP,  # [B, H, P] rotated rotary queries
    Cache,  # [num_blocks, PAGE, R + P]
    BT,
    SL,
    Out,  # [B, H, R]
    PO,  # [B, H, num_splits, R] float32 partial outputs
    PL,  # [B, H, num_splits] float32 base-2 log-sum-exps
    scale_log2,  # the softmax scale in base 2, times an FP8 cache's scale
    cache_scale,  # what an FP8 cache's rows are multiplied by (1.0 for others)
    min_split,
    num_splits,
    num_heads,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    CACHE_FP8: tl.constexpr,
):
    """The absorbed attention of BLOCK_H heads of a sequence's last token over one split of its
    latent rows; see the module docstring."""
    h0 = tl.program_id(0) * BLOCK_H
    split = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(SL + seq)
    split_len, _, first, last = split_bounds(
        seq_len, 0, 1, num_splits, min_split, BLOCK_N, False, False
    )
    if (split >= first) & (split <= last):
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        heads = h0 + tl.arange(0, BLOCK_H)
        h_mask = heads < num_heads
        r = tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        p = tl.arange(0, BLOCK_P)
        p_mask = p < ROPE
        q_lat = tl.load(
            QL + seq * stride_qlt + heads[:, None] * stride_qlh + r[None, :],
            mask=h_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [H, R]
        q_pe = tl.load(
            QP + seq * stride_qpt + heads[:, None] * stride_qph + p[None, :],
            mask=h_mask[:, None] & p_mask[None, :],
            other=0.0,
        )  # [H, P]
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        bt_row = BT + seq.to(tl.int64) * stride_bt
        for n0 in range(start, end, BLOCK_N):
            tok = n0 + tl.arange(0, BLOCK_N)
            n_mask = tok < end
            blk = tl.load(bt_row + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
            row = Cache + blk * stride_cb + (tok % PAGE) * stride_cs  # [N] row starts
            lat = tl.load(
                row[:, None] + r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
            )  # [N, R]: the keys' latent part and the values
            pe = tl.load(
                row[:, None] + RANK + p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0
            )  # [N, P]
            if CACHE_FP8:  # e4m3 widened exactly, through float32, to the queries' dtype
                lat = lat.to(tl.float32).to(q_lat.dtype)
                pe = pe.to(tl.float32).to(q_pe.dtype)
            s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
            s += tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)  # [H, N]
            s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
            m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, lat, PRECISION, True)

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None] * cache_scale  # [H, R]; zeros for a padding row (seq_len 0)
        o_mask = h_mask[:, None] & r_mask[None, :]
        store_split(
            Out, PO, PL, out, m_i, l_i, seq, heads, r, o_mask, h_mask, split, first, last,
            num_heads, num_splits, stride_ot, stride_oh, RANK,
        )  # fmt: skip


def mla_decode_attention(
    q_lat: torch.Tensor,  # [B, H, R]: q_nope . W_UK, one query token per sequence
    q_pe: torch.Tensor,  # [B, H, P]: rotated
    cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, the query token included; 0 = padding row (output 0)
    scale: float,
    *,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,  # None: default_min_split's
    tile: MlaDecodeTile | None = None,
    out: torch.Tensor | None = None,  # [B, H, R]
    cache_scale: float = 1.0,  # an FP8 cache holds rows / cache_scale
) -> torch.Tensor:  # [B, H, R]: softmax(q . [c | k_pe] * scale) @ c
    """The absorbed MLA decode over the paged latent cache, in the latent space.

    Reads nothing from the host but the tensors' shapes (``num_splits`` defaults to a function
    of the batch size, the head blocks and the block table's width), so a CUDA graph may
    capture it. ``tile`` overrides the launch shape (tests and the benchmark's sweep)."""
    batch, num_heads, rank = q_lat.shape
    _check_latent_cache(cache)
    page, rope = cache.shape[1], cache.shape[2] - rank
    if out is None:
        out = torch.empty_like(q_lat)
    if batch == 0:
        return out
    tile = tile or DEFAULT_MLA_DECODE_TILE
    # tl.dot takes at least 16 rows and 16 columns: fewer heads (or rotary dims) are masked.
    block_h = max(16, min(tile.block_h, triton.next_power_of_2(num_heads)))
    programs = triton.cdiv(num_heads, block_h)
    min_split = max(min_split_tokens or default_min_split(batch, programs, q_lat.device), 1)
    if num_splits is None:
        max_context = block_tables.shape[1] * page
        num_splits = choose_num_splits(batch, programs, max_context, q_lat.device, min_split)
    partial_out, partial_lse = partial_buffers(batch, num_heads, num_splits, rank, q_lat.device)
    _mla_decode_kernel[(programs, num_splits, batch)](
        q_lat,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * LOG2E * cache_scale,
        cache_scale,
        min_split,
        num_splits,
        num_heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        RANK=rank,
        ROPE=rope,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h,
        PAGE=page,
        BLOCK_N=tile.block_n,
        PRECISION=dot_precision(q_lat.dtype),
        CACHE_FP8=is_fp8_cache(cache),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if num_splits > 1:
        merge_partials(partial_out, partial_lse, seq_lens, out, None, min_split, tile.block_n)
    return out


# ---- expanded prefill --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpandedBatch:
    """Sequences whose new tokens take the expanded path, as device index tensors: built once a
    step from host lengths (``step_plan``) and read by every layer's mla_prefill_attention."""

    rows: torch.Tensor  # [Tp] int64: the step's token rows of these sequences, in order
    block_seqs: torch.Tensor  # [NB] int64: (step sequence, table column) of each context block
    block_cols: torch.Tensor  # [NB] int64
    table: torch.Tensor  # [S, max pages] int32: each sequence's pages of the expanded K/V
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32, over ``rows``
    tiles: torch.Tensor  # the prefill kernel's work list (prefill_tiles.py)
    max_query_len: int


@dataclass(frozen=True)
class StepPlan:
    """A step's split between the absorbed decode (``decode_rows`` of sequences
    ``decode_seqs``) and the expanded path (``expanded``), None where a side is empty."""

    decode_rows: torch.Tensor | None
    decode_seqs: torch.Tensor | None
    expanded: ExpandedBatch | None


@functools.lru_cache(maxsize=4)
def step_plan(
    query_start_loc: tuple[int, ...],
    seq_lens: tuple[int, ...],
    absorb_decodes: bool,
    page: int,
    device: torch.device,
) -> StepPlan:
    """The step's plan from its host lengths. Cached on them (a pure function of its
    arguments): the first latent layer of a step builds it and copies its indices to the
    device (pinned, so the copies queue behind the GPU's work rather than wait for it), the
    others reuse it."""
    starts = query_start_loc
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decodes = [s for s, n in enumerate(query_lens) if n == 1] if absorb_decodes else []
    expanded = [s for s, n in enumerate(query_lens) if n > 0 and s not in decodes]
    return StepPlan(
        _on([starts[s] for s in decodes], device) if decodes else None,
        _on(decodes, device) if decodes else None,
        expanded_batch(starts, seq_lens, expanded, page, device) if expanded else None,
    )


def expanded_batch(
    query_start_loc: tuple[int, ...] | list[int],  # the step's
    seq_lens: tuple[int, ...] | list[int],  # the step's
    seqs: list[int],  # the sequences to expand
    page: int,
    device: torch.device,
) -> ExpandedBatch:
    starts = query_start_loc
    query_lens = [starts[s + 1] - starts[s] for s in seqs]
    counts = [-(-seq_lens[s] // page) for s in seqs]
    batch_starts = [0, *itertools.accumulate(query_lens)]
    return ExpandedBatch(
        rows=_on([t for s in seqs for t in range(starts[s], starts[s + 1])], device),
        block_seqs=_on([s for s, n in zip(seqs, counts, strict=True) for _ in range(n)], device),
        block_cols=_on([c for n in counts for c in range(n)], device),
        table=_pinned(_expanded_table(counts), device),
        seq_lens=_on([seq_lens[s] for s in seqs], device, torch.int32),
        query_start_loc=_on(batch_starts, device, torch.int32),
        tiles=_pinned(
            torch.from_numpy(tile_list(query_lens, prefill_block_m(batch_starts[-1]))), device
        ),
        max_query_len=max(query_lens),
    )


def mla_prefill_attention(
    q: torch.Tensor,  # [Tp, H, N + P]: the rows of ``batch``, rotary part rotated
    cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32: the step's
    batch: ExpandedBatch,
    kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    v_dim: int,
    scale: float,
    cache_scale: float = 1.0,  # an FP8 cache holds rows / cache_scale
) -> torch.Tensor:  # [Tp, H, V]
    """Causal attention of the batch's rows over their sequences' whole contexts, each
    context's latents expanded into per-head K and V first (see the module docstring)."""
    num_heads = q.shape[1]
    page, rank = cache.shape[1], kv_b_weight.shape[1]
    blocks = block_tables[batch.block_seqs, batch.block_cols].long()  # [NB]
    rows = cached_values(cache[blocks], kv_b_weight.dtype, cache_scale)  # [NB, page, R + P]
    kv = F.linear(rows[..., :rank], kv_b_weight).view(len(blocks), page, num_heads, -1)
    k_nope, v = kv.split((kv.shape[-1] - v_dim, v_dim), dim=-1)
    k_pe = rows[..., None, rank:].expand(-1, -1, num_heads, -1)  # shared by every head
    k = torch.cat((k_nope, k_pe), dim=-1)  # [NB, page, H, N + P]
    return paged_prefill_attention(
        q,
        k,
        v.contiguous(),  # [NB, page, H, V]
        batch.table,
        batch.seq_lens,
        batch.query_start_loc,
        batch.max_query_len,
        scale,
        tiles=batch.tiles,
    )


def _expanded_table(counts: list[int]) -> torch.Tensor:
    """[len(counts), max(counts)] int32: sequence i's pages of the expanded K/V, which follow
    the earlier sequences' in order; 0 past a sequence's own (never read)."""
    table = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    first = 0
    for i, n in enumerate(counts):
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    return table


def _on(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return _pinned(torch.tensor(values, dtype=dtype), device)


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; to a GPU from pinned memory, which does not wait for the queue."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
