"""The torch reference attention backend: plain tensor ops over the paged cache, per sequence.

Slow but obviously right. It is the CPU path and the oracle the GPU kernels are tested against, so
it computes in float32 and favours clarity over speed. An FP8 (e4m3) cache stores K / k_scale and
V / v_scale and is read back times the scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.attention.base import AttentionMetadata, is_fp8_cache, write_cache_rows


class TorchReferenceBackend:
    """AttentionBackend over ``[num_blocks, block_size, kv_heads, head_dim]`` caches."""

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [T] int64, -1 = padding, not written
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Scatter each token's K/V into its cache slot; an FP8 cache stores them divided by
        their scales, rounded to e4m3."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            flat = cache.view(-1, *cache.shape[2:])  # [num_slots, kv_heads, head_dim]
            write_cache_rows(flat, slots, x[keep], scale)

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # [heads]
        attention_chunk: int | None = None,
        key_ends: torch.Tensor | None = None,  # [T]: one past each row's last key; None: causal
    ) -> torch.Tensor:  # [T, heads, head_dim]
        """Causal attention of each sequence's new tokens over its cached context (from the
        first block their window or attention chunk sees: dropping whole leading blocks that
        every query masks changes nothing, as long as the mask knows the absolute positions);
        with ``key_ends``, each row sees up to its key end instead of up to itself."""
        see = Visibility(sliding_window, attention_chunk)
        out = torch.zeros_like(q)
        starts = meta.query_start_loc_cpu
        block_size = k_cache.shape[1]
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            first = first_visible_block(seq_len - (end - start), see, block_size)
            k, v = gather_context(k_cache, v_cache, meta.block_tables[i], seq_len, first)
            if is_fp8_cache(k_cache):
                k, v = k.float() * k_scale, v.float() * v_scale
            skipped = first * block_size
            ends = None if key_ends is None else key_ends[start:end]
            out[start:end] = attend(q[start:end], k, v, scale, see, sinks, skipped, ends).to(
                q.dtype
            )
        return out


@dataclass(frozen=True)
class Visibility:
    """Which keys a query sees besides causality: those within its sliding window (the last W
    positions, itself included), and those in its attention chunk ([p // C * C, p]: Llama 4's
    chunked local attention). None: no such bound."""

    window: int | None = None
    chunk: int | None = None

    @property
    def bounded(self) -> bool:
        return self.window is not None or self.chunk is not None

    def first_key(self, position: int) -> int:
        """The first position a query at ``position`` sees."""
        first = 0
        if self.window is not None:
            first = max(first, position - self.window + 1)
        if self.chunk is not None:
            first = max(first, position - position % self.chunk)
        return first

    def first_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """``first_key`` of each position of a tensor."""
        first = torch.zeros_like(positions)
        if self.window is not None:
            first = torch.maximum(first, positions - self.window + 1)
        if self.chunk is not None:
            first = torch.maximum(first, positions - positions % self.chunk)
        return first


def first_visible_block(first_query: int, see: Visibility | int | None, block_size: int) -> int:
    """The first block a sequence's queries from position ``first_query`` on can see: 0, or
    with a sliding window or an attention chunk the block of the first query's first visible
    position (``see``: a Visibility, or a bare window). The blocks before it are never read: a
    window or chunked KV group gives them back and holds the null block in their place
    (engine_core/block_manager.py)."""
    if not isinstance(see, Visibility):
        see = Visibility(see)
    return see.first_key(first_query) // block_size


def gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    first_block: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V from block ``first_block`` on, [seq_len - first_block *
    block_size, kv_heads, head_dim] each, read through its block table."""
    block_size = k_cache.shape[1]
    blocks = block_table[first_block : -(-seq_len // block_size)].long()
    length = seq_len - first_block * block_size
    k = k_cache[blocks].flatten(0, 1)[:length]  # [length, kv_heads, head_dim]
    v = v_cache[blocks].flatten(0, 1)[:length]
    return k, v


def attend(
    q: torch.Tensor,  # [Q, heads, head_dim]: the last Q positions of the sequence
    k: torch.Tensor,  # [L, kv_heads, head_dim]
    v: torch.Tensor,  # [L, kv_heads, head_dim]
    scale: float,
    sliding_window: Visibility | int | None,
    sinks: torch.Tensor | None = None,  # [heads]
    skipped: int = 0,
    key_ends: torch.Tensor | None = None,  # [Q]: one past each query's last key (absolute)
) -> torch.Tensor:  # [Q, heads, head_dim] float32
    """Softmax attention in float32; query j sits at position L - Q + j of the context given,
    which starts ``skipped`` positions into the sequence (where an attention chunk starts
    matters). ``sinks``: one more logit per head in the softmax, whose probability weighs no
    value (as HF's gpt-oss). ``key_ends``: a query sees the keys before its end, past itself
    (an image's tokens, Gemma 3), instead of up to itself."""
    num_queries, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group, as HF's repeat_kv does.
    k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.float().repeat_interleave(group, dim=1)  # [L, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, Q, L]
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device)[:, None]  # [Q, 1]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    if key_ends is None:
        masked = k_pos > q_pos
    else:
        masked = k_pos + skipped >= key_ends.to(q.device, torch.int64)[:, None]
    see = sliding_window if isinstance(sliding_window, Visibility) else Visibility(sliding_window)
    if see.bounded:  # e.g. a query sees itself and the sliding_window - 1 tokens before it
        masked |= k_pos < see.first_keys(q_pos + skipped) - skipped
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", softmax_with_sinks(scores, sinks), v)  # [Q, H, D]


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [H, ..., L] float32 -> probabilities over L; with ``sinks`` [H] each head's sink
    logit joins the denominator (its own probability is dropped)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
