"""The Triton attention backend: the GPU implementation of AttentionBackend.

Decode-only batches (every sequence has one new token) take the split-context decode kernel,
after the shared-prefix kernel where the step's sequences open with the same pages (the
metadata's ``shared_prefix``: a system prompt the prefix cache shares, attended once for all;
in a step with prompt rows, the one-token sequences' pages).
Batches where every sequence has the same few new tokens (a speculative verify step: the last
known token and K drafts) take its verify variant, K + 1 queries a sequence
(``paged_verify_attention``), where the queries and the group's heads fit its tile. Any other
batch with a longer query (prompts, prompt chunks, prefix-cached prompts, mixed with decodes)
takes the varlen prefill kernel, as does any step with key ends (Gemma 3's image rows, which
see past themselves; such a step runs eagerly); otherwise its one-token sequences go to the
decode kernel (which finds them through the query starts) in prefill graphs and in eager steps
with MIXED_DECODE_ROWS of them. Their launches depend only on tensor shapes, K + 1 and
``max_query_len`` (the prefill kernel's grid), so the model runner captures them in CUDA graphs
(engine_core/cuda_graph.py). All read K/V through the block tables, after ``write_kv`` has put
this step's tokens into the cache.
"""

from __future__ import annotations

import torch

from engine_core.attention.base import (
    MIXED_DECODE_ROWS,
    SHARED_PREFIX_MIN_ROWS,
    AttentionMetadata,
    is_fp8_cache,
)
from engine_core.attention.prefill_tiles import device_tiles
from engine_core.attention.triton_kernels import (
    SHARED_MAX_HEAD_DIM,
    NewTokens,
    paged_decode_attention,
    paged_prefill_attention,
    paged_verify_attention,
    rotary_decode_attention,
    rotary_write_kv_cache,
    served_row_order,
    verify_serves,
    write_kv_cache,
)

# A decode step's rotary and KV write ride in the decode kernel's launch (decode_rotated) for
# heads of at most ROPE_IN_DECODE_MAX_HEAD_DIM dims: one launch fewer a layer shortened the
# decode graphs of head dim 64 (smollm2, llama-1b) by 1-4%, while at head dim 128 (llama-8b)
# the heavier attention kernel cost more than the launch it saved (1% longer;
# docs/design/kernels-and-limits.md, "Decode attention").
ROPE_IN_DECODE_MAX_HEAD_DIM = 64


class TritonBackend:
    """AttentionBackend over ``[num_blocks, block_size, kv_heads, head_dim]`` caches."""

    # Decode launches depend on tensor shapes only, so the model runner may capture them.
    cuda_graph_safe = True
    # write_kv_rotated: the rotary embedding rides in the KV write's launch (attention/layer.py).
    rotates_in_kv_write = True
    # Decode launches take the step's row order (served_row_order): the input batch packs it.
    orders_decode_rows = True

    def rotates_in_decode(self, head_dim: int) -> bool:
        """Whether decode_rotated (a decode step's rotary and KV write in the attention's
        launch) serves heads of ``head_dim`` dims (see ROPE_IN_DECODE_MAX_HEAD_DIM)."""
        return head_dim <= ROPE_IN_DECODE_MAX_HEAD_DIM

    @staticmethod
    def splits_decodes(meta: AttentionMetadata, q: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether a step with prompt rows gives its one-token sequences to the decode kernel
        (see MIXED_DECODE_ROWS): always in a prefill graph (captured once, it replays steps
        with and without decodes; the launch finds them from the query starts), in an eager
        step from MIXED_DECODE_ROWS of them, never where V's head size is not the query's
        (MLA's expanded prefill; the decode kernel's output has Q's shape)."""
        if v_cache.shape[3] != q.shape[2]:
            return False
        return meta.padded or meta.num_decode_rows >= MIXED_DECODE_ROWS

    def __init__(self) -> None:
        # Layers that took the shared-prefix pass, counted so that the CUDA-graph runner can
        # tell whether any layer of its model does (cuda_graph.py).
        self.shared_prefix_passes = 0

    def shared_prefix(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        sliding_window: int | None,
        attention_chunk: int | None,
    ) -> torch.Tensor | None:
        """The step's shared-prefix tokens where this layer attends its one-token sequences'
        shared pages once for all of them: SHARED_PREFIX_MIN_ROWS query rows or more (a
        graph's rows: a shape), a 16-bit or float32 cache, heads of 16 to SHARED_MAX_HEAD_DIM,
        neither window nor chunk (their keys start past the shared pages)."""
        if meta.shared_prefix is None or q.shape[0] < SHARED_PREFIX_MIN_ROWS:
            return None
        if sliding_window is not None or attention_chunk is not None:
            return None
        if not 16 <= q.shape[2] <= SHARED_MAX_HEAD_DIM or is_fp8_cache(k_cache):
            return None
        self.shared_prefix_passes += 1
        return meta.shared_prefix

    def verifies(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        queries: int,
        plain: bool = True,
    ) -> bool:
        """Whether a step of ``queries`` new tokens a sequence attends through the verify
        kernel for a layer of these heads (``plain``: no sink logits, no attention chunk;
        those take the prefill kernel), reading no host value but shapes."""
        return plain and verify_serves(num_heads, num_kv_heads, head_dim, queries)

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
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def write_kv_rotated(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]: rotated in place
        k: torch.Tensor,  # [T, kv_heads, head_dim]: rotated into the cache
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        cos: torch.Tensor,  # [T, rotary_dim]
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        rotary_write_kv_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def decode_rotated(
        self,
        q: torch.Tensor,  # [B, heads, head_dim], not yet rotated
        k: torch.Tensor,  # [B, kv_heads, head_dim], not yet rotated
        v: torch.Tensor,  # [B, kv_heads, head_dim]
        cos: torch.Tensor,  # [B, rotary_dim]
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,  # decode only: one new token a sequence
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:  # [B, heads, head_dim]
        """write_kv_rotated then forward, for a decode step, in the decode kernel's launch;
        in two where this layer attends a shared prefix (``shared_prefix``): reading the shared
        pages once for all rows saves more than the launch the fusion saves, and the pass needs
        q rotated before the decode kernel runs."""
        shared = self.shared_prefix(meta, q, k_cache, sliding_window, attention_chunk)
        order = served_row_order(meta.row_order, q.shape[0])
        if shared is not None:
            scales = (k_scale, v_scale)
            self.write_kv_rotated(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, *scales)
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                k_scale=k_scale, v_scale=v_scale, shared_prefix=shared, row_order=order,
            )  # fmt: skip
        new = NewTokens(k, v, cos, sin, meta.slot_mapping)
        return rotary_decode_attention(
            q, new, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
            attention_chunk=attention_chunk, row_order=order,
        )  # fmt: skip

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
        sinks: torch.Tensor | None = None,  # [heads]: gpt-oss's sink logits
        attention_chunk: int | None = None,  # Llama 4's chunked local attention
        key_ends: torch.Tensor | None = None,  # [T]: rows that see past themselves (Gemma 3)
    ) -> torch.Tensor:  # [T, heads, head_dim]
        scales = {
            "k_scale": k_scale,
            "v_scale": v_scale,
            "sinks": sinks,
            "attention_chunk": attention_chunk,
        }
        if meta.is_decode_only and key_ends is None:
            # T == B here; the launch reads no host value but shapes (CUDA-graph safe).
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                sliding_window=sliding_window,
                shared_prefix=self.shared_prefix(meta, q, k_cache, sliding_window, attention_chunk),
                row_order=served_row_order(meta.row_order, q.shape[0]),
                **scales,
            )
        queries = meta.uniform_query_len
        plain = sinks is None and attention_chunk is None and key_ends is None
        plain = plain and v_cache.shape[3] == q.shape[2]
        if queries and self.verifies(q.shape[1], k_cache.shape[2], q.shape[2], queries, plain):
            return paged_verify_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, queries, scale,
                sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        # A prefill graph's padding rows are visited by no program: zero them, so nothing
        # after attention reads memory left over from an earlier replay.
        out = torch.zeros_like(q) if meta.padded else None
        if meta.prefill_tiles is None:  # metadata made by hand (the engine packs the list)
            meta.prefill_tiles = device_tiles(meta.query_start_loc_cpu, q.device)
        split = key_ends is None and self.splits_decodes(meta, q, v_cache)
        if split:
            out = q.new_empty(q.shape) if out is None else out
            paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                sliding_window=sliding_window, out=out, mixed_starts=meta.query_start_loc,
                shared_prefix=self.shared_prefix(meta, q, k_cache, sliding_window, attention_chunk),
                **scales,
            )  # fmt: skip
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            sliding_window=sliding_window,
            out=out,
            tiles=meta.prefill_tiles,
            skip_decodes=split,
            key_ends=key_ends,
            **scales,
        )
