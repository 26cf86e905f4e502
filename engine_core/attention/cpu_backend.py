"""The CPU attention backend: batched decode and per-prompt SDPA over the paged cache.

The torch reference (torch_ref.py) attends one sequence at a time with a dozen small ops each, so
a decode step of 64 sequences on a 30-layer model runs some 20,000 of them. Here all the sequences
of a step that decode (one new token) attend together: their context's KV blocks are gathered in a
few block-granular copies, in chunks of sequences small enough that the copy is still in the
last-level cache when torch's fused CPU attention (``scaled_dot_product_attention``) reads it, with
one boolean mask per step (per sliding window or attention chunk) for the padding. A layer with
attention sinks (gpt-oss) takes the same gathers with the scores written out (``einsum_decode``,
``sink_prompt_attention``): SDPA has no sink term. A step whose one sequence decodes
(one request at a time) reads its exact context instead: a view of the cache where its blocks are
consecutive, else one gather, with no padding, mask or zeroing. Prompts, prompt chunks and
prefix-cached prompts attend one by one, each a single SDPA call.

What the gathers need is planned once per forward (``StepPlan``: the decode rows, each chunk's
block ids, the masks) and shared by every layer: the backend keeps the plan of the metadata it
last saw. An FP8 (e4m3) cache goes through the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_core.attention.base import AttentionMetadata, is_fp8_cache
from engine_core.attention.torch_ref import (
    TorchReferenceBackend,
    Visibility,
    first_visible_block,
    gather_context,
)

# Bytes of gathered K and V per chunk of decode sequences: small enough to stay in the last-level
# cache between the gather and the attention that reads it (measured on a 32 MiB L3: 2-8 MiB
# chunks ran 1.3x faster than one gather of a 64-sequence batch).
CHUNK_BYTES = 4 * 2**20


@dataclass
class DecodeGroup:
    """The sequences of a step that decode, planned for batched attention."""

    rows: torch.Tensor | None  # [Bd] int64 query rows; None: every row of the batch, in order
    # [Bd] int64: each sequence's context length counted from its first gathered block
    seq_lens: torch.Tensor
    # [Bd] int64: the position of each sequence's first gathered slot (where a chunk starts
    # is a matter of absolute positions)
    offsets: torch.Tensor
    # [Bd, nb] int64: each sequence's nb blocks from the first its window or attention chunk
    # sees (block 0 without either); past its table's end, whatever block: those rows are zeroed
    block_ids: torch.Tensor
    block_size: int
    chunk_seqs: int  # sequences per gather
    # Per chunk of chunk_seqs sequences: its gathered rows (of n * slots) past their sequence's end.
    pad_rows: list[torch.Tensor]
    # visibility -> [Bd, 1, 1, slots] float32: 0 where attended, -inf elsewhere (SDPA would turn
    # a boolean mask into this on every call: once a step here instead of once per layer)
    masks: dict[Visibility, torch.Tensor] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        """Context slots each gathered sequence holds: whole blocks, past its end masked."""
        return self.block_ids.shape[1] * self.block_size

    def mask(self, see: Visibility) -> torch.Tensor:
        """[Bd, 1, 1, slots] additive float32 mask: 0 on the slots each sequence's query
        attends, -inf on the others."""
        if see not in self.masks:
            pos = torch.arange(self.slots)[None, :]  # [1, W]
            lens = self.seq_lens[:, None]  # [Bd, 1]
            keep = pos < lens
            if see.bounded:  # the query (at lens - 1) sees from its first visible key on
                offsets = self.offsets[:, None]
                keep &= pos >= see.first_keys(lens - 1 + offsets) - offsets
            mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
            self.masks[see] = mask[:, None, None, :]
        return self.masks[see]


def rows_past_end(seq_lens: torch.Tensor, slots: int, chunk_seqs: int) -> list[torch.Tensor]:
    """For each chunk of ``chunk_seqs`` sequences, the rows of its gather ([n * slots] rows of
    KVH * D) that lie past their sequence's end."""
    past_end = torch.arange(slots)[None, :] >= seq_lens[:, None]  # [Bd, W]
    return [chunk.reshape(-1).nonzero().squeeze(1) for chunk in past_end.split(chunk_seqs)]


@dataclass(frozen=True)
class SingleDecode:
    """A step whose only sequence decodes: its context, read exactly (no padding to mask)."""

    seq_len: int
    block_ids: torch.Tensor  # [nb] int64, the blocks holding its seq_len slots
    first_block: int | None  # where those blocks are consecutive, the first: a view, no gather
    visible: int | None = None  # how many of the last slots its query sees; None: all

    def context(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's K and V, [seq_len, KVH, D] each."""
        if self.first_block is not None:
            blocks = slice(self.first_block, self.first_block + len(self.block_ids))
            k, v = k_cache[blocks], v_cache[blocks]
        else:
            k, v = k_cache.index_select(0, self.block_ids), v_cache.index_select(0, self.block_ids)
        return k.flatten(0, 1)[: self.seq_len], v.flatten(0, 1)[: self.seq_len]


def plan_single_decode(
    block_table: torch.Tensor,
    seq_len: int,
    block_size: int,
    first_block: int = 0,
    see: Visibility = Visibility(),
) -> SingleDecode:
    """The sequence's context from block ``first_block`` on (the first its window or attention
    chunk sees)."""
    block_ids = block_table[first_block : -(-seq_len // block_size)].long()
    first = int(block_ids[0])
    consecutive = torch.equal(block_ids, torch.arange(first, first + len(block_ids)))
    length = seq_len - first_block * block_size
    visible = seq_len - see.first_key(seq_len - 1) if see.bounded else None
    return SingleDecode(length, block_ids, first if consecutive else None, visible)


@dataclass
class StepPlan:
    meta: AttentionMetadata
    decode: DecodeGroup | None
    prompts: list[int]  # the sequences with more than one new token
    single: SingleDecode | None = None  # set instead of decode when the step is one decode
    see: Visibility = Visibility()  # the layers' window and attention chunk it was planned for


# Plans kept per forward: one per KV layer group's metadata and visibility (a few at most).
_MAX_PLANS = 16


class CpuBackend(TorchReferenceBackend):
    """AttentionBackend for CPU tensors."""

    def __init__(self) -> None:
        # This forward's plans by (metadata, visibility): a model with KV layer groups passes
        # each group's metadata to its layers, and each is planned once per forward.
        self._plans: dict[tuple[int, Visibility], StepPlan] = {}
        self._last_plan: StepPlan | None = None
        # The last slot mapping seen, and whether it has no padding (-1): checked once a step.
        self._slots: torch.Tensor | None = None
        self._slots_unpadded = False

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, -1 = padding, not written
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """The reference's write, without its boolean selection (two ops per tensor per layer)
        when no slot is padding, as on the CPU's unpadded batches."""
        if is_fp8_cache(k_cache) or not self._unpadded(slot_mapping):
            super().write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
            return
        for cache, x in ((k_cache, k), (v_cache, v)):
            x = x if x.dtype == cache.dtype else x.to(cache.dtype)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)

    def _unpadded(self, slot_mapping: torch.Tensor) -> bool:
        if self._slots is not slot_mapping:
            self._slots = slot_mapping
            self._slots_unpadded = slot_mapping.numel() == 0 or bool(slot_mapping.min() >= 0)
        return self._slots_unpadded

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
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
        if is_fp8_cache(k_cache) or (key_ends is not None and sinks is not None):
            return super().forward(
                q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, sinks,
                attention_chunk, key_ends,
            )  # fmt: skip
        see = Visibility(sliding_window, attention_chunk)
        plan = self._plan_for(meta, k_cache, see)
        if plan.single is not None:
            k, v = plan.single.context(k_cache, v_cache)
            return single_decode_attention(q, k, v, scale, plan.single.visible, sinks)
        group = plan.decode
        if group is not None and group.rows is None:  # every row decodes
            return decode_attention(q, k_cache, v_cache, group, scale, see, sinks)
        out = torch.empty_like(q)
        if group is not None:
            out[group.rows] = decode_attention(
                q[group.rows], k_cache, v_cache, group, scale, see, sinks
            )
        starts, block_size = meta.query_start_loc_cpu, k_cache.shape[1]
        for seq in plan.prompts:
            start, end = starts[seq], starts[seq + 1]
            seq_len = meta.seq_lens_cpu[seq]
            first = first_visible_block(seq_len - (end - start), see, block_size)
            k, v = gather_context(k_cache, v_cache, meta.block_tables[seq], seq_len, first)
            skipped = first * block_size
            if sinks is None:
                ends = None if key_ends is None else key_ends[start:end]
                out[start:end] = prompt_attention(q[start:end], k, v, scale, see, skipped, ends)
            else:
                out[start:end] = sink_prompt_attention(
                    q[start:end], k, v, scale, see, sinks, skipped
                )
        return out

    def _plan_for(
        self, meta: AttentionMetadata, k_cache: torch.Tensor, see: Visibility
    ) -> StepPlan:
        """This forward's plan for ``meta`` and ``see``: made by the first attention layer
        that reads them, reused by the others (a plan keeps its metadata, so the id in the key
        is not reused while the plan is kept)."""
        plan = self._last_plan
        if plan is not None and plan.meta is meta and plan.see == see:
            return plan  # the common case: the layer before read the same plan
        key = (id(meta), see)
        plan = self._plans.get(key)
        if plan is None or plan.meta is not meta:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = plan_step(meta, k_cache, see)
        self._last_plan = plan
        return plan


def plan_step(
    meta: AttentionMetadata, k_cache: torch.Tensor, see: Visibility | int | None = None
) -> StepPlan:
    """Split a step's sequences into decodes (batched) and prompts (one by one). With a
    window or an attention chunk (``see``; a bare int is a window), each decode reads its
    context from the first block its query sees: the blocks before it are never gathered (a
    window or chunked KV group holds the null block there)."""
    if not isinstance(see, Visibility):
        see = Visibility(see)
    starts = meta.query_start_loc_cpu
    decodes, prompts = [], []
    for seq in range(meta.num_seqs):
        query_len = starts[seq + 1] - starts[seq]
        if query_len == 1:
            decodes.append(seq)
        elif query_len > 1:
            prompts.append(seq)
    if not decodes:
        return StepPlan(meta, None, prompts, see=see)
    block_size = k_cache.shape[1]
    if meta.num_seqs == 1:
        seq_len = meta.seq_lens_cpu[0]
        first = first_visible_block(seq_len - 1, see, block_size)
        single = plan_single_decode(meta.block_tables[0], seq_len, block_size, first, see)
        return StepPlan(meta, None, prompts, single, see)
    index = torch.tensor(decodes, dtype=torch.int64)
    seq_lens = [meta.seq_lens_cpu[s] for s in decodes]
    # With a window or a chunk, each decode's context from its first visible block, its length
    # from there.
    firsts = [first_visible_block(n - 1, see, block_size) for n in seq_lens] if see.bounded else []
    offsets = torch.tensor(firsts, dtype=torch.int64) * block_size if any(firsts) else None
    if any(firsts):
        seq_lens = [n - f * block_size for n, f in zip(seq_lens, firsts, strict=True)]
    num_blocks = -(-max(seq_lens) // block_size)
    if any(firsts):
        width = meta.block_tables.shape[1]
        columns = torch.tensor(firsts)[:, None] + torch.arange(num_blocks)[None, :]  # [Bd, nb]
        # Columns past a table's width are past its sequence's end: their rows are zeroed.
        block_ids = meta.block_tables[index[:, None], columns.clamp_(max=width - 1)].long()
    else:
        block_ids = meta.block_tables[index, :num_blocks].long()  # [Bd, nb]
    # Every sequence has one query row, at row starts[seq]; in a decode-only batch row i is seq i.
    rows = None if len(decodes) == len(starts) - 1 else torch.tensor([starts[s] for s in decodes])
    per_seq_bytes = 2 * num_blocks * k_cache[0].numel() * k_cache.element_size()
    chunk_seqs = max(1, CHUNK_BYTES // per_seq_bytes)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    pad_rows = rows_past_end(lens, num_blocks * block_size, chunk_seqs)
    if offsets is None:
        offsets = torch.zeros_like(lens)
    group = DecodeGroup(rows, lens, offsets, block_ids, block_size, chunk_seqs, pad_rows)
    return StepPlan(meta, group, prompts, see=see)


def decode_attention(
    q: torch.Tensor,  # [Bd, H, D]: one query per sequence, at its last position
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    see: Visibility,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:  # [Bd, H, D]
    """The decode sequences' attention, a chunk of sequences at a time."""
    num_seqs, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k_blocks = k_cache.view(k_cache.shape[0], -1)  # [num_blocks, block_size * KVH * D]
    v_blocks = v_cache.view(v_cache.shape[0], -1)
    # torch's fused CPU attention is the fastest in float32, and 5x slower than two einsums
    # (oneDNN matmuls) in bf16, whose scores are then taken in float32.
    attend = sdpa_decode if q.dtype == torch.float32 and sinks is None else einsum_decode
    mask = group.mask(see)  # [Bd, 1, 1, W]
    out = torch.empty_like(q)
    for lo in range(0, num_seqs, group.chunk_seqs):
        hi = min(lo + group.chunk_seqs, num_seqs)
        ids = group.block_ids[lo:hi].reshape(-1)  # [n * nb]
        shape = (hi - lo, group.slots, num_kv_heads, head_dim)
        k = k_blocks.index_select(0, ids).view(shape)  # [n, W, KVH, D]
        v = v_blocks.index_select(0, ids).view(shape)  # [n, W, KVH, D]
        # The slots past a sequence's end hold whatever an earlier owner of the block left
        # (or were never written): masked scores weigh 0, but 0 * inf is NaN, so zero them.
        rows = group.pad_rows[lo // group.chunk_seqs]
        k.view(-1, num_kv_heads * head_dim).index_fill_(0, rows, 0.0)
        v.view(-1, num_kv_heads * head_dim).index_fill_(0, rows, 0.0)
        out[lo:hi] = attend(q[lo:hi], k, v, mask[lo:hi], scale, sinks)
    return out


def single_decode_attention(
    q: torch.Tensor,  # [1, H, D]: the query at the sequence's last position
    k: torch.Tensor,  # [L, KVH, D]: the whole context, the query's own slot included
    v: torch.Tensor,  # [L, KVH, D]
    scale: float,
    visible: int | None,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:  # [1, H, D]
    """One sequence's decode: the last query sees every position (or the last ``visible``:
    its window's, its attention chunk's), so there is nothing to mask."""
    if visible is not None:
        k, v = k[-visible:], v[-visible:]
    attend = sdpa_decode if q.dtype == torch.float32 and sinks is None else einsum_decode
    return attend(q, k[None], v[None], None, scale, sinks)


def sdpa_decode(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [n, W, KVH, D]
    v: torch.Tensor,  # [n, W, KVH, D]
    mask: torch.Tensor | None,  # [n, 1, 1, W] float32, additive; None: every slot is read
    scale: float,
    sinks: None = None,  # SDPA has no sink term: einsum_decode serves layers with sinks
) -> torch.Tensor:  # [n, H, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [n, H, 1, D]
        k.transpose(1, 2),  # [n, KVH, W, D]
        v.transpose(1, 2),
        attn_mask=None if mask is None else mask.to(q.dtype),
        scale=scale,
        enable_gqa=True,
    )  # [n, H, 1, D]
    return out.squeeze(2)


def einsum_decode(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [n, W, KVH, D]
    v: torch.Tensor,  # [n, W, KVH, D]
    mask: torch.Tensor | None,  # [n, 1, 1, W] float32, additive; None: every slot is read
    scale: float,
    sinks: torch.Tensor | None = None,  # [H]: a logit in each head's denominator
) -> torch.Tensor:  # [n, H, D]
    """Query head h reads KV head h // G: the G heads of a group share one matmul."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.view(n, num_kv_heads, group, head_dim)  # [n, KVH, G, D]
    scores = torch.einsum("nkgd,nwkd->nkgw", grouped, k).float() * scale  # [n, KVH, G, W]
    if mask is not None:
        scores = scores + mask
    if sinks is not None:  # head h = kv head h // G, member h % G: the view's order
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand(n, -1, -1, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1].to(v.dtype)
    else:
        probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.einsum("nkgw,nwkd->nkgd", probs, v).reshape(n, num_heads, head_dim)


def prompt_attention(
    q: torch.Tensor,  # [Q, H, D]: the last Q positions of the sequence
    k: torch.Tensor,  # [L, KVH, D]
    v: torch.Tensor,  # [L, KVH, D]
    scale: float,
    see: Visibility | int | None,
    skipped: int = 0,
    key_ends: torch.Tensor | None = None,  # [Q]: one past each query's last key (absolute)
) -> torch.Tensor:  # [Q, H, D]
    """Causal attention of a prompt's (or chunk's) queries over its context, which starts
    ``skipped`` positions into the sequence; with ``key_ends``, each query sees up to its end
    (past itself for an image's tokens, Gemma 3)."""
    num_queries, seq_len = q.shape[0], k.shape[0]
    bounded = _bounds(see, seq_len + skipped) or key_ends is not None
    if num_queries < seq_len and not bounded and _FLASH_CPU is not None:
        return prefix_and_chunk_attention(q, k, v, scale)
    keep = None
    if num_queries < seq_len or bounded:
        keep = visible_keys(num_queries, seq_len, see, skipped, key_ends)
    # A whole prompt with no window is plain causal attention: SDPA's causal kernel skips the
    # masked tiles (half the work) and reads no mask (torch's is_causal is top-left aligned,
    # which is right only when the queries are the whole context).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, Q, D]
        k.transpose(0, 1)[None],  # [1, KVH, L, D]
        v.transpose(0, 1)[None],
        attn_mask=keep,
        is_causal=keep is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1)


# torch's CPU flash-attention kernel with its log-sum-exp (what F.scaled_dot_product_attention
# runs on the CPU without a mask, which returns no LSE); None on a torch without it.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_and_chunk_attention(
    q: torch.Tensor,  # [Q, H, D]: the last Q positions
    k: torch.Tensor,  # [L, KVH, D], L > Q
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    """Causal attention of a chunk's (or a prefix hit's) queries over their whole context, no
    window: every query sees all of the prefix and its chunk causally, so it is two flash calls,
    one unmasked over the prefix and one causal over the chunk (its queries are its keys, which
    is the top-left alignment torch's causal flag takes), merged by their log-sum-exps. With a
    mask SDPA takes its math path on the CPU: a [H, Q, L] float32 score tensor a layer (a
    2,048-token chunk over 6,890 tokens: 273 against 185 ms a layer, two cores)."""
    assert _FLASH_CPU is not None
    num_queries, num_heads = q.shape[0], q.shape[1]
    group = num_heads // k.shape[1]
    prefix = k.shape[0] - num_queries
    keys = k.transpose(0, 1).repeat_interleave(group, 0)[None]  # [1, H, L, D]
    values = v.transpose(0, 1).repeat_interleave(group, 0)[None]
    query = q.transpose(0, 1)[None]  # [1, H, Q, D]
    seen, seen_lse = _FLASH_CPU(
        query, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False, scale=scale
    )[:2]
    own, own_lse = _FLASH_CPU(
        query, keys[:, :, prefix:], values[:, :, prefix:], 0.0, True, scale=scale
    )[:2]
    lse = torch.logaddexp(seen_lse, own_lse)  # [1, H, Q]
    out = seen * (seen_lse - lse).exp()[..., None] + own * (own_lse - lse).exp()[..., None]
    return out[0].transpose(0, 1).to(q.dtype)


def _bounds(see: Visibility | int | None, seq_len: int) -> bool:
    """Whether a window or chunk hides some key from some query of a sequence of seq_len."""
    if not isinstance(see, Visibility):
        see = Visibility(see)
    window_bounds = see.window is not None and see.window < seq_len
    return window_bounds or (see.chunk is not None and see.chunk < seq_len)


def visible_keys(
    num_queries: int,
    seq_len: int,
    see: Visibility | int | None,
    skipped: int = 0,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Q, L] bool: which keys each of the last Q queries of a context of L sees (itself and
    those before it, or those before its ``key_ends`` entry, within the window and the
    attention chunk; ``see`` a bare int is a window). The context starts ``skipped`` positions
    into the sequence."""
    if not isinstance(see, Visibility):
        see = Visibility(see)
    q_pos = torch.arange(seq_len - num_queries, seq_len)[:, None]  # [Q, 1]
    k_pos = torch.arange(seq_len)[None, :]  # [1, L]
    if key_ends is None:
        keep = k_pos <= q_pos
    else:
        keep = k_pos + skipped < key_ends.to(torch.int64)[:, None]
    if see.bounded:
        keep &= k_pos >= see.first_keys(q_pos + skipped) - skipped
    return keep


def sink_prompt_attention(
    q: torch.Tensor,  # [Q, H, D]: the last Q positions of the sequence
    k: torch.Tensor,  # [L, KVH, D]
    v: torch.Tensor,  # [L, KVH, D]
    scale: float,
    see: Visibility | int | None,
    sinks: torch.Tensor,  # [H]
    skipped: int = 0,
) -> torch.Tensor:  # [Q, H, D]
    """prompt_attention with each head's sink logit in the denominator, the scores written
    out in float32."""
    num_queries, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    grouped = q.view(num_queries, num_kv_heads, group, head_dim)  # [Q, KVH, G, D]
    scores = torch.einsum("qkgd,lkd->kgql", grouped, k).float() * scale  # [KVH, G, Q, L]
    keep = visible_keys(num_queries, seq_len, see, skipped)
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_queries, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1].to(v.dtype)
    out = torch.einsum("kgql,lkd->qkgd", probs, v)  # [Q, KVH, G, D]
    return out.reshape(num_queries, num_heads, head_dim)
