"""The attention-backend interface and the per-forward metadata every backend reads.

A forward runs one flattened batch of T new tokens from B sequences. Sequence i owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and has ``seq_lens[i]`` tokens of context in total,
the new ones included, so its new tokens sit at positions ``seq_lens[i] - query_len_i ..
seq_lens[i] - 1``. This one shape covers a whole prompt, a chunk of a long prompt, a prompt whose
first blocks came from the prefix cache, and a decode (query_len 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

FP8_MAX = 448.0  # e4m3's largest finite value: what an FP8 cache's writes clamp to

# An eager step mixing decodes with prompt rows attends its one-token sequences through the
# Triton decode kernel (context splits, a KV group's heads in one program) from this many on:
# the prefill kernel gives each a query tile of 64 rows per head, one of them used, so a
# long-context decode costs it about 64x its work; below it the decode kernel's two extra
# launches a layer are not worth it (attention/triton_backend.py; the warm-up runs such a step).
MIXED_DECODE_ROWS = 8

# A decode step of ORDERED_DECODE_MIN_ROWS rows or more (a graph's) launches its rows longest
# first in the Triton decode kernel (AttentionMetadata.row_order, served_row_order): a served
# step's lengths spread from a few dozen tokens to a few thousand, and in the batch's order the
# longest rows' programs can start last and end the launch alone (the warm-up runs such a step
# over a shared prefix too). H100, graph calls, us, rows spread over 64-2,300 tokens, the
# engine's launch -> longest first: llama-8b 192 / 256 / 384 rows 336.0 -> 321.8, 429.3 ->
# 400.4, 623.5 -> 597.4; llama-1b 256 rows 213.1 -> 204.4; rows of one length unchanged (384 x
# 256: 135.3 / 134.5, 72.4 / 72.9). At 64 and 128 rows the order alone cost 10% (114.7 ->
# 125.8, 229.1 -> 249.7); two splits with it gained 5-7% there (109.0, 212.5) but cost 5-19% on
# rows of one length (384 x 64: 36.8 -> 43.9), which a graph cannot tell apart
# (docs/design/goodput-and-multi-turn.md, "In the engine: longest first from 192 rows").
ORDERED_DECODE_MIN_ROWS = 192

# A decode step whose sequences all open with the same pages (a system prompt the prefix cache
# shares) attends those pages once for all of them where there are at least
# SHARED_PREFIX_MIN_ROWS sequences and SHARED_PREFIX_MIN_TOKENS shared tokens: fewer rows read
# the pages few times over, and fewer tokens leave the extra pass nothing to save
# (attention/triton_kernels.py, _shared_prefix_kernel).
SHARED_PREFIX_MIN_ROWS = 8
SHARED_PREFIX_MIN_TOKENS = 256


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether a KV cache holds e4m3 values (with per-layer scales) rather than K and V."""
    return cache.dtype == torch.float8_e4m3fn


def write_cache_rows(
    flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float = 1.0
) -> None:
    """``rows`` into ``flat``'s rows ``slots`` (the cache viewed one slot a row); an FP8 cache
    stores them divided by ``scale``, clamped to e4m3's range and rounded."""
    if is_fp8_cache(flat):  # torch has no index_copy_ for float8: copy its bytes
        rows = (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(flat.dtype)
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows.to(flat.dtype))


def cached_values(rows: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Rows read from a cache as values of ``dtype``: an FP8 cache's times its scale."""
    if is_fp8_cache(rows):
        return rows.to(dtype) * scale
    return rows.to(dtype)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset); -1 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32, on the device
    seq_lens: torch.Tensor  # [B] int32, on the device
    # [B, max_blocks] int32, padded with 0; rows may be strided past max_blocks (a view)
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, so the reference path and the launch logic never sync on the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # True in a prefill CUDA graph, whose buffers have rows past ``query_start_loc[-1]`` that
    # belong to no sequence: the backend must leave finite values (zeros) in them.
    padded: bool = False
    # The Triton prefill kernel's work list (attention/prefill_tiles.py), [tiles, 2] int32 on
    # the device: packed with the step's inputs (None for decode-only steps), or a graph's buffer.
    prefill_tiles: torch.Tensor | None = None
    # Q where every sequence has exactly Q > 1 new tokens, rows b*Q .. b*Q+Q-1 (a speculative
    # verify step: the last known token and K drafts, Q = K + 1; or prompt chunks that happen
    # to be as long), else 0; set by a speculating engine's input batch only. A backend may
    # then attend decode-style, Q queries a sequence (triton_kernels.py paged_verify_attention).
    uniform_query_len: int = 0
    # [2] int32 on the device: the tokens (whole pages) that the block table of every sequence
    # with one new token opens with in the same blocks, short of each one's last token
    # (shared_prefix_tokens), and the index of one such sequence (its table row holds the
    # pages); None where there are none. A graph's buffer is always given with one KV group
    # (0 tokens in steps without).
    shared_prefix: torch.Tensor | None = None
    # [B] int32 on the device, a decode-only step's: its sequences longest first (a stable
    # argsort of their lengths), the order a backend may launch their programs in so that the
    # longest do not start last; a graph's buffer pads it with the padding rows' own indices.
    # None in other steps (and in metadata made by hand): the batch's order.
    row_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @cached_property
    def num_decode_rows(self) -> int:
        """How many sequences have exactly one new token: counted once a step from the host
        starts, read by every layer."""
        return int(np.count_nonzero(np.diff(np.asarray(self.query_start_loc_cpu)) == 1))


def shared_prefix_tokens(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """The tokens of the leading blocks that every row of ``tables`` [B, width] holds alike,
    in whole blocks before every sequence's last token (``seq_lens`` [B], each > 0); 0 under
    SHARED_PREFIX_MIN_ROWS rows or SHARED_PREFIX_MIN_TOKENS tokens."""
    if len(seq_lens) < SHARED_PREFIX_MIN_ROWS:
        return 0
    limit = (int(seq_lens.min()) - 1) // block_size  # blocks before the shortest's last token
    if limit * block_size < SHARED_PREFIX_MIN_TOKENS:
        return 0
    head = tables[:, :limit]
    if not (head[:, 0] == head[0, 0]).all():  # most batches without one end here
        return 0
    same = (head == head[0]).all(axis=0)  # [limit]
    tokens = (limit if same.all() else int(same.argmin())) * block_size
    return tokens if tokens >= SHARED_PREFIX_MIN_TOKENS else 0


class AttentionBackend(Protocol):
    """What a model's attention layer calls; the model runner picks the implementation."""

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [T]
        k_scale: float = 1.0,  # an FP8 cache stores k / k_scale (ignored by other dtypes)
        v_scale: float = 1.0,
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,  # an FP8 cache's values times these are K and V
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # [heads]: a logit in each softmax's denominator
        attention_chunk: int | None = None,  # a query at p sees only keys in [p // C * C, p]
        # [T] int32: one past the last position each row sees (past itself for an image's
        # tokens in Gemma 3); None: causal. The window still bounds the first key.
        key_ends: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...
