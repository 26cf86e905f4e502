"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and the prefix cache.

This is the one owner of block state: the free list, the reference counts, the prefix hash maps
and the per-request block tables. The scheduler asks it for room (an opaque yes/no) and the model
runner reads block tables; neither touches the structures below.

Layers come in groups (engine_core/kv_groups.py): full attention, a sliding window of W
tokens, or chunked local attention of chunk C (a query at p sees [p // C * C, p]). Every group
has its own block table per request, all drawn from one pool: a block id names memory in one
layer of each group, so any group may take any free block. A model with one group has one table
per request and nothing below changes for it. With a window group (a chunked group is one whose
window starts at its chunk's start):

- block 0 is the null block, never handed out: a window group's table holds it in place of the
  blocks wholly behind the window, which are given back (registered with the prefix cache
  first) as the request advances; the attention backends never read a position behind a
  query's window, so the placeholder is never read;
- a prefix-cache hit of n blocks needs every full group's blocks 0..n-1 and each window group's
  blocks that the first recomputed token (at n * block_size) still sees: those from position
  n * block_size - W + 1 on, or for a chunked group from C * floor(n * block_size / C) on. The
  longest n for which every group has them is the hit.

A model with linear-attention layers (Qwen3-Next) also has the state kind: each running request
holds one state slot (``state_slots`` of them, as many as the running cap), taken by its first
``allocate_slots`` and given back by ``free``; the runner keeps the slot's tensors and the model
reads and writes them. Its state is a function of every token before it, so a prefix hit also
needs the state at the hit's end: saved states (engine_core/state_snapshots.py, ``snapshots``)
are kept under the hash of the block they end, taken where a prompt chunk starts on a block
boundary no later than the prompt's last one (``snapshot_chunk`` ends a chunk there) and where a
decode step starts on one (only a request's latest such save keeps its LRU place), and a hit
is the longest run of cached attention blocks that ends where a state was saved (none: a miss).
A hit's state is copied into the request's slot before its first step; the copies go to the
runner with the step's plan (``take_state_copies``). Without snapshots caching is off.

Every block but the null one is in exactly one of three states:

- free: reference count 0, no hash; handed out first.
- cached: reference count 0 but registered in its group's prefix hash map, so a later request
  with the same prefix can take it back; kept in LRU order and evicted (hash dropped) only when no
  free block is left.
- used: reference count > 0 (appears in that many block tables).

With a host KV tier (``--kv-offload-gb``, engine_core/kv_offload.py; one full-attention group
only), an evicted cached block's contents are kept in host memory under its hash, and a prefix
lookup that misses here goes on there: each consecutive block the host holds gets a new block,
registered at once, whose copy back the next step makes before its forward reads it. The copies
are recorded here and handed to the runner with the step's plan (``take_moves``).

Prefix caching hashes full blocks as a chain, ``h_i = hash_block(h_{i-1}, tokens of block i)``,
so a block's hash names the whole prefix up to its end; each group keeps its own map from hash to
block (the same prefix is a different block in each group). The chain starts from the request's
LoRA adapter (``prefix_root``): the base model and every adapter cache apart.
A block that holds any of an image's placeholder tokens hashes the image's hash with its tokens
(``block_key``; vLLM's "extra keys"): the placeholders are the same token whatever the image, so
without it two prompts with different images would share the blocks after the first image.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from engine_core.kv_groups import KVGroup, blocks_for_tokens
from engine_core.kv_offload import HostTier, KVMoves
from engine_core.request import Request
from engine_core.state_snapshots import KeptDraftState, StateMove, StateSnapshots

ROOT_HASH = 0  # the parent hash of a request's first block
NULL_BLOCK = 0  # with a window group: the placeholder for blocks behind the window


def prefix_root(request: Request) -> int:
    """The parent hash of a request's first block: ROOT_HASH for the base model, the adapter's
    own for a LoRA request (its K/V differ from the base model's on the same tokens), so the
    base model and each adapter have prefix chains of their own and never share a block."""
    if request.lora is None:
        return ROOT_HASH
    return hash(("lora", request.lora.name, request.lora.path))


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: the whole prefix up to the block's end is in it."""
    return hash((parent_hash, token_ids))


def block_key(request: Request, index: int, tokens: tuple[Any, ...]) -> tuple[Any, ...]:
    """What block ``index`` of ``request`` is keyed by: its tokens, then the hash of each image
    whose placeholders it holds (bytes, so never equal to a token)."""
    size = len(tokens)
    lo, hi = index * size, (index + 1) * size
    images = [i.hash for i in request.images if i.offset < hi and i.offset + i.length > lo]
    return tokens + tuple(images) if images else tokens


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in its group's prefix map
    group: int = 0  # whose prefix map holds its hash (meaningful while hash is set)
    # What the hash was computed from, compared on a hit so a collision is never a false hit.
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()

    def reset_hash(self) -> None:
        self.hash, self.parent_hash, self.token_ids = None, ROOT_HASH, ()


class BlockManager:
    """Reference-counted KV blocks with block tables per request (one per layer group) and an
    LRU prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
        attention_chunks: Sequence[int | None] = (),
        state_slots: int = 0,
        host_blocks: int = 0,
        state_snapshots: int = 0,
    ) -> None:
        """``windows``: each layer group's sliding window (None: full attention), group 0
        first; its table is the one a step's plan carries as ``block_ids``.
        ``attention_chunks``: each group's attention chunk beside it (empty: none chunked).
        ``state_slots``: the linear-attention state slots (0: the model has no such layers).
        ``host_blocks``: slots of the host KV tier (engine_core/kv_offload.py; 0: none), for a
        model of one full-attention group with prefix caching on. ``state_snapshots``: saved
        linear-attention states for prefix hits (0: none, and no hit with state slots)."""
        chunks = tuple(attention_chunks) or (None,) * len(windows)
        if len(chunks) != len(windows):
            raise ValueError(f"{len(chunks)} attention chunks for {len(windows)} groups")
        groups = [KVGroup(w, (), c) for w, c in zip(windows, chunks, strict=True)]
        has_window = any(group.gives_back for group in groups)
        if num_blocks <= int(has_window) or block_size <= 0 or not windows:
            raise ValueError(
                f"need num_blocks > {int(has_window)}, block_size > 0 and a group, got "
                f"{num_blocks}, {block_size}, {list(windows)}"
            )
        self.block_size = block_size
        # With state slots a hit needs a saved state at its end (module docstring).
        self.snapshots = (
            StateSnapshots(state_snapshots)
            if state_slots and state_snapshots and enable_prefix_caching
            else None
        )
        self.enable_prefix_caching = enable_prefix_caching and (
            not state_slots or self.snapshots is not None
        )
        self._restores: dict[str, int] = {}  # request id -> snapshot to copy into its new slot
        self._decode_saves: dict[str, int] = {}  # request id -> hash of its latest decode save
        self.num_state_slots = state_slots
        self._free_slots: deque[int] = deque(range(state_slots))
        self._slots: dict[str, int] = {}  # request id -> the state slot it holds
        # Speculation: the states after kept drafts, for the next plan, before its other copies.
        self._kept_drafts: list[KeptDraftState] = []
        self.windows = tuple(windows)
        self.attention_chunks = chunks
        self.num_groups = len(self.windows)
        # One table per request, no block ever given back: the hot paths take their shortcuts;
        # otherwise the scheduler's two per-row calls are the general ones.
        self._one_full_group = self.num_groups == 1 and not has_window
        if not self._one_full_group or state_slots:  # the general path takes a state slot
            self.table_covering = self._table_covering_groups  # type: ignore[method-assign]
            self.cache_computed_blocks = self._cache_group_blocks  # type: ignore[method-assign]
        # The placeholder of given-back blocks (never handed out), where a group has a window.
        self.null_block = NULL_BLOCK if has_window else None
        first = int(has_window)  # the null block is no block of the pool
        self.num_blocks = num_blocks - first  # blocks the pool hands out
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(first, num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self._hash_to_block: list[dict[int, int]] = [{} for _ in self.windows]
        # Block tables as int32 arrays, not lists: the scheduler copies each running request's
        # table every step and the runner flattens them all, both a memcpy for an array but a
        # per-element conversion for a list (thousands of ids a step at a large batch).
        self._group_tables: list[dict[str, array[int]]] = [{} for _ in self.windows]
        self._tables = self._group_tables[0]  # the hot path's: group 0
        # Chain hashes of the request's leading full blocks that are already accounted for
        # (one chain for every group: a hash names the tokens, not the memory).
        self._chain: dict[str, list[int]] = {}
        # Groups that give blocks back (windows, attention chunks): (index, group), and per
        # request how many leading entries of each such group's table are the null block.
        self._window_groups = [(g, group) for g, group in enumerate(groups) if group.gives_back]
        self._behind: dict[str, list[int]] = {}
        self.host_tier = self._host_tier(host_blocks)

    def _host_tier(self, num_slots: int) -> HostTier | None:
        """The host KV tier, where asked for; refused where a hit would need more than one
        full-attention table (the tier keeps whole blocks of one group) or caching is off."""
        if not num_slots:
            return None
        if not self._one_full_group or self.num_state_slots:
            raise ValueError(
                "--kv-offload-gb supports models whose layers are all full attention (no "
                "sliding-window, chunked or linear-attention layers)"
            )
        if not self.enable_prefix_caching:
            raise ValueError(
                "--kv-offload-gb keeps evicted prefix-cache blocks: it needs "
                "prefix caching (drop --no-enable-prefix-caching)"
            )
        return HostTier(num_slots)

    def take_moves(self) -> KVMoves | None:
        """The copies between the device pool and the host tier that the next step's forward
        must make first (None: none), handed over once."""
        tier = self.host_tier
        if tier is None or not tier.has_moves:
            return None
        return tier.take_moves()

    def take_state_copies(self) -> tuple[StateMove, ...]:
        """The copies into state slots (a kept draft's state, ``keep_draft_state``) and between
        slots and snapshots that the next step's forward must make first, in order (empty:
        none), handed over once. The kept drafts' come first: they were asked for by the last
        step's update, before this plan's saves and restores."""
        kept, self._kept_drafts = tuple(self._kept_drafts), []
        return kept + (() if self.snapshots is None else self.snapshots.take_copies())

    def keep_draft_state(self, request: Request, kept: int) -> None:
        """A verify step kept ``kept`` of the request's drafts, not all: its slot takes the
        state after the last kept one (the step wrote every position's; the slot holds the
        last position's). Nothing without state slots."""
        if self.num_state_slots:
            slot = self._slots[request.request_id]
            self._kept_drafts.append(KeptDraftState(slot, kept))

    def snapshot_chunk(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, cut to end at the prompt's last block boundary
        before its last token where the chunk would pass it, so a state is saved there (the
        state at a block boundary exists only between two steps)."""
        if self.snapshots is None:
            return num_new
        end = self._last_snapshot_point(request)
        return end - start if start < end < start + num_new else num_new

    def _last_snapshot_point(self, request: Request) -> int:
        """The latest position at which a state is saved: the prompt's last block boundary
        before its last token (a prompt sent again, or extended, hits up to there)."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    # ----------------------------------------------------------------------------- counters

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with no user that still hold a prefix (evictable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_host_blocks(self) -> int:
        """Slots of the host KV tier (0: none)."""
        return 0 if self.host_tier is None else self.host_tier.num_slots

    @property
    def num_host_used_blocks(self) -> int:
        """Host slots that hold a block."""
        return 0 if self.host_tier is None else self.host_tier.num_used_slots

    @property
    def num_host_hit_blocks(self) -> int:
        """Blocks prefix lookups found in the host tier since start."""
        return 0 if self.host_tier is None else self.host_tier.num_hits

    @property
    def num_host_stored_blocks(self) -> int:
        """Blocks copied to the host tier since start."""
        return 0 if self.host_tier is None else self.host_tier.num_stored

    @property
    def num_host_restored_blocks(self) -> int:
        """Blocks copied back from the host tier since start."""
        return 0 if self.host_tier is None else self.host_tier.num_restored

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def state_slot(self, request_id: str) -> int:
        """The state slot the request holds (KeyError where it holds none)."""
        return self._slots[request_id]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request's tables reference over every group (the null block not counted)."""
        return sum(
            sum(1 for b in tables.get(request_id, _EMPTY_TABLE) if b != self.null_block)
            for tables in self._group_tables
        )

    def max_tokens_per_sequence(self, chunk: int, limit: int) -> int:
        """The longest sequence, at most ``limit`` tokens, that the whole pool can hold at
        once, computed in chunks of at most ``chunk`` tokens (what every group holds at its
        peak: with window groups only, any length may fit)."""
        size, windows = self.block_size, self.windows
        if not self._window_groups:
            return min(limit, self.num_blocks // self.num_groups * size)
        lo, hi = 0, limit
        while lo < hi:  # the largest length whose peak fits: the peak only grows with it
            mid = (lo + hi + 1) // 2
            peak = blocks_for_tokens(windows, mid, size, chunk, self.attention_chunks)
            if peak <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """A copy of the request's block table in ``group`` (empty when it holds no blocks)."""
        return self._group_tables[group].get(request_id, _EMPTY_TABLE).tolist()

    def table_covering(self, request: Request, num_new_tokens: int) -> array[int] | None:
        """A copy of the request's block table once it covers ``num_computed_tokens +
        num_new_tokens`` tokens: as it is in the common decode step (the last block still has
        room), grown by ``allocate_slots`` where it must be (every block_size-th step); None,
        changing nothing, where free plus evictable blocks are too few. One call where the
        scheduler's hot loop would make two (``allocate_slots``, then ``block_table``). A
        manager with a window group or more than one group has ``_table_covering_groups`` in
        its place (set in ``__init__``), so this body stays the one-table hot path."""
        table = self._tables.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if table is not None:
            room = len(table) * self.block_size
            if num_tokens <= room:
                return table[:]
            if num_tokens <= room + self.block_size and (self._free or self._cached):
                # The decode step after its last block filled: one more block, as
                # allocate_slots would take it, without its general case's bookkeeping.
                table.append(self._take_new())
                return table[:]
        if not self.allocate_slots(request, num_new_tokens):
            return None
        return self._tables[request.request_id][:]

    def _table_covering_groups(self, request: Request, num_new_tokens: int) -> array[int] | None:
        """``table_covering`` with groups: ``allocate_slots`` (which also gives back what fell
        behind a window), then group 0's table."""
        if not self.allocate_slots(request, num_new_tokens):
            return None
        return self._tables[request.request_id][:]

    def block_table(self, request_id: str) -> array[int]:
        """A copy of group 0's block table as an int32 array (what a step's plan carries)."""
        return self._tables.get(request_id, _EMPTY_TABLE)[:]

    def group_tables(self, request_id: str) -> tuple[array[int], ...]:
        """Copies of the request's tables in groups 1.. (empty with one group)."""
        return tuple(t.get(request_id, _EMPTY_TABLE)[:] for t in self._group_tables[1:])

    # --------------------------------------------------------------------------- allocation

    def allocate_prefix(self, request: Request, use_cache: bool = True) -> int:
        """Give a request with no blocks the cached blocks of its longest cached prefix.

        Returns how many of its tokens are already computed (a multiple of block_size). At most
        ``(num_tokens - 1) // block_size`` blocks are reused, so at least the last token is
        recomputed and yields logits to sample from. ``use_cache=False``: no hit, empty tables
        (a request that needs every prompt position's logits). With window groups, see the
        module's docstring for what a hit needs.
        """
        rid = request.request_id
        if self._tables.get(rid):
            raise ValueError(f"request {rid!r} already holds blocks")
        chain: list[int] = []
        for tables in self._group_tables:
            tables[rid] = _new_table()
        self._chain[rid] = chain
        if self._window_groups:
            self._behind[rid] = [0] * self.num_groups
        if not self.enable_prefix_caching or not use_cache:
            return 0
        max_hits = (request.num_tokens - 1) // self.block_size
        if not self._one_full_group or self.snapshots is not None:
            return self._allocate_group_prefix(rid, request, max_hits)
        table, parent = self._tables[rid], prefix_root(request)
        for index, tokens in enumerate(self._full_blocks(request.token_ids, max_hits)):
            if request.images:
                tokens = block_key(request, index, tokens)
            block_hash = hash_block(parent, tokens)
            block = self._lookup(0, block_hash, parent, tokens)
            if block is None:
                break
            self._take_cached(block)
            table.append(block.block_id)
            chain.append(block_hash)
            parent = block_hash
        if self.host_tier is not None and len(table) < max_hits:
            self._restore_from_host(request, table, chain, max_hits)
        return len(table) * self.block_size

    def _restore_from_host(
        self, request: Request, table: array[int], chain: list[int], max_hits: int
    ) -> None:
        """Go on with the prefix chain in the host tier past the device's last hit: each
        consecutive block found there (as many as there are device blocks to take) gets a new
        device block, registered at once, and a copy back that the next step's forward makes
        before it reads the block. Every slot is claimed before any device block is taken, so
        the evictions that taking them makes never push a later block of the chain out."""
        tier = self.host_tier
        assert tier is not None
        size, token_ids = self.block_size, request.token_ids
        parent = chain[-1] if chain else prefix_root(request)
        claims: list[tuple[int, int, int, tuple[Any, ...]]] = []  # slot, hash, parent, key
        room = len(self._free) + len(self._cached)
        for index in range(len(table), min(max_hits, len(table) + room)):
            key = tuple(token_ids[index * size : (index + 1) * size])
            if request.images:
                key = block_key(request, index, key)
            block_hash = hash_block(parent, key)
            slot = tier.claim(block_hash, parent, key)
            if slot is None:
                break
            claims.append((slot, block_hash, parent, key))
            parent = block_hash
        for slot, block_hash, parent, key in claims:
            block_id = self._take_new()
            tier.restore(slot, block_id)
            self._register(self._blocks[block_id], 0, block_hash, parent, key)
            table.append(block_id)
            chain.append(block_hash)

    def _allocate_group_prefix(self, rid: str, request: Request, max_hits: int) -> int:
        """``allocate_prefix`` with more than one group, a window group or state slots."""
        hashes = self._chain_hashes(request, max_hits)
        hits = self._group_hits(hashes)
        num_hits = len(hits[0])
        while self.snapshots is not None:
            # Shortened to a saved state's end, a window group may lack blocks for the shorter
            # hit: shorten again until both agree (the lengths only fall).
            num_hits = self._hit_with_state(rid, hashes, num_hits)
            hits = self._group_hits(hashes[:num_hits])
            if len(hits[0]) == num_hits:
                break
            num_hits = len(hits[0])
        for group, blocks in enumerate(hits):
            table = self._group_tables[group][rid]
            for block in blocks:
                if block is None:
                    table.append(NULL_BLOCK)
                    self._behind[rid][group] += 1
                else:
                    self._take_cached(block)
                    table.append(block.block_id)
        self._chain[rid].extend(h for h, _, _ in hashes[:num_hits])
        return num_hits * self.block_size

    def _hit_with_state(
        self, rid: str, hashes: list[tuple[int, int, tuple[int, ...]]], num_hits: int
    ) -> int:
        """The longest hit of at most ``num_hits`` blocks whose last block ends where a state
        was saved (0: none), its snapshot noted for the request's slot (``allocate_slots``)."""
        assert self.snapshots is not None
        self._restores.pop(rid, None)
        for length in range(num_hits, 0, -1):
            snapshot = self.snapshots.find(*hashes[length - 1])
            if snapshot is not None:
                self._restores[rid] = snapshot
                return length
        return 0

    def _save_state(self, request: Request, slot: int) -> None:
        """Save the state ``slot`` holds when the next step starts, where the request's next
        chunk or decode starts (on a block boundary: the caller checks), keyed by the chain
        hash of the block ending there. Up to the prompt's last boundary each such state is
        kept; past it (the answer's, one a block of decode) only the request's latest keeps
        its place in the LRU order, the one before it demoted to be evicted first, and such
        decode saves hold at most half the pool (state_snapshots.py)."""
        assert self.snapshots is not None
        start = request.num_computed_tokens
        if not start:
            return
        entry = self._chain_entry(request, start // self.block_size)
        if start <= self._last_snapshot_point(request):
            self.snapshots.save(slot, *entry)
            return
        previous = self._decode_saves.pop(request.request_id, None)
        if previous is not None:
            self.snapshots.demote(previous)
        if self.snapshots.save(slot, *entry, decode=True):  # one refreshed is not its own
            self._decode_saves[request.request_id] = entry[0]

    def _chain_entry(self, request: Request, num_blocks: int) -> tuple[int, int, tuple[Any, ...]]:
        """(hash, parent hash, key) of block ``num_blocks - 1`` of the request's chain, going
        on from the hashes already registered (``_chain``) rather than from its first block."""
        chain, size = self._chain[request.request_id], self.block_size
        known = min(len(chain), num_blocks - 1)
        parent = chain[known - 1] if known else prefix_root(request)
        for index in range(known, num_blocks):
            key = tuple(request.token_ids[index * size : (index + 1) * size])
            if request.images:
                key = block_key(request, index, key)
            block_hash = hash_block(parent, key)
            if index == num_blocks - 1:
                return block_hash, parent, key
            parent = block_hash
        raise ValueError(f"no block {num_blocks - 1} to key")

    def _chain_hashes(self, request: Request, limit: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(hash, parent hash, key) of the first ``limit`` full blocks of ``request``, the chain
        starting from its adapter's root (``prefix_root``), each key its ``block_key``."""
        parent, out = prefix_root(request), []
        for index, tokens in enumerate(self._full_blocks(request.token_ids, limit)):
            if request.images:
                tokens = block_key(request, index, tokens)
            block_hash = hash_block(parent, tokens)
            out.append((block_hash, parent, tokens))
            parent = block_hash
        return out

    def _leading_hits(
        self, group: int, hashes: list[tuple[int, int, tuple[int, ...]]]
    ) -> list[_Block | None]:
        """One group's cached blocks for the leading run of ``hashes`` that it holds."""
        found: list[_Block | None] = []
        for block_hash, parent, tokens in hashes:
            block = self._lookup(group, block_hash, parent, tokens)
            if block is None:
                break
            found.append(block)
        return found

    def _group_hits(
        self, hashes: list[tuple[int, int, tuple[int, ...]]]
    ) -> list[list[_Block | None]]:
        """Every group's blocks of the longest hit all groups allow, each list as long as the
        hit; a window group's entries behind the first recomputed token's window are None."""
        giving_back = dict(self._window_groups)
        found: list[list[_Block | None]] = []
        limit = len(hashes)  # no longer than any full group's leading run of hits
        for g in range(self.num_groups):
            if g in giving_back:
                found.append([self._lookup(g, *entry) for entry in hashes])
            else:
                found.append(self._leading_hits(g, hashes[:limit]))
                limit = len(found[-1])
        while limit > 0 and not all(
            all(b is not None for b in found[g][self._first_seen(limit, group) : limit])
            for g, group in self._window_groups
        ):
            limit -= 1
        hits = [found[group][:limit] for group in range(self.num_groups)]
        for g, group in self._window_groups:
            first = self._first_seen(limit, group)
            hits[g] = [None] * first + hits[g][first:]
        return hits

    def _first_seen(self, num_blocks: int, group: KVGroup) -> int:
        """The first block the token at ``num_blocks * block_size`` sees in ``group``."""
        return group.first_seen(num_blocks * self.block_size) // self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block tables to cover ``num_computed_tokens + num_new_tokens`` tokens.

        Returns False, changing nothing else, when free plus evictable blocks are too few. With
        a window group, the blocks wholly behind the window of the next token to compute
        (``num_computed_tokens``) are given back first, whatever the answer: no query of this
        request will read them again (a speculative rollback never moves below it).
        """
        rid = request.request_id
        table = self._tables.get(rid)
        num_tokens = request.num_computed_tokens + num_new_tokens
        needs_slot = self.num_state_slots > 0 and rid not in self._slots
        if needs_slot and not self._free_slots:
            return False  # as many requests as slots run already
        if self._window_groups and table is not None:
            self._release_behind_windows(request, request.num_computed_tokens)
        if table is not None and num_tokens <= len(table) * self.block_size:
            if needs_slot:
                self._take_state_slot(request)
            elif self.snapshots is not None and not request.num_computed_tokens % self.block_size:
                self._save_state(request, self._slots[rid])
            return True  # the common decode step: the last block still has room
        width = 0 if table is None else len(table)
        num_needed = (-(-num_tokens // self.block_size) - width) * self.num_groups
        if num_needed > len(self._free) + len(self._cached):
            return False
        if needs_slot:
            self._take_state_slot(request)
        elif self.snapshots is not None and not request.num_computed_tokens % self.block_size:
            self._save_state(request, self._slots[rid])
        if table is None:
            for tables in self._group_tables:
                tables[rid] = _new_table()
            self._chain[rid] = []
            if self._window_groups:
                self._behind[rid] = [0] * self.num_groups
        for tables in self._group_tables:
            grown = tables[rid]
            for _ in range(num_needed // self.num_groups):
                grown.append(self._take_new())
        return True

    def _take_state_slot(self, request: Request) -> None:
        """Give the request a free state slot, the state of its prefix hit copied in first."""
        slot = self._slots[request.request_id] = self._free_slots.popleft()
        snapshot = self._restores.pop(request.request_id, None)
        if snapshot is not None:
            assert self.snapshots is not None
            self.snapshots.restore(snapshot, slot)

    def _release_behind_windows(self, request: Request, next_position: int) -> None:
        """Give back each window group's blocks that no query at ``next_position`` or later
        sees, putting the null block in their place. They are registered with the prefix cache
        first (their tokens are known: a placeholder is never behind a window), or a later
        request could never hit the prefix they end: with overlap, the update that would
        register them comes after the plan that gives them back."""
        rid = request.request_id
        behind = self._behind[rid]
        firsts = [
            (g, group.first_seen(next_position) // self.block_size)
            for g, group in self._window_groups
        ]
        if all(first <= behind[g] for g, first in firsts):
            return  # most steps: no block fell behind a window
        self.cache_computed_blocks(request, max(first for _, first in firsts) * self.block_size)
        for g, first in firsts:
            start = behind[g]
            table = self._group_tables[g][rid]
            end = min(first, len(table))
            for index in range(start, end):
                self._release(table[index])
                table[index] = NULL_BLOCK
            behind[g] = max(start, end)

    def cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks that became full of computed tokens, so others can share them.
        With groups, ``_cache_group_blocks`` takes its place (set in ``__init__``)."""
        if not self.enable_prefix_caching:
            return
        chain = self._chain[request.request_id]
        num_full = min(num_computed_tokens, len(request.token_ids)) // self.block_size
        if num_full <= len(chain):
            return  # most steps: no block became full
        table = self._tables[request.request_id]
        for index, block_hash, parent, key in self._newly_full(request, chain, num_full):
            self._register(self._blocks[table[index]], 0, block_hash, parent, key)

    def forget_prefixes(self) -> None:
        """Unregister every block: cached ones become free, used ones stay with their requests
        and go to the free list when released (after a failed step, whose planned blocks may
        hold no K/V; the scheduler's step_failed)."""
        for hashes in self._hash_to_block:
            for block_id in hashes.values():
                self._blocks[block_id].reset_hash()
            hashes.clear()
        self._free.extend(self._cached)
        self._cached.clear()

    def _cache_group_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """``cache_computed_blocks`` in every group; a window group's block already given back
        (the null block in its place) is not registered."""
        if not self.enable_prefix_caching:
            return
        chain = self._chain[request.request_id]
        num_full = min(num_computed_tokens, len(request.token_ids)) // self.block_size
        if num_full <= len(chain):
            return
        tables = [t[request.request_id] for t in self._group_tables]
        for index, block_hash, parent, key in self._newly_full(request, chain, num_full):
            for group, table in enumerate(tables):
                block_id = table[index]
                if block_id != self.null_block:
                    self._register(self._blocks[block_id], group, block_hash, parent, key)

    def _newly_full(
        self, request: Request, chain: list[int], num_full: int
    ) -> Iterator[tuple[int, int, int, tuple[Any, ...]]]:
        """(index, hash, parent hash, key) of each block from ``len(chain)`` to ``num_full``,
        each hash appended to ``chain`` as it is made. Block by block, slicing each from the
        token list: a decode step fills one block, and building the list of the full blocks
        first cost that common case twice as much."""
        token_ids, size = request.token_ids, self.block_size
        parent = chain[-1] if chain else prefix_root(request)
        for index in range(len(chain), num_full):
            key = tuple(token_ids[index * size : (index + 1) * size])
            if request.images:
                key = block_key(request, index, key)
            block_hash = hash_block(parent, key)
            chain.append(block_hash)
            yield index, block_hash, parent, key
            parent = block_hash

    def free(self, request_id: str) -> None:
        """Release all the request's blocks; unknown ids are ignored.

        Blocks are released tail first, so the tail of a prefix is the first to be evicted and
        the shared head of a prefix stays longest.
        """
        self._chain.pop(request_id, None)
        self._behind.pop(request_id, None)
        self._restores.pop(request_id, None)  # a hit whose admission failed
        self._decode_saves.pop(request_id, None)  # its last one stays: a next turn's hit
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        for tables in self._group_tables:
            for block_id in reversed(tables.pop(request_id, _EMPTY_TABLE)):
                if block_id != self.null_block:
                    self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is None:
            self._free.append(block_id)
        else:
            self._cached[block_id] = None

    # ------------------------------------------------------------------------------ helpers

    def _full_blocks(self, token_ids: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        size = self.block_size
        count = min(limit, len(token_ids) // size)
        return [tuple(token_ids[i * size : (i + 1) * size]) for i in range(count)]

    def _lookup(
        self, group: int, block_hash: int, parent: int, tokens: tuple[int, ...]
    ) -> _Block | None:
        block_id = self._hash_to_block[group].get(block_hash)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.parent_hash != parent or block.token_ids != tokens:
            return None  # a hash collision: not the same prefix
        return block

    def _take_cached(self, block: _Block) -> None:
        if block.ref_count == 0:
            del self._cached[block.block_id]  # revived: no longer evictable
        block.ref_count += 1

    def _take_new(self) -> int:
        """A block for new tokens: a free one if any, else evict the least recently used (its
        contents kept in the host tier, where there is one)."""
        block_id = self._free.popleft() if self._free else self._evict_lru()
        if self.host_tier is not None:
            # A copy back into it not made yet is void: whoever restored it let it go.
            self.host_tier.forget_block(block_id)
        self._blocks[block_id].ref_count = 1
        return block_id

    def _evict_lru(self) -> int:
        """Drop the least recently used cached block's hash (keeping its contents in the host
        tier, where there is one) and hand it out."""
        block_id, _ = self._cached.popitem(last=False)
        block = self._blocks[block_id]
        assert block.hash is not None
        del self._hash_to_block[block.group][block.hash]
        if self.host_tier is not None:
            self.host_tier.offload(block_id, block.hash, block.parent_hash, block.token_ids)
        block.reset_hash()
        return block_id

    def _register(
        self, block: _Block, group: int, block_hash: int, parent: int, tokens: tuple[int, ...]
    ) -> None:
        # When the hash is taken (the same prefix computed twice at once, or a collision) the
        # first block keeps it; this one stays unhashed and goes to the free list when released.
        hashes = self._hash_to_block[group]
        if block.hash is not None or block_hash in hashes:
            return
        block.hash, block.group, block.parent_hash, block.token_ids = (
            block_hash, group, parent, tokens,
        )  # fmt: skip
        hashes[block_hash] = block.block_id

    # ---------------------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError when any two views of the block state disagree."""
        null = self.null_block
        refs = Counter(
            b for tables in self._group_tables for t in tables.values() for b in t if b != null
        )
        free, cached = set(self._free), set(self._cached)
        _require(len(free) == len(self._free), "duplicate block in the free list")
        _require(not free & cached, f"blocks both free and cached: {sorted(free & cached)}")
        self._check_tables()
        for block in self._blocks:
            if block.block_id == null:
                _require(
                    block.ref_count == 0 and block.hash is None and null not in free | cached,
                    "the null block was handed out or hashed",
                )
                continue
            self._check_block(block, refs[block.block_id], free, cached)
        for group, hashes in enumerate(self._hash_to_block):
            for block_hash, block_id in hashes.items():
                block = self._blocks[block_id]
                _require(
                    block.hash == block_hash and block.group == group,
                    f"stale hash entry {block_id} in group {group}",
                )
        used = sum(1 for b in self._blocks if b.ref_count > 0)
        _require(
            len(free) + len(cached) + used == self.num_blocks,
            f"free {len(free)} + cached {len(cached)} + used {used} != {self.num_blocks}",
        )
        self._check_state_slots()
        if self.snapshots is not None:
            self.snapshots.check_integrity()
        if self.host_tier is not None:
            self.host_tier.check_integrity()

    def _check_state_slots(self) -> None:
        """Every state slot free or held by exactly one request, each holder with tables, and
        every request whose tables hold a block holding a slot."""
        held = list(self._slots.values())
        slots = sorted(held + list(self._free_slots))
        _require(slots == list(range(self.num_state_slots)), f"state slots lost: {slots}")
        _require(self._slots.keys() <= self._tables.keys(), "a slot held by a request gone")
        _require(
            self._restores.keys() <= self._tables.keys() - self._slots.keys(),
            "a snapshot to restore for a request gone or already holding its slot",
        )
        _require(self._decode_saves.keys() <= self._slots.keys(), "a decode save's owner gone")
        if self.num_state_slots:
            for request_id, table in self._tables.items():
                _require(
                    not table or request_id in self._slots,
                    f"{request_id} holds blocks but no state slot",
                )

    def _check_tables(self) -> None:
        """One table per group for each request, all as long; nulls only where a window
        group gave blocks back (its leading entries)."""
        for request_id, table in self._tables.items():
            for group, tables in enumerate(self._group_tables):
                other = tables.get(request_id)
                _require(
                    other is not None and len(other) == len(table),
                    f"{request_id}: group {group}'s table differs in length from group 0's",
                )
                assert other is not None
                behind = self._behind[request_id][group] if self._window_groups else 0
                real = other[behind:]
                _require(len(set(real)) == len(real), f"block twice in one table: {other}")
                _require(
                    all(b == self.null_block for b in other[:behind]),
                    f"{request_id}: group {group}'s leading entries are not the null block",
                )
                _require(
                    self.null_block is None or self.null_block not in real,
                    f"{request_id}: group {group} holds the null block past its window",
                )
        for tables in self._group_tables:
            _require(tables.keys() == self._tables.keys(), "a request lacks a group's table")
        for request_id, chain in self._chain.items():
            _require(len(chain) <= len(self._tables[request_id]), f"chain too long: {request_id}")

    def _check_block(self, block: _Block, refs: int, free: set[int], cached: set[int]) -> None:
        bid = block.block_id
        _require(block.ref_count == refs, f"block {bid}: ref {block.ref_count}, in {refs} tables")
        if block.hash is not None:
            group_map = self._hash_to_block[block.group]
            _require(group_map.get(block.hash) == bid, f"block {bid}: hash not mapped")
        if bid in free:
            _require(block.ref_count == 0 and block.hash is None, f"free block {bid} in use")
        elif bid in cached:
            _require(block.ref_count == 0 and block.hash is not None, f"cached block {bid} bad")
        else:
            _require(block.ref_count > 0, f"block {bid} leaked: unused yet neither free nor cached")


_EMPTY_TABLE: array[int] = array("i")  # never mutated: the default of lookups


def _new_table() -> array[int]:
    return array("i")


def _require(condition: bool, message: str) -> None:
    # Explicit raise rather than assert: the check must also hold under python -O.
    if not condition:
        raise AssertionError(message)
